"""Tokenizers: our own (SentencePiece, characters, WordPiece, byte-level BPE)
and imported ones.

Tokenizers this project trains have the same five special tokens at fixed
ids: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4 (a byte-level BPE names
them as RoBERTa does: <pad>, <unk>, <s>, </s>, <mask>). Tokenizers imported
with a Hugging Face checkpoint keep their own ids (BERT's [PAD]=0,
[CLS]=101; RoBERTa's <s>=0, <pad>=1), so code must read `pad_id`, `cls_id`,
... from the tokenizer, never assume them. A token a tokenizer lacks (T5 and
GPT-2 have no mask token) has id NO_ID = -1, which matches no real id.

Every kind shares one interface (`Tokenizer`) and one file name in a workdir
(WORKDIR_FILENAME); loading tells the kinds apart by content:

- a SentencePiece model proto ('unigram' or 'bpe' that we train, or an
  imported T5 `spiece.model`): binary, never starts with '{';
- JSON documents with a "type" field: 'char' (our character vocabulary),
  'wordpiece' (BERT's vocab.txt and settings) and 'byte_bpe' (GPT-2,
  RoBERTa and BART's vocab.json and merges.txt).

`import_hf_tokenizer` and `export_hf_tokenizer` convert from and to the
Hugging Face files; `train_tokenizer` trains every kind but T5's (WordPiece
and byte-level BPE with the Hugging Face tokenizers library, written as the
importer writes them).
"""

import functools
import io
import json
import os
import tempfile
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import ml_collections
import numpy as np
import regex
import sentencepiece as spm
import tensorflow as tf
import tensorflow_text as tf_text
import tokenizers
from absl import logging

from pretrain_lm.data import prepared, records, sources

SPECIAL_PIECES = {
  'pad': ('[PAD]', 0),
  'unk': ('[UNK]', 1),
  'cls': ('[CLS]', 2),
  'sep': ('[SEP]', 3),
  'mask': ('[MASK]', 4),
}
# The id of a special token the tokenizer does not have: equal to no token,
# so `ids != NO_ID` holds everywhere and lists of special ids stay ints.
NO_ID = -1
CHAR_TYPE = 'char'
WORDPIECE_TYPE = 'wordpiece'
BYTE_BPE_TYPE = 'byte_bpe'
# data.tokenizer_type: SentencePiece's two, characters, or BERT's WordPiece
# and GPT-2's byte-level BPE (trained with the tokenizers library).
MODEL_TYPES = ('unigram', 'bpe', CHAR_TYPE, WORDPIECE_TYPE, BYTE_BPE_TYPE)
# The file a run keeps its tokenizer in, inside the workdir.
WORKDIR_FILENAME = 'tokenizer.model'


def _read(path: str, size: int = -1) -> bytes:
  """The first `size` bytes of the file (all for -1)."""
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f'Tokenizer file not found: {path!r}.')
  with tf.io.gfile.GFile(path, 'rb') as f:
    return f.read(size)


def _parse_json(model_bytes: bytes) -> dict | None:
  """The JSON object in `model_bytes`, or None if it holds none."""
  try:
    spec = json.loads(model_bytes.decode('utf-8'))
  except ValueError:  # UnicodeDecodeError and JSONDecodeError included
    return None
  return spec if isinstance(spec, dict) else None


def _tokenizer_class(path: str) -> type['Tokenizer']:
  """The class for the file at `path`, from its content."""
  # A SentencePiece proto starts with a field tag (0x0a for its pieces), never
  # '{', so the first bytes tell it from the JSON kinds.
  if _read(path, 64).lstrip()[:1] != b'{':
    return SentencePieceTokenizer
  spec = _parse_json(_read(path)) or {}
  kinds = {
    CHAR_TYPE: CharTokenizer,
    WORDPIECE_TYPE: WordPieceTokenizer,
    BYTE_BPE_TYPE: ByteBpeTokenizer,
  }
  if spec.get('type') not in kinds:
    raise ValueError(
      f'{path!r} is not a tokenizer file: JSON tokenizers need a "type" '
      f'field, one of {sorted(kinds)}; got {spec.get("type")!r}.'
    )
  return kinds[spec['type']]


