"""Model input rows shared by the task modules: layouts, padding, word pieces.

Every task turns text into rows of token ids with static shapes. Encoders
(and encoder-decoders, which feed the same row to both stacks) read
`[CLS] A [SEP] (B [SEP])`, BERT's layout; decoders read `A [SEP] (B
[SEP])` and classify the last real token, as GPT's fine-tuning does. Only
the tokenizer's special-id properties are used, never literal ids.
"""

import re
from collections.abc import Sequence

import numpy as np

# The one family that has no [CLS] in front (a causal model's first token
# sees nothing, so it cannot summarise the input).
DECODER = 'decoder'


def has_cls(family: str) -> bool:
  """Whether rows of this model family start with [CLS]."""
  return family != DECODER


def truncate_pair(
  tokens_a: Sequence[int], tokens_b: Sequence[int], max_tokens: int
) -> tuple[list[int], list[int]]:
  """Shortens the longer of the two, one token at a time from its end.

  BERT's `_truncate_seq_pair`: a short sentence keeps all its tokens, since a
  token of it carries more of its meaning than one of the long sentence.
  """
  a, b = list(tokens_a), list(tokens_b)
  while len(a) + len(b) > max_tokens:
    if len(a) > len(b):
      a.pop()
    else:
      b.pop()
  return a, b


def pair_row(
  tokenizer,
  tokens_a: Sequence[int],
  tokens_b: Sequence[int] | None,
  *,
  seq_len: int,
  family: str,
) -> tuple[list[int], list[int]]:
  """Token ids and token type ids (0: A part, 1: B part) of one row."""
  cls = [tokenizer.cls_id] if has_cls(family) else []
  num_special = len(cls) + 1 + (tokens_b is not None)
  # A pair needs a token of each sentence to be a pair at all.
  need = num_special + 1 + (tokens_b is not None)
  if seq_len < need:
    raise ValueError(
      f'seq_len={seq_len} leaves no room for the text: a {family} row '
      f'needs {num_special} special tokens; use seq_len >= {need}.'
    )
  a, b = truncate_pair(tokens_a, tokens_b or [], seq_len - num_special)
  ids = cls + a + [tokenizer.sep_id]
  types = [0] * len(ids)
  if tokens_b is not None:
    ids += b + [tokenizer.sep_id]
    types += [1] * (len(b) + 1)
  return ids, types


def pad(rows: Sequence[Sequence[int]], seq_len: int, value: int) -> np.ndarray:
  """int32 [N, seq_len]: each row (a list or array) padded with `value`."""
  out = np.full((len(rows), seq_len), value, np.int32)
  for i, row in enumerate(rows):
    if len(row) > seq_len:
      raise ValueError(f'Row {i} has {len(row)} > seq_len={seq_len} tokens.')
    out[i, : len(row)] = row
  return out


def model_rows(
  tokenizer,
  ids: Sequence[Sequence[int]],
  type_ids: Sequence[Sequence[int]],
  *,
  seq_len: int,
) -> dict[str, np.ndarray]:
  """'input_ids', 'input_mask' and 'token_type_ids', padded to seq_len."""
  input_ids = pad(ids, seq_len, tokenizer.pad_id)
  # The mask comes from the row lengths, not from ids != pad_id, so a
  # tokenizer whose pad id is also a real token would still work.
  lengths = np.asarray([len(row) for row in ids], np.int32).reshape(-1, 1)
  return {
    'input_ids': input_ids,
    'input_mask': (np.arange(seq_len) < lengths).astype(np.int32),
    'token_type_ids': pad(type_ids, seq_len, 0),
  }


# A word's pieces: ids, and each piece's [start, end) characters in the word.
WordPieces = tuple[list[int], list[tuple[int, int]]]


def _aligned(decoded: str, text: str) -> int | None:
  """Where `decoded` (a tokenizer's decode of `text`) starts in `text`."""
  for start in (0, len(text) - len(text.lstrip())):
    rest = text[start:]
    if decoded == rest or (
      len(decoded) == len(rest) and decoded.lower() == rest.lower()
    ):
      return start
  return None


def _piece_spans(tokenizer, ids: list[int], text: str):
  """Each piece's [start, end) in `text`, or None where decoding disagrees.

  Decodes every prefix of the pieces: where each is a prefix of the whole
  decode and that equals `text` (ignoring case, for uncased WordPiece, and
  the leading space SentencePiece drops), the prefix lengths are the piece
  boundaries. No tokenizer needs to report offsets itself.
  """
  prefixes = [tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
  start = _aligned(prefixes[-1], text)
  if start is None:
    return None
  full = prefixes[-1].lower()
  if not all(full.startswith(p.lower()) for p in prefixes):
    return None
  ends = [start + len(p) for p in prefixes]
  return list(zip([start] + ends[:-1], ends, strict=True))


def word_pieces(
  tokenizer, word: str, first: bool, cache: dict | None = None
) -> WordPieces:
  """Token ids of one whitespace-free word, with character spans in it.

  A word after the first is encoded with a space in front: byte-level BPE and
  character vocabularies see it as they do inside running text, while
  SentencePiece and WordPiece ignore the space. A piece that decodes to that
  space gets the empty span (0, 0). Where the pieces do not decode back to
  the word, each piece spans the whole word (BERT's run_squad granularity).
  A word that encodes to nothing becomes [UNK], so every word has a piece.
  """
  key = (word, first)
  if cache is not None and key in cache:
    return cache[key]
  text = word if first else ' ' + word
  shift = len(text) - len(word)
  ids = list(tokenizer.encode(text)) or [tokenizer.unk_id]
  spans = _piece_spans(tokenizer, ids, text)
  if spans is None:
    spans = [(0, len(word))] * len(ids)
  else:
    spans = [
      (min(max(s - shift, 0), len(word)), min(max(e - shift, 0), len(word)))
      for s, e in spans
    ]
  if cache is not None:
    cache[key] = (ids, spans)
  return ids, spans


# BERT's run_squad `is_whitespace`: the characters that separate words.
_WORD = re.compile('[^ \t\r\n\u202f]+')


def split_words(text: str) -> tuple[list[str], list[int]]:
  """Whitespace-separated words of `text` and each word's first character."""
  matches = list(_WORD.finditer(text))
  return [m.group() for m in matches], [m.start() for m in matches]
