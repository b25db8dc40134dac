"""Sentence pairs for BERT's NSP and ALBERT's SOP, built from packed rows.

The mlm objective calls `make_pair` when `config.sentence_task` is set; MLM
masking then applies to the pair. Rows come from 'doc_sentences' packing
([CLS] piece [SEP] [PAD]*, one document piece per row), and the piece is
split at a uniformly random point into a non-empty A and B:

- 'nsp' (Devlin et al. 2019): with probability 1/2 B is kept (label 0,
  IsNext, BERT's convention); else B is replaced by as many tokens of the
  partner row's piece (another document, from a uniformly random offset;
  fewer if that piece is shorter) (label 1, NotNext).
- 'sop' (Lan et al. 2020): with probability 1/2 A and B swap places
  (label 1), else they stay in order (label 0). Both segments come from
  one document, so topic gives nothing away.

A piece of fewer than 2 tokens cannot be split: it stays one segment with
sentence_weights 0, so the sentence loss ignores it.
"""

import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib

TASKS = ('', 'nsp', 'sop')


def _piece(row: dict[str, tf.Tensor], sep_id: int) -> tf.Tensor:
  """The tokens between a 'doc_sentences' row's [CLS] and its [SEP]."""
  ids = tf.cast(row['input_ids'], tf.int32)
  row_len = ids.shape[0]
  end = tf.reduce_min(tf.where(ids == sep_id, tf.range(row_len), row_len))
  return ids[1:end]


def make_pair(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  task: str,
  tokenizer: tokenizer_lib.Tokenizer,
  partner: dict[str, tf.Tensor] | None = None,
) -> dict[str, tf.Tensor]:
  """[CLS] A [SEP] B [SEP] [PAD]* from one packed row, before masking.

  Args:
    row: a 'doc_sentences' row, {'input_ids', ...} int32[R].
    seed: a stateless seed (int64[2]) for the split point and the label.
    task: 'nsp' or 'sop'.
    tokenizer: gives the special ids.
    partner: another row (same keys and length); required for 'nsp'.

  Returns:
    int32[R + 1] input_ids; token_type_ids (0 on [CLS] A [SEP], 1 on
    B [SEP], 0 on padding); segment_ids (1 on every real token: A and B
    attend to each other; 0 on padding); positions (0, 1, ... over the
    pair, 0 on padding); and sentence_labels int32[], sentence_weights
    float32[].
  """
  if task not in TASKS[1:]:
    raise ValueError(f'sentence_task={task!r}; valid: {list(TASKS[1:])}.')
  if task == 'nsp' and partner is None:
    raise ValueError(
      "sentence_task='nsp' needs a partner row (the pipeline passes one "
      'when the objective says needs_partner).'
    )
  out_len = row['input_ids'].shape[0] + 1
  cls_id, sep_id = tokenizer.cls_id, tokenizer.sep_id
  piece = _piece(row, sep_id)
  n = tf.size(piece)
  u = tf.random.stateless_uniform([3], seed=seed, dtype=tf.float64)
  is_pair = n >= 2
  # A gets 1..n-1 tokens, uniformly.
  num_splits = tf.maximum(n - 1, 1)
  split = tf.cast(u[0] * tf.cast(num_splits, tf.float64), tf.int32)
  split = 1 + tf.minimum(split, num_splits - 1)
  first, second = piece[:split], piece[split:]
  flip = is_pair & (u[1] < 0.5)
  if task == 'nsp':
    other = _piece(partner, sep_id)
    want = n - split
    # An offset that leaves `want` tokens where the partner's piece has
    # them, so B's length tells nothing about the label.
    room = tf.maximum(tf.size(other) - want, 0) + 1
    offset = tf.cast(u[2] * tf.cast(room, tf.float64), tf.int32)
    offset = tf.minimum(offset, room - 1)
    flip &= tf.size(other) > 0
    second = tf.cond(
      flip, lambda: other[offset : offset + want], lambda: second
    )
  else:
    first, second = tf.cond(
      flip, lambda: (second, first), lambda: (first, second)
    )
  # An unsplit piece (first = the piece, second empty) has no second [SEP].
  tail = tf.fill([tf.cast(is_pair, tf.int32)], sep_id)
  tokens = tf.concat([[cls_id], first, [sep_id], second, tail], axis=0)
  size = tf.size(tokens)
  input_ids = tf.pad(
    tokens, [[0, out_len - size]], constant_values=tokenizer.pad_id
  )
  index = tf.range(out_len)
  is_real = index < size
  is_b = is_real & (index >= tf.size(first) + 2)
  return {
    'input_ids': tf.ensure_shape(input_ids, [out_len]),
    'token_type_ids': tf.cast(is_b, tf.int32),
    'segment_ids': tf.cast(is_real, tf.int32),
    'positions': tf.where(is_real, index, 0),
    'sentence_labels': tf.cast(flip, tf.int32),
    'sentence_weights': tf.cast(is_pair, tf.float32),
  }