class Tokenizer:
  """The interface of every tokenizer here, and its special ids.

  `Tokenizer(path)` loads the file at `path` (local or gs://) as the kind its
  content shows: a `SentencePieceTokenizer` for a proto, else the JSON
  document's "type": `CharTokenizer`, `WordPieceTokenizer` or
  `ByteBpeTokenizer`.
  """

  # Name -> id of the special tokens; imported kinds set their own in _load.
  _special: dict[str, int] = {
    name: i for name, (_, i) in SPECIAL_PIECES.items()
  }

  def __new__(cls, path: str):
    if cls is Tokenizer:
      cls = _tokenizer_class(path)
    return super().__new__(cls)

  def __init__(self, path: str):
    self.path = path
    self._model_bytes = _read(path)
    self._load()

  def _load(self) -> None:
    """Parses self._model_bytes; raises ValueError naming self.path."""
    raise NotImplementedError

  @property
  def vocab_size(self) -> int:
    raise NotImplementedError

  @property
  def pad_id(self) -> int:
    return self._special['pad']

  @property
  def unk_id(self) -> int:
    return self._special['unk']

  @property
  def cls_id(self) -> int:
    return self._special['cls']

  @property
  def sep_id(self) -> int:
    return self._special['sep']

  @property
  def mask_id(self) -> int:
    """The mask token's id, or NO_ID if the tokenizer has none."""
    return self._special['mask']

  @property
  def mask_token(self) -> str | None:
    """The text that encodes to mask_id (e.g. '[MASK]'), None without one."""
    return SPECIAL_PIECES['mask'][0]

  @property
  def special_ids(self) -> dict[str, int]:
    """Name -> id of the special tokens (JSON-serialisable, for metadata)."""
    return dict(self._special)

  @property
  def first_normal_id(self) -> int:
    """Ids from here to vocab_size are text tokens (for random replacement).

    Our tokenizers put the specials first; BERT's vocab puts [PAD], the
    [unusedN] pieces and the other specials first, so this skips those.
    """
    return max(self._special.values()) + 1

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without [CLS]/[SEP]."""
    raise NotImplementedError

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, skipping [PAD]."""
    raise NotImplementedError

  def piece_texts(self) -> list[str]:
    """The text each id stands for, '' for the special tokens.

    A piece that starts a word starts with a space (SentencePiece's '▁'
    becomes ' '), so objectives can find word and sentence boundaries
    (whole-word masking, BART's sentence permutation) from ids alone.
    """
    raise NotImplementedError

  def model_bytes(self) -> bytes:
    """The tokenizer file's content."""
    return self._model_bytes

  def tf_tokenizer(self):
    """The same tokenizer as a TF op, for tokenizing inside tf.data graphs.

    Its `tokenize(strings)` maps a string tensor to int32 ids, ragged along
    the text (as tensorflow_text's tokenizers do).
    """
    raise NotImplementedError

  def __repr__(self) -> str:
    name = type(self).__name__
    return f'{name}({self.path!r}, vocab_size={self.vocab_size})'


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model; its special ids come from the model.

  Ours have [PAD]=0, [UNK]=1, [CLS]=2 (SentencePiece's BOS), [SEP]=3 (EOS)
  and the user-defined [MASK]=4. Others need a pad and an EOS piece (the
  pipeline pads rows and ends documents with them). T5's spiece.model has
  <pad>=0, </s>=1, <unk>=2 and no BOS or mask: [SEP] is </s>, [CLS] is
  <pad> (T5's decoder starts from <pad>: decoder_start_token_id =
  pad_token_id), and mask_id is NO_ID. T5's sentinels <extra_id_N> are not
  pieces of the model: they are the ids after it, reserved by the objective.
  """

  def _load(self) -> None:
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(self._model_bytes)
    except RuntimeError as e:
      raise ValueError(
        f'{self.path!r} is not a SentencePiece model: {e}'
      ) from e
    self._special = self._read_special_ids()

  def _read_special_ids(self) -> dict[str, int]:
    """The special ids of this model; raises if it has no pad or EOS."""
    sp = self._sp
    if sp.pad_id() < 0 or sp.eos_id() < 0:
      wanted = ', '.join(f'{p}={i}' for p, i in SPECIAL_PIECES.values())
      raise ValueError(
        f'Tokenizer {self.path!r} has pad id {sp.pad_id()} and EOS id '
        f'{sp.eos_id()}; pretrain_lm needs both pieces (its own tokenizers '
        f'have {wanted}). Train one with '
        'pretrain_lm.data.tokenizer.train_tokenizer.'
      )
    mask = NO_ID
    for piece in ('[MASK]', '<mask>'):
      i = sp.piece_to_id(piece)  # the unknown piece's id if absent
      if sp.id_to_piece(i) == piece:
        mask = i
        break
    return {
      'pad': sp.pad_id(),
      'unk': sp.unk_id(),
      'cls': sp.bos_id() if sp.bos_id() >= 0 else sp.pad_id(),
      'sep': sp.eos_id(),
      'mask': mask,
    }

  @property
  def vocab_size(self) -> int:
    return self._sp.vocab_size()

  @property
  def mask_token(self) -> str | None:
    return self._sp.id_to_piece(self.mask_id) if self.mask_id >= 0 else None

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids if int(i) != self.pad_id])

  def piece_texts(self) -> list[str]:
    texts = []
    for i in range(self.vocab_size):
      if self._sp.is_control(i) or self._sp.is_unknown(i) or i == self.mask_id:
        texts.append('')
      else:
        texts.append(self._sp.id_to_piece(i).replace('\u2581', ' '))
    return texts

  def tf_tokenizer(self) -> tf_text.SentencepieceTokenizer:
    return tf_text.SentencepieceTokenizer(
      model=self._model_bytes, out_type=tf.int32
    )


class CharTfTokenizer:
  """Characters -> ids as TF ops: code points looked up in a hash table."""

  def __init__(self, chars: tuple[str, ...], first_id: int, unk_id: int):
    keys = tf.constant([ord(c) for c in chars], tf.int32)
    values = tf.range(first_id, first_id + len(chars), dtype=tf.int32)
    self._table = tf.lookup.StaticHashTable(
      tf.lookup.KeyValueTensorInitializer(keys, values), default_value=unk_id
    )

  def tokenize(self, strings) -> tf.RaggedTensor:
    """int32 ids of each string, ragged along its characters."""
    # Invalid UTF-8 becomes U+FFFD, which maps to [UNK] unless the training
    # text held it.
    code_points = tf.strings.unicode_decode(strings, 'UTF-8', errors='replace')
    return tf.ragged.map_flat_values(self._table.lookup, code_points)


def _parse_chars(model_bytes: bytes) -> list[str] | None:
  """The "chars" of a char tokenizer file, or None if it is not one."""
  try:
    spec = json.loads(model_bytes.decode('utf-8'))
  except ValueError:  # UnicodeDecodeError and JSONDecodeError included
    return None
  if not isinstance(spec, dict) or spec.get('type') != CHAR_TYPE:
    return None
  chars = spec.get('chars')
  if not isinstance(chars, list) or not chars:
    return None
  if not all(isinstance(c, str) and len(c) == 1 for c in chars):
    return None
  return chars if len(set(chars)) == len(chars) else None


class CharTokenizer(Tokenizer):
  """One id per Unicode code point: the specials, then `chars` in order.

  The file is JSON, {"type": "char", "chars": [...]}; training writes the
  training text's distinct characters sorted by code point. A character not
  in `chars` encodes to [UNK].
  """

  def _load(self) -> None:
    chars = _parse_chars(self._model_bytes)
    if chars is None:
      raise ValueError(
        f'{self.path!r} is not a char tokenizer: want JSON {{"type": '
        f'"{CHAR_TYPE}", "chars": [distinct single characters, at least '
        f'one]}}, got {self._model_bytes[:200]!r}.'
      )
    self._chars = tuple(chars)
    self._ids = {c: i for i, c in enumerate(chars, self.first_normal_id)}
    self._pieces = {i: piece for piece, i in SPECIAL_PIECES.values()}
    self._pieces.update({i: c for c, i in self._ids.items()})

  @property
  def vocab_size(self) -> int:
    return self.first_normal_id + len(self._chars)

  @property
  def chars(self) -> tuple[str, ...]:
    """The characters of ids first_normal_id, first_normal_id + 1, ..."""
    return self._chars

  def encode(self, text: str) -> list[int]:
    return [self._ids.get(c, self.unk_id) for c in text]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, skipping [PAD]; other specials read '[UNK]' etc."""
    pieces = []
    for i in map(int, ids):
      if i == self.pad_id:
        continue
      if i not in self._pieces:
        raise ValueError(
          f'Token id {i} is outside [0, {self.vocab_size}) of {self!r}.'
        )
      pieces.append(self._pieces[i])
    return ''.join(pieces)

  def piece_texts(self) -> list[str]:
    return [''] * self.first_normal_id + list(self._chars)

  def tf_tokenizer(self) -> CharTfTokenizer:
    return CharTfTokenizer(self._chars, self.first_normal_id, self.unk_id)


def _spec_error(path: str, kind: str, problem: str) -> ValueError:
  """The error for a JSON tokenizer file of `kind` that cannot be used."""
  return ValueError(f'{path!r} is not a valid {kind!r} tokenizer: {problem}.')


def _special_ids_by_name(
  path: str,
  kind: str,
  special: Any,
  vocab: dict[str, int],
  required: Sequence[str],
) -> dict[str, int]:
  """Name -> id of `special` (name -> token text or None) in `vocab`."""
  if not isinstance(special, dict):
    raise _spec_error(path, kind, '"special" must map names to tokens')
  ids = {}
  for name in SPECIAL_PIECES:
    token = special.get(name)
    if token is None and name not in required:
      ids[name] = NO_ID
    elif token not in vocab:
      raise _spec_error(
        path, kind, f'its {name} token {token!r} is not in the vocab'
      )
    else:
      ids[name] = vocab[token]
  return ids


# Words longer than this many characters become [UNK] (BERT's
# max_input_chars_per_word).
_MAX_WORD_CHARS = 100
# BERT's _is_chinese_char: the CJK ideograph blocks, each its own word.
_CJK_RANGES = (
  (0x4E00, 0x9FFF),
  (0x3400, 0x4DBF),
  (0x20000, 0x2A6DF),
  (0x2A700, 0x2B73F),
  (0x2B740, 0x2B81F),
  (0x2B820, 0x2CEAF),
  (0xF900, 0xFAFF),
  (0x2F800, 0x2FA1F),
)
# The same sets as RE2 patterns for the TF op. BERT's punctuation is Unicode
# P* plus every ASCII non-alphanumeric printable character.
_PUNCT_RE2 = r'[!-/]|[:-@]|[\[-`]|[{-~]|\p{P}'
_CJK_RE2 = '|'.join(f'[\\x{{{a:X}}}-\\x{{{b:X}}}]' for a, b in _CJK_RANGES)
# Stands in for the mask token inside the TF op: a private-use character,
# which cleaning removes from the text itself, so only the mask becomes it.
_MASK_SENTINEL = '\ue000'


def _is_bert_whitespace(ch: str) -> bool:
  # str.split() in BERT's whitespace_tokenize also splits on U+2028/9 (Zl,
  # Zp), so they count here as well.
  return ch in ' \t\n\r' or unicodedata.category(ch) in ('Zs', 'Zl', 'Zp')


def _is_bert_control(ch: str) -> bool:
  return ch not in '\t\n\r' and unicodedata.category(ch).startswith('C')


@functools.cache
def _cleaned_char(ch: str) -> str:
  """BERT's _clean_text of one character: '' (dropped), ' ' or itself."""
  if ch in '\x00\ufffd' or _is_bert_control(ch):
    return ''
  return ' ' if _is_bert_whitespace(ch) else ch


def _clean_text(text: str) -> str:
  """BERT's _clean_text: drops NUL, U+FFFD and controls; whitespace -> ' '."""
  return ''.join(map(_cleaned_char, text))


@functools.cache
def _is_bert_punctuation(ch: str) -> bool:
  cp = ord(ch)
  if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
    return True
  return unicodedata.category(ch).startswith('P')


@functools.cache
def _is_cjk(ch: str) -> bool:
  cp = ord(ch)
  return any(a <= cp <= b for a, b in _CJK_RANGES)


def _strip_accents(text: str) -> str:
  """NFD, then without the nonspacing marks (Mn)."""
  if text.isascii():
    return text
  return ''.join(
    c
    for c in unicodedata.normalize('NFD', text)
    if unicodedata.category(c) != 'Mn'
  )


def _re2_literal(text: str) -> str:
  """An RE2 pattern matching `text` literally."""
  return ''.join(c if c.isalnum() else f'\\x{{{ord(c):X}}}' for c in text)


class WordPieceTfTokenizer:
  """BERT's tokenization as TF ops (tensorflow_text's WordpieceTokenizer).

  The steps of WordPieceTokenizer.encode: clean the text, cut out the mask
  token, lower-case and strip accents, split on whitespace, punctuation and
  CJK characters, words over 100 characters -> [UNK], then WordPiece.
  tensorflow_text's BertTokenizer is not used as is: it case-folds with
  NFKC (BERT lower-cases), counts the 100 in bytes, treats only ASCII
  whitespace as whitespace and replaces controls by spaces.
  """

  def __init__(self, tokenizer: 'WordPieceTokenizer'):
    self._lower_case = tokenizer.do_lower_case
    self._strip_accents = tokenizer.strip_accents
    self._unk_token = tokenizer.vocab[tokenizer.unk_id]
    self._mask_token = tokenizer.mask_token
    keys = list(tokenizer.token_ids)
    values = list(tokenizer.token_ids.values())
    if self._mask_token is not None:
      keys.append(_MASK_SENTINEL)
      values.append(tokenizer.mask_id)
    self._table = tf.lookup.StaticHashTable(
      tf.lookup.KeyValueTensorInitializer(
        tf.constant(keys), tf.constant(values, tf.int64)
      ),
      default_value=-1,
    )
    self._wordpiece = tf_text.WordpieceTokenizer(
      self._table,
      suffix_indicator='##',
      # Longer words are made [UNK] by character count before this.
      max_bytes_per_word=4 * _MAX_WORD_CHARS,
      token_out_type=tf.int64,
      unknown_token=self._unk_token,
    )
    split = [_PUNCT_RE2]
    if tokenizer.tokenize_chinese_chars:
      split.append(_CJK_RE2)
    self._keep_pattern = '|'.join(split)
    self._split_pattern = ' +|' + self._keep_pattern

  def tokenize(self, strings) -> tf.RaggedTensor | tf.Tensor:
    """int32 ids of each string (rank 0 or 1), ragged along its tokens."""
    x = tf.convert_to_tensor(strings, tf.string)
    if x.shape.rank == 0:
      return self.tokenize(x[None])[0]
    # Invalid UTF-8 becomes U+FFFD, which cleaning drops (as Python's
    # errors='replace' decoding followed by encode() does).
    x = tf.strings.unicode_transcode(
      x, 'UTF-8', 'UTF-8', errors='replace', replacement_char=0xFFFD
    )
    x = tf.strings.regex_replace(x, r'[\t\n\r\p{Z}]', ' ')
    x = tf.strings.regex_replace(x, r'[\x{FFFD}\p{C}]', '')
    if self._mask_token is not None:
      x = tf.strings.regex_replace(
        x, _re2_literal(self._mask_token), f' {_MASK_SENTINEL} '
      )
    if self._lower_case:
      # ICU's full lower-casing, as Python's str.lower() (final sigma too).
      x = tf.strings.lower(x, encoding='utf-8')
    if self._strip_accents:
      x = tf_text.normalize_utf8(x, 'NFD')
      x = tf.strings.regex_replace(x, r'\p{Mn}', '')
    words = tf_text.regex_split(x, self._split_pattern, self._keep_pattern)
    words = tf.ragged.map_flat_values(
      lambda w: tf.where(
        tf.strings.length(w, unit='UTF8_CHAR') > _MAX_WORD_CHARS,
        self._unk_token,
        w,
      ),
      words,
    )
    ids = self._wordpiece.tokenize(words)  # [..., words, pieces]
    return tf.cast(ids.merge_dims(-2, -1), tf.int32)


class WordPieceTokenizer(Tokenizer):
  """BERT's WordPiece tokenizer, from an imported vocab.txt or trained.

  The file is JSON: {"type": "wordpiece", "vocab": [token of id 0, ...],
  "do_lower_case": bool, "strip_accents": bool or null (null: follow
  do_lower_case), "tokenize_chinese_chars": bool, "special": {"pad":
  "[PAD]", "unk": ..., "cls": ..., "sep": ..., "mask": token or null}},
  plus the imported "hf_tokenizer_config" and "hf_special_tokens_map" that
  export writes back. Encoding is BERT's: clean the text, lower-case and
  strip accents (NFD, drop Mn), split on whitespace, punctuation and CJK
  characters, then greedy longest-match-first WordPiece with '##'
  continuations; a word over 100 characters or with no segmentation is
  [UNK]. The mask token's text in the input encodes to mask_id (as in
  Hugging Face's tokenizers); the other specials' texts are split as text.
  Known differences from Hugging Face's Rust BertTokenizer, whose
  lower-casing ignores final sigma: 'ΟΣ' -> 'ος' here (as Python's
  str.lower() and the original BERT), 'οσ' there.
  """

  def _load(self) -> None:
    spec = _parse_json(self._model_bytes)
    if spec is None or spec.get('type') != WORDPIECE_TYPE:
      raise _spec_error(self.path, WORDPIECE_TYPE, 'not such a JSON document')
    vocab = spec.get('vocab')
    if not (
      isinstance(vocab, list)
      and vocab
      and all(isinstance(t, str) and t for t in vocab)
    ):
      raise _spec_error(
        self.path, WORDPIECE_TYPE, '"vocab" must list non-empty tokens'
      )
    self.vocab: list[str] = vocab
    # A token listed twice gets its last id, as transformers' load_vocab.
    self.token_ids = {t: i for i, t in enumerate(vocab)}
    self._special = _special_ids_by_name(
      self.path,
      WORDPIECE_TYPE,
      spec.get('special'),
      self.token_ids,
      required=('pad', 'unk', 'cls', 'sep'),
    )
    self.do_lower_case = bool(spec.get('do_lower_case', True))
    strip = spec.get('strip_accents')
    self.strip_accents = self.do_lower_case if strip is None else bool(strip)
    self.tokenize_chinese_chars = bool(spec.get('tokenize_chinese_chars', True))
    self._spec = spec
    self._cache: dict[str, tuple[int, ...]] = {}

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  @property
  def mask_token(self) -> str | None:
    return self.vocab[self.mask_id] if self.mask_id >= 0 else None

  def _words(self, text: str) -> list[str]:
    """BERT's BasicTokenizer on cleaned text."""
    if self.do_lower_case:
      text = text.lower()
    if self.strip_accents:
      text = _strip_accents(text)
    words, word = [], []
    for ch in text:
      alone = _is_bert_punctuation(ch) or (
        self.tokenize_chinese_chars and _is_cjk(ch)
      )
      if ch == ' ' or alone:
        if word:
          words.append(''.join(word))
          word = []
        if alone:
          words.append(ch)
      else:
        word.append(ch)
    if word:
      words.append(''.join(word))
    return words

  def _wordpieces(self, word: str) -> tuple[int, ...]:
    """Greedy longest-match-first WordPiece ids of one word."""
    if word in self._cache:
      return self._cache[word]
    if len(word) > _MAX_WORD_CHARS:
      return (self.unk_id,)
    ids, start = [], 0
    while start < len(word):
      for end in range(len(word), start, -1):
        piece = word[start:end] if start == 0 else '##' + word[start:end]
        if piece in self.token_ids:
          ids.append(self.token_ids[piece])
          start = end
          break
      else:
        ids = [self.unk_id]
        break
    if len(self._cache) < 1 << 20:
      self._cache[word] = tuple(ids)
    return tuple(ids)

  def encode(self, text: str) -> list[int]:
    text = _clean_text(text)
    chunks = [text] if self.mask_token is None else text.split(self.mask_token)
    ids = []
    for k, chunk in enumerate(chunks):
      if k:
        ids.append(self.mask_id)
      for word in self._words(chunk):
        ids.extend(self._wordpieces(word))
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Words joined by spaces, '##' pieces glued on, [PAD] skipped."""
    text = ' '.join(self.vocab[i] for i in map(int, ids) if i != self.pad_id)
    return text.replace(' ##', '')

  def piece_texts(self) -> list[str]:
    specials = {i for i in self._special.values() if i >= 0}
    return [
      ''
      if i in specials
      else (token[2:] if token.startswith('##') else ' ' + token)
      for i, token in enumerate(self.vocab)
    ]

  def tf_tokenizer(self) -> WordPieceTfTokenizer:
    return WordPieceTfTokenizer(self)


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


class ByteBpeTokenizer(Tokenizer):
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
  five at this module's fixed ids (<pad>=0, ..., <mask>=4). The mask
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
    spec = _parse_json(self._model_bytes)
    if spec is None or spec.get('type') != BYTE_BPE_TYPE:
      raise _spec_error(self.path, BYTE_BPE_TYPE, 'not such a JSON document')
    vocab, merges = spec.get('vocab'), spec.get('merges')
    if not (
      isinstance(vocab, list)
      and vocab
      and all(isinstance(t, str) and t for t in vocab)
      and len(set(vocab)) == len(vocab)
    ):
      raise _spec_error(
        self.path, BYTE_BPE_TYPE, '"vocab" must list distinct tokens'
      )
    if not isinstance(merges, list) or not all(
      isinstance(m, str) and len(m.split(' ')) == 2 for m in merges
    ):
      raise _spec_error(
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
    self._special = _special_ids_by_name(
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
    raise _spec_error(
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


def load_tokenizer(path: str) -> Tokenizer:
  """Loads a tokenizer file (local or gs://) of any kind."""
  return Tokenizer(path)


# The Hugging Face files, by kind, that import_hf_tokenizer looks for.
HF_FILES = {
  WORDPIECE_TYPE: ('vocab.txt',),
  BYTE_BPE_TYPE: ('vocab.json', 'merges.txt'),
  'sentencepiece': ('spiece.model', WORKDIR_FILENAME),
}
# Hugging Face's config keys of the special tokens, by our names. A
# byte-level BPE's cls and sep fall back to its bos and eos (GPT-2 has only
# those).
_HF_TOKEN_KEYS = {
  'pad': 'pad_token',
  'unk': 'unk_token',
  'cls': 'cls_token',
  'sep': 'sep_token',
  'mask': 'mask_token',
}
_ROBERTA_TOKENS = {
  'cls': '<s>',
  'pad': '<pad>',
  'sep': '</s>',
  'unk': '<unk>',
  'mask': '<mask>',
}
_GPT2_TOKENS = {
  'cls': '<|endoftext|>',
  'sep': '<|endoftext|>',
  'unk': '<|endoftext|>',
}
# Keys of an imported tokenizer_config.json not written back: the files
# and code they name are not exported.
_HF_CONFIG_DROP = ('tokenizer_file', 'auto_map')


def _read_text(path: str) -> str:
  """The UTF-8 text of the file at `path`."""
  return _read(path).decode('utf-8')


def _read_hf_json(src_dir: str, name: str) -> dict:
  """The JSON object in src_dir/name, {} if there is no such file."""
  path = os.path.join(src_dir, name)
  if not tf.io.gfile.exists(path):
    return {}
  content = _parse_json(_read(path))
  if content is None:
    raise ValueError(f'{path!r} is not a JSON object.')
  return content


def _token_text(value: Any) -> str | None:
  """A special token's text from a config (a string or an AddedToken dict)."""
  if isinstance(value, dict):
    value = value.get('content')
  return value if isinstance(value, str) else None


def _hf_special(config: dict, special_map: dict) -> dict[str, str | None]:
  """Our names -> token texts named by the Hugging Face configs."""

  def text(key):
    return _token_text(special_map.get(key, config.get(key)))

  special = {name: text(key) for name, key in _HF_TOKEN_KEYS.items()}
  special['cls'] = special['cls'] or text('bos_token')
  special['sep'] = special['sep'] or text('eos_token')
  return special


def _wordpiece_spec(src_dir: str, config: dict, special_map: dict) -> dict:
  """The 'wordpiece' JSON document of src_dir's vocab.txt and configs."""
  lines = _read_text(os.path.join(src_dir, 'vocab.txt')).split('\n')
  # One token per line; transformers' load_vocab strips only the '\n'.
  vocab = lines[:-1] if lines[-1] == '' else lines
  special = _hf_special(config, special_map)
  for name, (default, _) in SPECIAL_PIECES.items():
    special[name] = special[name] or default
  if special['mask'] not in vocab:
    special['mask'] = None
  do_lower_case = config.get('do_lower_case')
  if do_lower_case is None:
    # Uncased vocabs (BERT-uncased) hold no upper-case letters outside the
    # bracketed specials such as [PAD] and [unused0].
    do_lower_case = not any(
      t != t.lower() for t in vocab if not (t[:1] == '[' and t[-1:] == ']')
    )
  return {
    'type': WORDPIECE_TYPE,
    'vocab': vocab,
    'do_lower_case': bool(do_lower_case),
    'strip_accents': config.get('strip_accents'),
    'tokenize_chinese_chars': bool(config.get('tokenize_chinese_chars', True)),
    'special': special,
    'hf_tokenizer_config': config,
    'hf_special_tokens_map': special_map,
  }


def _mask_lstrip(config: dict, special_map: dict, mask: str | None) -> bool:
  """Whether the configs declare the mask token with lstrip (default True).

  RoBERTa and BART's <mask> is AddedToken(lstrip=True); the configs give it
  as an AddedToken dict in special_tokens_map.json, tokenizer_config.json or
  its added_tokens_decoder, or as a plain string (the default then).
  """
  added = list((config.get('added_tokens_decoder') or {}).values())
  for entry in [
    special_map.get('mask_token'),
    config.get('mask_token'),
    *added,
  ]:
    if isinstance(entry, dict) and entry.get('content') == mask:
      return bool(entry.get('lstrip', True))
  return True


def _byte_bpe_spec(src_dir: str, config: dict, special_map: dict) -> dict:
  """The 'byte_bpe' JSON document of src_dir's vocab, merges and configs."""
  vocab_path = os.path.join(src_dir, 'vocab.json')
  token_ids = _parse_json(_read(vocab_path))
  if token_ids is None or sorted(token_ids.values()) != list(
    range(len(token_ids))
  ):
    raise ValueError(
      f'{vocab_path!r} must map tokens to the ids 0, 1, ..., n - 1.'
    )
  vocab = sorted(token_ids, key=token_ids.get)
  lines = _read_text(os.path.join(src_dir, 'merges.txt')).split('\n')
  if lines[0].startswith('#version'):
    lines = lines[1:]
  merges = [line for line in lines if line]
  # Tokens the configs do not name take the family's defaults, like the
  # defaults of transformers' RobertaTokenizer and GPT2Tokenizer.
  defaults = _ROBERTA_TOKENS if '<s>' in token_ids else _GPT2_TOKENS
  special = {
    name: token or defaults.get(name)
    for name, token in _hf_special(config, special_map).items()
  }
  special = {
    name: token if token in token_ids else None
    for name, token in special.items()
  }
  if special['sep'] is None:
    raise ValueError(
      f'Cannot tell the end-of-text token of {src_dir!r}: its '
      'tokenizer_config.json / special_tokens_map.json name no eos_token or '
      'sep_token in vocab.json.'
    )
  return {
    'type': BYTE_BPE_TYPE,
    'vocab': vocab,
    'merges': merges,
    'special': special,
    'add_prefix_space': bool(config.get('add_prefix_space', False)),
    'mask_lstrip': _mask_lstrip(config, special_map, special['mask']),
    'hf_tokenizer_config': config,
    'hf_special_tokens_map': special_map,
  }


def _spec_bytes(spec: dict) -> bytes:
  """The tokenizer file of a 'wordpiece' or 'byte_bpe' JSON document."""
  return json.dumps(spec, ensure_ascii=False).encode('utf-8')


def _exists(src_dir: str, names: Sequence[str]) -> bool:
  """Whether src_dir holds all the files `names`."""
  return all(tf.io.gfile.exists(os.path.join(src_dir, n)) for n in names)


def import_hf_tokenizer(src_dir: str, dst_path: str) -> Tokenizer:
  """Converts the tokenizer of a Hugging Face checkpoint directory.

  Looks in `src_dir` for, in this order, vocab.txt (WordPiece), vocab.json
  + merges.txt (byte-level BPE), spiece.model or tokenizer.model
  (SentencePiece, or any tokenizer file of this project), and reads
  tokenizer_config.json and special_tokens_map.json when present.

  Args:
    src_dir: the checkpoint directory (local or gs://).
    dst_path: where to write the tokenizer file (a workdir's
      WORKDIR_FILENAME): a SentencePiece model is copied unchanged, the
      others are written as this module's JSON documents.

  Returns:
    The tokenizer, loaded from `dst_path`.
  """
  config = _read_hf_json(src_dir, 'tokenizer_config.json')
  special_map = _read_hf_json(src_dir, 'special_tokens_map.json')
  if _exists(src_dir, HF_FILES[WORDPIECE_TYPE]):
    spec = _wordpiece_spec(src_dir, config, special_map)
  elif _exists(src_dir, HF_FILES[BYTE_BPE_TYPE]):
    spec = _byte_bpe_spec(src_dir, config, special_map)
  else:
    spec = None
  if spec is not None:
    content = _spec_bytes(spec)
  else:
    names = [n for n in HF_FILES['sentencepiece'] if _exists(src_dir, [n])]
    if not names:
      wanted = '; '.join(' + '.join(files) for files in HF_FILES.values())
      raise FileNotFoundError(
        f'No tokenizer found in {src_dir!r}: looked for {wanted}.'
      )
    content = _read(os.path.join(src_dir, names[0]))
  _write_atomically(dst_path, content)
  try:
    return load_tokenizer(dst_path)
  except ValueError as e:
    # No unusable tokenizer stays behind for a later run to pick up.
    tf.io.gfile.remove(dst_path)
    raise ValueError(f'Cannot import the tokenizer of {src_dir!r}: {e}') from e


def _json_bytes(content: dict) -> bytes:
  """`content` as transformers writes its configs: indented, UTF-8."""
  return (json.dumps(content, indent=2, ensure_ascii=False) + '\n').encode()


def _hf_tokens(special: dict[str, str | None]) -> dict[str, str]:
  """Hugging Face's special-token keys for our names -> texts."""
  return {
    _HF_TOKEN_KEYS[name]: token
    for name, token in special.items()
    if token is not None
  }


def _wordpiece_hf_files(tok: WordPieceTokenizer):
  """(files, tokenizer_config, special_tokens_map, config ids) of `tok`."""
  special = tok._spec['special']
  tokens = _hf_tokens(special)
  config = {
    'tokenizer_class': 'BertTokenizer',
    'do_lower_case': tok.do_lower_case,
    'strip_accents': tok._spec.get('strip_accents'),
    'tokenize_chinese_chars': tok.tokenize_chinese_chars,
    **tokens,
  }
  files = {'vocab.txt': ''.join(t + '\n' for t in tok.vocab).encode()}
  return files, config, tokens, {'pad_token_id': tok.pad_id}


def _byte_bpe_hf_files(tok: ByteBpeTokenizer):
  """(files, tokenizer_config, special_tokens_map, config ids) of `tok`."""
  special = tok._spec['special']
  tokens = _hf_tokens({**special, 'cls': None, 'sep': None})
  tokens['bos_token'] = tok.vocab[tok.cls_id]
  tokens['eos_token'] = tok.vocab[tok.sep_id]
  if special.get('cls') and special['cls'] != special.get('sep'):
    # RoBERTa and BART name both pairs; GPT-2 only bos/eos.
    tokens.update(cls_token=special['cls'], sep_token=special['sep'])
  config = {
    'tokenizer_class': (
      'RobertaTokenizer' if 'cls_token' in tokens else 'GPT2Tokenizer'
    ),
    'add_prefix_space': tok._add_prefix_space,
    **tokens,
  }
  if 'mask_token' in tokens:
    # transformers takes lstrip from special_tokens_map.json's AddedToken
    # form (tokenizer_config.json wants the plain string).
    tokens['mask_token'] = {
      'content': tokens['mask_token'],
      'lstrip': tok._mask_lstrip,
      'normalized': False,
      'rstrip': False,
      'single_word': False,
    }
  vocab = {t: i for i, t in enumerate(tok.vocab)}
  # The layout the tokenizers library saves: compact, in id order.
  files = {
    'vocab.json': json.dumps(
      vocab, ensure_ascii=False, separators=(',', ':')
    ).encode(),
    'merges.txt': ''.join(
      m + '\n' for m in ['#version: 0.2', *tok.merges]
    ).encode(),
  }
  ids = {'bos_token_id': tok.cls_id, 'eos_token_id': tok.sep_id}
  if special.get('pad') is not None:
    ids['pad_token_id'] = tok.pad_id
  return files, config, tokens, ids


def _sentencepiece_hf_files(tok: SentencePieceTokenizer, extra_ids: int):
  """(files, tokenizer_config, special_tokens_map, config ids) of `tok`."""
  sp = tok._sp
  tokens = {
    'pad_token': sp.id_to_piece(tok.pad_id),
    'unk_token': sp.id_to_piece(tok.unk_id),
    'eos_token': sp.id_to_piece(tok.sep_id),
  }
  ids = {'pad_token_id': tok.pad_id, 'eos_token_id': tok.sep_id}
  if sp.bos_id() < 0:
    # T5's layout: <pad>, </s>, <unk> and sentinels after the pieces.
    sentinels = [f'<extra_id_{i}>' for i in range(extra_ids)]
    config = {
      'tokenizer_class': 'T5Tokenizer',
      'extra_ids': extra_ids,
      'additional_special_tokens': sentinels,
      **tokens,
    }
    tokens['additional_special_tokens'] = sentinels
    return {'spiece.model': tok.model_bytes()}, config, tokens, ids
  tokens.update(
    bos_token=sp.id_to_piece(tok.cls_id),
    cls_token=sp.id_to_piece(tok.cls_id),
    sep_token=sp.id_to_piece(tok.sep_id),
  )
  if tok.mask_token is not None:
    tokens['mask_token'] = tok.mask_token
  ids['bos_token_id'] = tok.cls_id
  # ALBERT's tokenizer is plain SentencePiece plus [CLS]/[SEP] once its
  # lower-casing, accent stripping and space squeezing are off.
  config = {
    'tokenizer_class': 'AlbertTokenizer',
    'do_lower_case': False,
    'keep_accents': True,
    'remove_space': False,
    **tokens,
  }
  return {'spiece.model': tok.model_bytes()}, config, tokens, ids


def export_hf_tokenizer(
  tokenizer: Tokenizer, dst_dir: str, *, extra_ids: int = 0
) -> dict[str, int]:
  """Writes `tokenizer` as Hugging Face tokenizer files into `dst_dir`.

  WordPiece -> vocab.txt, byte-level BPE -> vocab.json + merges.txt,
  SentencePiece -> spiece.model (T5Tokenizer for a model without BOS, else
  AlbertTokenizer with its text preprocessing off, which encodes as plain
  SentencePiece does), each with tokenizer_config.json and
  special_tokens_map.json. An imported tokenizer's own config entries are
  written back over the derived ones, less the keys naming files not
  exported (tokenizer_file). The char tokenizer has no Hugging Face
  counterpart.

  Args:
    tokenizer: the tokenizer to export.
    dst_dir: the output directory (created if missing).
    extra_ids: T5's sentinels <extra_id_N> after the SentencePiece pieces,
      declared in a T5 tokenizer_config.json that is written here.

  Returns:
    The special-token ids for the model's config.json: pad_token_id,
    bos_token_id and eos_token_id, each where the tokenizer has it.
  """
  if isinstance(tokenizer, WordPieceTokenizer):
    files, config, tokens, ids = _wordpiece_hf_files(tokenizer)
  elif isinstance(tokenizer, ByteBpeTokenizer):
    files, config, tokens, ids = _byte_bpe_hf_files(tokenizer)
  elif isinstance(tokenizer, SentencePieceTokenizer):
    files, config, tokens, ids = _sentencepiece_hf_files(tokenizer, extra_ids)
  else:
    raise ValueError(
      f'{tokenizer!r} has no Hugging Face counterpart; export supports '
      'WordPiece, byte-level BPE and SentencePiece tokenizers.'
    )
  # What the imported configs say wins over what is derived here, so an
  # import -> export -> import -> export round trip writes the same files.
  spec = getattr(tokenizer, '_spec', {})
  config.update(spec.get('hf_tokenizer_config') or {})
  for key in _HF_CONFIG_DROP:
    config.pop(key, None)
  tokens.update(spec.get('hf_special_tokens_map') or {})
  files['tokenizer_config.json'] = _json_bytes(config)
  files['special_tokens_map.json'] = _json_bytes(tokens)
  tf.io.gfile.makedirs(dst_dir)
  for name, content in files.items():
    _write_atomically(os.path.join(dst_dir, name), content)
  return ids


def _write_atomically(path: str, content: bytes) -> None:
  tf.io.gfile.makedirs(os.path.dirname(path) or '.')
  # Write then rename, so a crash never leaves a truncated tokenizer that a
  # resumed run would pick up.
  tmp_path = path + '.tmp'
  with tf.io.gfile.GFile(tmp_path, 'wb') as f:
    f.write(content)
  tf.io.gfile.rename(tmp_path, path, overwrite=True)


def _sentences(texts: Iterable[str]) -> Iterator[str]:
  """The non-empty lines of `texts`: SentencePiece trains on sentences."""
  for text in texts:
    for line in text.split('\n'):
      line = line.strip()
      if line:
        yield line


def train_tokenizer(
  texts: Iterable[str],
  path: str,
  *,
  vocab_size: int,
  model_type: str = 'unigram',
  seed: int = 0,
  lowercase: bool = True,
) -> Tokenizer:
  """Trains a tokenizer on `texts` and writes it to `path`.

  Args:
    texts: documents. SentencePiece trains on each line of each as a
      sentence; 'char' takes every character, newlines included; WordPiece
      and byte-level BPE take each document whole.
    path: where to write the tokenizer file (local or gs://).
    vocab_size: the most ids the tokenizer may have (model.vocab_size).
      The limit is soft for SentencePiece, WordPiece and byte-level BPE:
      small corpora give fewer pieces. 'char' has as many ids as the text
      has distinct characters (plus the specials) and fails if that is
      more.
    model_type: one of MODEL_TYPES: 'unigram' or 'bpe' (SentencePiece),
      'char', 'wordpiece' (BERT) or 'byte_bpe' (GPT-2, RoBERTa).
    seed: seeds SentencePiece's sentence sampling; the other kinds train
      without randomness.
    lowercase: WordPiece only: BERT's uncased normalisation (lower-case
      and strip accents), or the cased one.

  Returns:
    The trained tokenizer, loaded from `path`.
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(
      f'data.tokenizer_type={model_type!r} is not one of {MODEL_TYPES}.'
    )
  if model_type == CHAR_TYPE:
    return _train_char_tokenizer(texts, path, vocab_size=vocab_size)
  if model_type == WORDPIECE_TYPE:
    _train_wordpiece(texts, path, vocab_size=vocab_size, lowercase=lowercase)
  elif model_type == BYTE_BPE_TYPE:
    _train_byte_bpe(texts, path, vocab_size=vocab_size)
  else:
    _train_sentencepiece(
      texts, path, vocab_size=vocab_size, model_type=model_type, seed=seed
    )
  tokenizer = load_tokenizer(path)
  if tokenizer.vocab_size < vocab_size:
    logging.warning(
      'The text only fills %d of the %d requested tokenizer pieces; %s has '
      'vocab_size %d.',
      tokenizer.vocab_size,
      vocab_size,
      path,
      tokenizer.vocab_size,
    )
  return tokenizer


def _train_sentencepiece(
  texts: Iterable[str],
  path: str,
  *,
  vocab_size: int,
  model_type: str,
  seed: int,
) -> None:
  """Writes a SentencePiece model ('unigram' or 'bpe') of `texts` to `path`."""
  spm.set_random_generator_seed(seed)
  model = io.BytesIO()
  pieces = {name: piece for name, (piece, _) in SPECIAL_PIECES.items()}
  ids = {name: i for name, (_, i) in SPECIAL_PIECES.items()}
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=_sentences(texts),
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      pad_id=ids['pad'],
      pad_piece=pieces['pad'],
      unk_id=ids['unk'],
      unk_piece=pieces['unk'],
      bos_id=ids['cls'],
      bos_piece=pieces['cls'],
      eos_id=ids['sep'],
      eos_piece=pieces['sep'],
      # Follows the four control pieces, so it gets id 4; user-defined
      # pieces also match the literal text "[MASK]" when encoding.
      user_defined_symbols=[pieces['mask']],
      # Soft limit: a corpus too small for `vocab_size` pieces gives fewer
      # instead of failing (the bundled 1 MB corpus fills ~7.5k unigram
      # pieces); the model's embedding table may be larger than needed.
      hard_vocab_limit=False,
      character_coverage=1.0,
      byte_fallback=False,
      # Sampling sentences above this count keeps memory and time bounded
      # on large corpora; it is seeded above, so training is deterministic.
      input_sentence_size=2_000_000,
      shuffle_input_sentence=True,
      max_sentence_length=1 << 16,
      # One thread: multi-threaded EM can give different pieces run to run.
      num_threads=1,
      minloglevel=2,
    )
  except RuntimeError as e:
    if 'Vocabulary size' not in str(e):
      raise
    # SentencePiece fails for a vocab too small for the text's characters,
    # or (were the limit hard) too large for the text.
    advice = 'smaller' if 'too high' in str(e) else 'larger'
    raise ValueError(
      f'Cannot train a tokenizer with model.vocab_size={vocab_size} on this '
      f'text ({e}); use a {advice} --config.model.vocab_size.'
    ) from e
  _write_atomically(path, model.getvalue())


# The defaults of the tokenizers library's BertWordPieceTokenizer and
# ByteLevelBPETokenizer: a merge needs a pair seen twice, and WordPiece
# keeps the 1,000 most frequent characters (the rest encode as [UNK]).
_HF_MIN_FREQUENCY = 2
_WORDPIECE_ALPHABET = 1000


def _bert_pipeline(lowercase: bool) -> tokenizers.Tokenizer:
  """A WordPiece model behind BERT's normaliser and pre-tokenizer."""
  hf = tokenizers.Tokenizer(
    tokenizers.models.WordPiece(unk_token=SPECIAL_PIECES['unk'][0])
  )
  # strip_accents=None strips them when lower-casing, as BERT's uncased
  # models (and WordPieceTokenizer's "strip_accents": null) do.
  hf.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=lowercase)
  hf.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
  return hf


def _wordpiece_alphabet(
  texts: Sequence[str], lowercase: bool
) -> tuple[list[str], list[str]]:
  """(characters, '##' continuations) a WordPiece vocab of `texts` starts with.

  The ones the tokenizers library's trainer would pick: the
  _WORDPIECE_ALPHABET most frequent characters after BERT's normalisation,
  and '##c' for those that occur inside a word. Its trainer numbers the
  continuations in hash-map order, and a tie between merges goes to the
  lower ids, so two runs on the same text can learn different vocabularies
  (huggingface/tokenizers#1794); given sorted, as the first tokens, they
  have the same ids in every run.
  """
  hf = _bert_pipeline(lowercase)
  # With no room for merges, training only lists the initial tokens: every
  # character and continuation, with no alphabet limit.
  hf.train_from_iterator(
    texts,
    tokenizers.trainers.WordPieceTrainer(vocab_size=0, show_progress=False),
  )
  initial = hf.get_vocab()
  chars = sorted(t for t in initial if len(t) == 1)
  if len(chars) > _WORDPIECE_ALPHABET:
    # Character counts, most frequent first (ties by character): a word
    # level vocabulary of the text split into single characters.
    counter = tokenizers.Tokenizer(
      tokenizers.models.WordLevel(unk_token=SPECIAL_PIECES['unk'][0])
    )
    counter.normalizer = hf.normalizer
    counter.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
      [
        hf.pre_tokenizer,
        tokenizers.pre_tokenizers.Split(tokenizers.Regex('.'), 'isolated'),
      ]
    )
    counter.train_from_iterator(
      texts,
      tokenizers.trainers.WordLevelTrainer(
        vocab_size=_WORDPIECE_ALPHABET, show_progress=False
      ),
    )
    chars = sorted(counter.get_vocab())
  continuations = [f'##{c}' for c in chars if f'##{c}' in initial]
  return chars, continuations


