"""The Tokenizer interface, its special tokens and the file helpers it uses."""

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import tensorflow as tf

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
# The kind of a SentencePiece model proto, the one binary file kind.
SENTENCEPIECE_KIND = 'sentencepiece'


def read_file(path: str, size: int = -1) -> bytes:
  """The first `size` bytes of the file (all for -1)."""
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f'Tokenizer file not found: {path!r}.')
  with tf.io.gfile.GFile(path, 'rb') as f:
    return f.read(size)


def parse_json(model_bytes: bytes) -> dict | None:
  """The JSON object in `model_bytes`, or None if it holds none."""
  try:
    spec = json.loads(model_bytes.decode('utf-8'))
  except ValueError:  # UnicodeDecodeError and JSONDecodeError included
    return None
  return spec if isinstance(spec, dict) else None


def write_atomically(path: str, content: bytes) -> None:
  """Writes `content` to `path` whole or not at all."""
  tf.io.gfile.makedirs(os.path.dirname(path) or '.')
  # Write then rename, so a crash never leaves a truncated tokenizer that a
  # resumed run would pick up.
  tmp_path = path + '.tmp'
  with tf.io.gfile.GFile(tmp_path, 'wb') as f:
    f.write(content)
  tf.io.gfile.rename(tmp_path, path, overwrite=True)


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
  # Kind -> class: each kind's module defines `class X(Tokenizer, kind=...)`,
  # and the package's __init__ imports them all.
  _kinds: dict[str, type['Tokenizer']] = {}

  def __init_subclass__(cls, *, kind: str | None = None, **kwargs):
    super().__init_subclass__(**kwargs)
    if kind is not None:
      Tokenizer._kinds[kind] = cls

  def __new__(cls, path: str):
    if cls is Tokenizer:
      cls = _tokenizer_class(path)
    return super().__new__(cls)

  def __init__(self, path: str):
    self.path = path
    self._model_bytes = read_file(path)
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


def _tokenizer_class(path: str) -> type[Tokenizer]:
  """The class for the file at `path`, from its content."""
  # A SentencePiece proto starts with a field tag (0x0a for its pieces), never
  # '{', so the first bytes tell it from the JSON kinds.
  if read_file(path, 64).lstrip()[:1] != b'{':
    return Tokenizer._kinds[SENTENCEPIECE_KIND]
  spec = parse_json(read_file(path)) or {}
  kinds = {k: c for k, c in Tokenizer._kinds.items() if k != SENTENCEPIECE_KIND}
  if spec.get('type') not in kinds:
    raise ValueError(
      f'{path!r} is not a tokenizer file: JSON tokenizers need a "type" '
      f'field, one of {sorted(kinds)}; got {spec.get("type")!r}.'
    )
  return kinds[spec['type']]


def load_tokenizer(path: str) -> Tokenizer:
  """Loads a tokenizer file (local or gs://) of any kind."""
  return Tokenizer(path)


def spec_error(path: str, kind: str, problem: str) -> ValueError:
  """The error for a JSON tokenizer file of `kind` that cannot be used."""
  return ValueError(f'{path!r} is not a valid {kind!r} tokenizer: {problem}.')


def special_ids_by_name(
  path: str,
  kind: str,
  special: Any,
  vocab: dict[str, int],
  required: Sequence[str],
) -> dict[str, int]:
  """Name -> id of `special` (name -> token text or None) in `vocab`."""
  if not isinstance(special, dict):
    raise spec_error(path, kind, '"special" must map names to tokens')
  ids = {}
  for name in SPECIAL_PIECES:
    token = special.get(name)
    if token is None and name not in required:
      ids[name] = NO_ID
    elif token not in vocab:
      raise spec_error(
        path, kind, f'its {name} token {token!r} is not in the vocab'
      )
    else:
      ids[name] = vocab[token]
  return ids
