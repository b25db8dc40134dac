"""Byte-level BPE (GPT-2, RoBERTa, BART)."""

import functools
from collections.abc import Iterable

import numpy as np
import regex
import tensorflow as tf

from pretrain_lm.data.tokenizer.base import (
  BYTE_BPE_TYPE,
  Tokenizer,
  parse_json,
  spec_error,
  special_ids_by_name,
)

# GPT-2's pre-tokenisation (openai/gpt-2 encoder.py), kept by RoBERTa and
# BART: contractions, letters, digits and other symbols each with one
# optional leading space; runs of whitespace keep their last space for the
# next word.
_GPT2_SPLIT = regex.compile(
  r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
  r'|\s+(?!\S)|\s+'
)
# Bytes UTF-8 text never contains: their byte tokens are never encoded.
_NON_UTF8_BYTES = (*range(0xFF, 0xF4, -1), 0xC1, 0xC0)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table of the byte-level vocabs.

  Printable Latin-1 bytes map to themselves, the rest to U+0100 onwards, so
  a token is a string without whitespace or control characters (' ' is 'Ġ').
  """
  printable = [
    *range(ord('!'), ord('~') + 1),
    *range(ord('¡'), ord('¬') + 1),
    *range(ord('®'), ord('ÿ') + 1),
  ]
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


class PyFunctionTfTokenizer:
  """A Python tokenizer as a TF op (tf.numpy_function), for tf.data.

  Slower than a native op: it holds Python's GIL while it runs (so parallel
  map calls do not overlap), and the graph cannot be serialised (e.g. for
  the tf.data service). Byte-level BPE has no tensorflow_text op.
  """

  def __init__(self, encode):
    self._encode = encode

  def _encode_batch(self, strings: np.ndarray):
    ids = [
      self._encode(s.decode('utf-8', errors='replace'))
      for s in strings.reshape(-1)
    ]
    values = np.fromiter((i for row in ids for i in row), np.int32)
    return values, np.array([len(row) for row in ids], np.int64)

  def tokenize(self, strings) -> tf.RaggedTensor:
    """int32 ids of each string (rank 0 or 1), ragged along its tokens."""
    strings = tf.convert_to_tensor(strings, tf.string)
    if strings.shape.rank not in (0, 1):
      raise ValueError(f'Expected a scalar or vector of strings: {strings}.')
    values, lengths = tf.numpy_function(
      self._encode_batch,
      [strings],
      [tf.int32, tf.int64],
      stateful=False,
      name='byte_bpe_tokenize',
    )
    values.set_shape([None])
    lengths.set_shape([None])
    ids = tf.RaggedTensor.from_row_lengths(values, lengths, validate=False)
    return ids[0] if strings.shape.rank == 0 else ids


class ByteBpeTokenizer(Tokenizer, kind=BYTE_BPE_TYPE):
  """Byte-level BPE (GPT-2, RoBERTa, BART), from vocab.json + merges.txt.

  The file is JSON: {"type": "byte_bpe", "vocab": [token of id 0, ...],
  "merges": ["Ġ t", ... by rank], "special": {"pad", "unk", "cls", "sep",
  "mask": token or null}, "add_prefix_space": bool, "mask_lstrip": bool
  (default true)}, plus the imported
  "hf_tokenizer_config" and "hf_special_tokens_map" that export writes
  back. Encoding is GPT-2's: the pre-tokenisation regex, each word's UTF-8
  bytes as bytes_to_unicode() characters, then the merges by rank.

  Special tokens: RoBERTa and BART have cls <s>=0, pad <pad>=1, sep
  </s>=2, unk <unk>=3 and mask <mask> last; train_tokenizer puts the same
  five at SPECIAL_PIECES' fixed ids (<pad>=0, ..., <mask>=4). The mask
  token's text in the input encodes to mask_id and, with mask_lstrip
  (RoBERTa's and BART's lstrip=True), takes the whitespace before it: '...
  is <mask>.' masks the token ' Paris'. The other specials' texts are
  encoded as text (Hugging Face matches them all). GPT-2 has only
  <|endoftext|>: it is cls, sep (it ends each document) and unk, and
  mask_id is NO_ID. GPT-2 has no padding token, and padding must differ
  from the document separator (the pipeline tells packed documents apart
  by it), so pad_id is the token of byte 0xFF, which UTF-8 text never
  contains: encode() never emits it.
  """

  def _load(self) -> None:
    spec = parse_json(self._model_bytes)
    if spec is None or spec.get('type') != BYTE_BPE_TYPE:
      raise spec_error(self.path, BYTE_BPE_TYPE, 'not such a JSON document')
    vocab, merges = spec.get('vocab'), spec.get('merges')
    if not (
      isinstance(vocab, list)
      and vocab
      and all(isinstance(t, str) and t for t in vocab)
      and len(set(vocab)) == len(vocab)
    ):
      raise spec_error(
        self.path, BYTE_BPE_TYPE, '"vocab" must list distinct tokens'
      )
    if not isinstance(merges, list) or not all(
      isinstance(m, str) and len(m.split(' ')) == 2 for m in merges
    ):
      raise spec_error(
        self.path, BYTE_BPE_TYPE, '"merges" must list "left right" strings'
      )
    self.vocab: list[str] = vocab
    self.merges: list[str] = merges
    self.token_ids = {t: i for i, t in enumerate(vocab)}
    self._ranks = {tuple(m.split(' ')): r for r, m in enumerate(merges)}
    special = dict(spec.get('special') or {})
    if special.get('cls') is None:
      special['cls'] = special.get('sep')
    if special.get('pad') is None:
      special['pad'] = self._unused_byte_token()
    self._special = special_ids_by_name(
      self.path,
      BYTE_BPE_TYPE,
      special,
      self.token_ids,
      required=('pad', 'cls', 'sep'),
    )
    self._special_set = set(self._special.values())
    self._add_prefix_space = bool(spec.get('add_prefix_space', False))
    self._mask_lstrip = bool(spec.get('mask_lstrip', True))
    self._byte_encoder = bytes_to_unicode()
    self._byte_decoder = {c: b for b, c in self._byte_encoder.items()}
    mask = self.mask_token
    lstrip = r'\s*' if self._mask_lstrip else ''
    self._mask_split = (
      None if mask is None else regex.compile(lstrip + regex.escape(mask))
    )
    self._spec = spec
    self._cache: dict[str, tuple[int, ...]] = {}

  def _unused_byte_token(self) -> str:
    """A byte token that UTF-8 text never produces, to pad with."""
    for b in _NON_UTF8_BYTES:
      token = bytes_to_unicode()[b]
      if token in self.token_ids:
        return token
    raise spec_error(
      self.path,
      BYTE_BPE_TYPE,
      'it has no pad token and no byte token that UTF-8 never uses',
    )

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  @property
  def mask_token(self) -> str | None:
    return self.vocab[self.mask_id] if self.mask_id >= 0 else None

  @property
  def first_normal_id(self) -> int:
    """The first id after the specials that open the vocab (RoBERTa: 4).

    RoBERTa's <mask> is the last id, so random replacement may draw it,
    once in ~50k draws.
    """
    specials = set(self._special.values())
    i = 0
    while i in specials:
      i += 1
    return i

  def _bpe(self, word: str) -> tuple[int, ...]:
    """Ids of one pre-tokenised word (bytes_to_unicode characters)."""
    if word in self._cache:
      return self._cache[word]
    parts = list(word)
    while len(parts) > 1:
      pairs = set(zip(parts, parts[1:], strict=False))
      best = min(pairs, key=lambda p: self._ranks.get(p, len(self._ranks)))
      if best not in self._ranks:
        break
      merged, i = [], 0
      while i < len(parts):
        if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
          merged.append(parts[i] + parts[i + 1])
          i += 2
        else:
          merged.append(parts[i])
          i += 1
      parts = merged
    ids = tuple(self.token_ids.get(p, self.unk_id) for p in parts)
    if len(self._cache) < 1 << 20:
      self._cache[word] = ids
    return ids

  def _encode_text(self, text: str) -> list[int]:
    if self._add_prefix_space and not text.startswith(' '):
      text = ' ' + text
    ids = []
    for word in _GPT2_SPLIT.findall(text):
      chars = ''.join(self._byte_encoder[b] for b in word.encode('utf-8'))
      ids.extend(self._bpe(chars))
    return ids

  def encode(self, text: str) -> list[int]:
    if self._mask_split is None:
      return self._encode_text(text)
    ids = []
    for k, chunk in enumerate(self._mask_split.split(text)):
      if k:
        ids.append(self.mask_id)
      if chunk:
        ids.extend(self._encode_text(chunk))
    return ids

  def _token_bytes(self, i: int) -> bytes:
    """The bytes token `i` stands for; a special's text for the specials."""
    token = self.vocab[i]
    if i in self._special_set or any(
      c not in self._byte_decoder for c in token
    ):
      return token.encode('utf-8')
    return bytes(self._byte_decoder[c] for c in token)

  def decode(self, ids: Iterable[int]) -> str:
    """The text of the bytes of `ids`; specials read '<s>' etc."""
    data = b''.join(
      self._token_bytes(i) for i in map(int, ids) if i != self.pad_id
    )
    return data.decode('utf-8', errors='replace')

  def piece_texts(self) -> list[str]:
    return [
      ''
      if i in self._special_set
      else self._token_bytes(i).decode('utf-8', errors='replace')
      for i in range(self.vocab_size)
    ]

  def tf_tokenizer(self) -> PyFunctionTfTokenizer:
    return PyFunctionTfTokenizer(self.encode)