def _check_room(kind: str, needed: int, what: str, vocab_size: int) -> None:
  """Raises unless `vocab_size` holds the `needed` ids training starts with."""
  # Checked before writing, so a fixed rerun does not find a tokenizer that
  # its model cannot hold in the workdir.
  if needed > vocab_size:
    raise ValueError(
      f'A {kind} tokenizer of this text starts with {needed} ids ({what}), '
      f'more than its vocab_size={vocab_size} (model.vocab_size less the '
      'ids the objective reserves); raise --config.model.vocab_size.'
    )


def _write_hf_trained(
  hf: tokenizers.Tokenizer, path: str, build, config: dict
) -> None:
  """Writes the trained `hf` model as the JSON document the importer makes.

  `build` is the importer's spec builder, reading the files the model
  saves (vocab.txt, or vocab.json and merges.txt) and `config` as
  tokenizer_config.json's content.
  """
  with tempfile.TemporaryDirectory() as src_dir:
    hf.model.save(src_dir)
    spec = build(src_dir, config, {})
  # No Hugging Face configs of its own to write back on export.
  del spec['hf_tokenizer_config'], spec['hf_special_tokens_map']
  _write_atomically(path, _spec_bytes(spec))


def _train_wordpiece(
  texts: Iterable[str], path: str, *, vocab_size: int, lowercase: bool
) -> None:
  """Writes BERT's WordPiece, trained on `texts`, to `path`.

  The pipeline of the tokenizers library's BertWordPieceTokenizer, with the
  five specials at the ids of SPECIAL_PIECES.
  """
  texts = list(texts)  # read three times: alphabet, counts, training
  chars, continuations = _wordpiece_alphabet(texts, lowercase)
  specials = [piece for piece, _ in SPECIAL_PIECES.values()]
  _check_room(
    'WordPiece',
    len(specials) + len(chars) + len(continuations),
    f'{len(specials)} specials, {len(chars)} characters and '
    f'{len(continuations)} "##" continuations',
    vocab_size,
  )
  hf = _bert_pipeline(lowercase)
  trainer = tokenizers.trainers.WordPieceTrainer(
    vocab_size=vocab_size,
    min_frequency=_HF_MIN_FREQUENCY,
    # Given in this order, the initial tokens take the first ids; the
    # trainer's own alphabet is then empty. (The throwaway `hf` tokenizer
    # treats them as specials; only its model's vocab is kept.)
    special_tokens=specials + chars + continuations,
    limit_alphabet=0,
    continuing_subword_prefix='##',
    show_progress=False,
  )
  hf.train_from_iterator(texts, trainer)
  _write_hf_trained(hf, path, _wordpiece_spec, {'do_lower_case': lowercase})


