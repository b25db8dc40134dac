"""Tokenizers (SentencePiece or characters): training, loading, run setup.

Every tokenizer here has the same five special tokens at fixed ids, so that
objectives, checkpoints and fine-tuning code can rely on them:
[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4.

Two kinds share one interface (`Tokenizer`) and one file name in a workdir:
a SentencePiece model ('unigram' or 'bpe', a binary proto) and a character
vocabulary ('char', a small JSON file); loading tells them apart by content.
"""

import io
import json
import os
from collections.abc import Iterable, Iterator

import ml_collections
import sentencepiece as spm
import tensorflow as tf
import tensorflow_text as tf_text
from absl import logging

from pretrain_lm.data import sources

SPECIAL_PIECES = {
  'pad': ('[PAD]', 0),
  'unk': ('[UNK]', 1),
  'cls': ('[CLS]', 2),
  'sep': ('[SEP]', 3),
  'mask': ('[MASK]', 4),
}
CHAR_TYPE = 'char'
# data.tokenizer_type: SentencePiece's two, or characters.
MODEL_TYPES = ('unigram', 'bpe', CHAR_TYPE)
# The file a run keeps its tokenizer in, inside the workdir.
WORKDIR_FILENAME = 'tokenizer.model'


def _read(path: str, size: int = -1) -> bytes:
  """The first `size` bytes of the file (all for -1)."""
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f'Tokenizer file not found: {path!r}.')
  with tf.io.gfile.GFile(path, 'rb') as f:
    return f.read(size)


def _is_char_file(path: str) -> bool:
  # A SentencePiece proto starts with a field tag (0x0a for its pieces), never
  # '{', so the first bytes tell the two kinds apart.
  return _read(path, 64).lstrip()[:1] == b'{'


class Tokenizer:
  """The interface of every tokenizer here, and its fixed special ids.

  `Tokenizer(path)` loads the file at `path` (local or gs://) as the kind its
  content shows: a `CharTokenizer` for a JSON file, else a
  `SentencePieceTokenizer`.
  """

  def __new__(cls, path: str):
    if cls is Tokenizer:
      cls = CharTokenizer if _is_char_file(path) else SentencePieceTokenizer
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
    return SPECIAL_PIECES['pad'][1]

  @property
  def unk_id(self) -> int:
    return SPECIAL_PIECES['unk'][1]

  @property
  def cls_id(self) -> int:
    return SPECIAL_PIECES['cls'][1]

  @property
  def sep_id(self) -> int:
    return SPECIAL_PIECES['sep'][1]

  @property
  def mask_id(self) -> int:
    return SPECIAL_PIECES['mask'][1]

  @property
  def special_ids(self) -> dict[str, int]:
    """Name -> id of the special tokens (JSON-serialisable, for metadata)."""
    return {name: i for name, (_, i) in SPECIAL_PIECES.items()}

  @property
  def first_normal_id(self) -> int:
    """The smallest id that is not a special token."""
    return max(self.special_ids.values()) + 1

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
  """A SentencePiece model with the fixed special ids checked on load."""

  def _load(self) -> None:
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(self._model_bytes)
    except RuntimeError as e:
      raise ValueError(
        f'{self.path!r} is not a SentencePiece model: {e}'
      ) from e
    self._check_special_ids()

  def _check_special_ids(self):
    """Raises if this model's special tokens are not at the fixed ids."""
    found = {
      'pad': self._sp.pad_id(),
      'unk': self._sp.unk_id(),
      'cls': self._sp.bos_id(),
      'sep': self._sp.eos_id(),
      'mask': self._sp.piece_to_id('[MASK]'),
    }
    for name, (piece, want) in SPECIAL_PIECES.items():
      ok = found[name] == want and self._sp.id_to_piece(want) == piece
      if not ok:
        wanted = ', '.join(f'{p}={i}' for p, i in SPECIAL_PIECES.values())
        raise ValueError(
          f'Tokenizer {self.path!r} has {piece} at id {found[name]}; '
          f'pretrain_lm needs {wanted}. Train one with '
          'pretrain_lm.data.tokenizer.train_tokenizer.'
        )

  @property
  def vocab_size(self) -> int:
    return self._sp.vocab_size()

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


def load_tokenizer(path: str) -> Tokenizer:
  """Loads a tokenizer file (local or gs://) of either kind."""
  return Tokenizer(path)


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
) -> Tokenizer:
  """Trains a tokenizer on `texts` and writes it to `path`.

  Args:
    texts: documents. SentencePiece trains on each line of each as a
      sentence; 'char' takes every character, newlines included.
    path: where to write the tokenizer file (local or gs://).
    vocab_size: the most ids the tokenizer may have (model.vocab_size).
      SentencePiece's limit is soft: small corpora give fewer pieces.
      'char' has as many ids as the text has distinct characters (plus the
      specials) and fails if that is more.
    model_type: 'unigram' or 'bpe' (SentencePiece), or 'char'.
    seed: seeds SentencePiece's sentence sampling.

  Returns:
    The trained tokenizer, loaded from `path`.
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(
      f'data.tokenizer_type={model_type!r} is not one of {MODEL_TYPES}.'
    )
  if model_type == CHAR_TYPE:
    return _train_char_tokenizer(texts, path, vocab_size=vocab_size)
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
  if not is_chief or tf.io.gfile.exists(path):
    tokenizer = load_tokenizer(path)
  elif data_config.tokenizer:
    tokenizer = load_tokenizer(data_config.tokenizer)
    _check_fits(tokenizer, vocab_size, reserved_ids)
    tf.io.gfile.makedirs(workdir)
    tf.io.gfile.copy(data_config.tokenizer, path, overwrite=True)
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
