"""The character tokenizer: one id per Unicode code point."""

from collections.abc import Iterable

import tensorflow as tf

from pretrain_lm.data.tokenizer.base import (
  CHAR_TYPE,
  SPECIAL_PIECES,
  Tokenizer,
  parse_json,
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
  spec = parse_json(model_bytes)
  if spec is None or spec.get('type') != CHAR_TYPE:
    return None
  chars = spec.get('chars')
  if not isinstance(chars, list) or not chars:
    return None
  if not all(isinstance(c, str) and len(c) == 1 for c in chars):
    return None
  return chars if len(set(chars)) == len(chars) else None


class CharTokenizer(Tokenizer, kind=CHAR_TYPE):
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