def _train_byte_bpe(
  texts: Iterable[str], path: str, *, vocab_size: int
) -> None:
  """Writes a byte-level BPE (GPT-2's encoding), trained on `texts`, to `path`.

  RoBERTa's and BART's special tokens, so that every objective finds its
  mask and separator, at the ids of SPECIAL_PIECES: <pad>=0, <unk>=1,
  <s>=2, </s>=3, <mask>=4. Padding at 0 matches model.pad_id's default.
  """
  specials = [_ROBERTA_TOKENS[name] for name in SPECIAL_PIECES]
  alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
  _check_room(
    'byte-level BPE',
    len(specials) + len(alphabet),
    f'{len(specials)} specials and {len(alphabet)} bytes',
    vocab_size,
  )
  hf = tokenizers.Tokenizer(tokenizers.models.BPE())
  # GPT-2's, RoBERTa's and BART's: no space added before the text.
  hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=_HF_MIN_FREQUENCY,
    special_tokens=specials,
    # Every byte, seen or not, so that any text encodes without <unk>.
    initial_alphabet=alphabet,
    show_progress=False,
  )
  hf.train_from_iterator(texts, trainer)
  _write_hf_trained(hf, path, _byte_bpe_spec, {})


def _train_char_tokenizer(
  texts: Iterable[str], path: str, *, vocab_size: int
) -> CharTokenizer:
  """Writes the char tokenizer of `texts`' distinct characters to `path`."""
  chars = set()
  for text in texts:
    chars.update(text)
  if not chars:
    raise ValueError('Cannot train a char tokenizer on no text.')
  num_ids = len(SPECIAL_PIECES) + len(chars)
  # Checked before writing, so a fixed rerun does not find a tokenizer that
  # its model cannot hold in the workdir.
  if num_ids > vocab_size:
    raise ValueError(
      f'The text has {len(chars)} distinct characters, so the char '
      f'tokenizer needs {num_ids} ids with the specials, more than '
      f'model.vocab_size={vocab_size}; set --config.model.vocab_size='
      f'{num_ids} or larger.'
    )
  # Sorted by code point, so the ids depend only on the set of characters.
  spec = {'type': CHAR_TYPE, 'chars': sorted(chars)}
  _write_atomically(path, json.dumps(spec).encode('ascii'))
  return CharTokenizer(path)


