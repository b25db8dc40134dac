"""SentencePiece models: ours (unigram or BPE) and imported ones (T5)."""

from collections.abc import Iterable

import sentencepiece as spm
import tensorflow as tf
import tensorflow_text as tf_text

from pretrain_lm.data.tokenizer.base import (
  NO_ID,
  SENTENCEPIECE_KIND,
  SPECIAL_PIECES,
  Tokenizer,
)


class SentencePieceTokenizer(Tokenizer, kind=SENTENCEPIECE_KIND):
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