def setup_tokenizer(
  data_config: ml_collections.ConfigDict,
  *,
  vocab_size: int,
  workdir: str,
  is_chief: bool = True,
  reserved_ids: int = 0,
) -> Tokenizer:
  """The run's tokenizer, stored as `workdir/tokenizer.model`.

  Only the chief writes; other processes load the chief's file, so the caller
  must put a barrier between the chief's call and theirs.

  Args:
    data_config: the config's `data` section.
    vocab_size: model.vocab_size, the rows of the embedding table.
    workdir: the run's directory.
    is_chief: whether this is process 0.
    reserved_ids: ids the objective needs after the tokenizer's (T5's
      sentinels): a new tokenizer gets vocab_size - reserved_ids at most.

  Returns:
    The tokenizer, with vocab_size <= `vocab_size` - `reserved_ids`.
  """
  room = vocab_size - reserved_ids
  if room <= len(SPECIAL_PIECES):
    raise ValueError(
      f'model.vocab_size={vocab_size} leaves {room} ids for the tokenizer '
      f'after the {reserved_ids} ids the objective reserves; raise '
      'model.vocab_size.'
    )
  path = os.path.join(workdir, WORKDIR_FILENAME)
  # Resume order: (1) the workdir's tokenizer, since a resumed run must keep
  # the ids its checkpoints were trained with; (2) data.tokenizer, copied into
  # the workdir so the run stays self-contained; (3) a new one trained on
  # data.source.
  # A prepared corpus brings the tokenizer its rows were made with.
  given = data_config.tokenizer
  if not given and data_config.source.strip().startswith(records.PREFIX):
    given = os.path.join(
      prepared.parse_source(data_config.source)[0].directory,
      records.TOKENIZER_FILE,
    )
  if not is_chief or tf.io.gfile.exists(path):
    tokenizer = load_tokenizer(path)
  elif given:
    tokenizer = load_tokenizer(given)
    _check_fits(tokenizer, vocab_size, reserved_ids)
    tf.io.gfile.makedirs(workdir)
    tf.io.gfile.copy(given, path, overwrite=True)
    tokenizer = load_tokenizer(path)
  else:
    logging.info(
      'Training a %s tokenizer (vocab %d) on %s.',
      data_config.tokenizer_type,
      room,
      data_config.source,
    )
    texts = sources.iter_texts(
      data_config, limit=data_config.tokenizer_max_docs
    )
    tokenizer = train_tokenizer(
      texts,
      path,
      vocab_size=room,
      model_type=data_config.tokenizer_type,
      seed=data_config.seed,
    )
  _check_fits(tokenizer, vocab_size, reserved_ids)
  return tokenizer


def _check_fits(
  tokenizer: Tokenizer, vocab_size: int, reserved_ids: int = 0
) -> None:
  """Raises if the model's embedding table has no row for some token id."""
  if tokenizer.vocab_size + reserved_ids > vocab_size:
    reserved = (
      f' plus the {reserved_ids} ids the objective reserves'
      if reserved_ids
      else ''
    )
    raise ValueError(
      f'Tokenizer {tokenizer.path!r} has {tokenizer.vocab_size} tokens'
      f'{reserved}, more than model.vocab_size={vocab_size}; set '
      f'--config.model.vocab_size={tokenizer.vocab_size + reserved_ids} or '
      'larger.'
    )
