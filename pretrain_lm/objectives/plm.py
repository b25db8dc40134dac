"""Permutation language modelling (XLNet, Yang et al. 2019), orders per epoch.

Each row gets a uniformly random factorisation order of its normal tokens
(not [PAD]/[CLS]/[SEP]/[MASK]); the last ceil(n / plm_k) tokens of the
order are predicted (partial prediction, section 2.3, K = plm_k), each from
the tokens before it in the order. The other tokens and the specials come
first and, as in XLNet's implementation, see each other bidirectionally.
The order reaches the model (pretrain_lm.models.plm, two-stream attention)
as `perm_rank`: a predicted token's rank among the predicted ones, -1 for
every other token. The input is not corrupted; the loss is MLM's
cross-entropy at the predicted positions.

Not implemented: Transformer-XL's segment recurrence (memory) and XLNet's
relative segment encodings; targets are single tokens drawn uniformly, as
section 2.3 defines them, not the n-gram spans of the released code.
"""

import math

import ml_collections
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import mlm

FAMILIES = ('plm',)

# Cross-entropy over `mlm_logits` at `masked_positions`, as for MLM.
loss = mlm.loss


def max_predictions(plm_k: int, seq_len: int) -> int:
  """P: prediction slots per row, ceil(L / K) >= ceil(n / K) for n <= L."""
  return math.ceil(seq_len / plm_k)


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """Draws one row's factorisation order from the stateless `seed`.

  Args:
    row: a packed row, {'input_ids', 'segment_ids', 'positions'} int32[L].
    seed: int32/int64[2], a stateless seed unique to (epoch, row).
    config: the `objective` config section (uses plm_k).
    tokenizer: gives the special ids.

  Returns:
    input_ids, segment_ids, positions int32[L] unchanged; input_mask
    int32[L]; perm_rank int32[L] (0, 1, ... in order on the predicted
    tokens, -1 elsewhere); masked_positions int32[P] (the predicted
    positions, ascending, 0-padded), masked_ids int32[P] (their tokens),
    masked_weights float32[P] (1 real, 0 padding), P = ceil(L / plm_k).
  """
  if config.plm_k < 1:
    raise ValueError(f'objective.plm_k={config.plm_k} must be >= 1.')
  ids = tf.cast(row['input_ids'], tf.int32)
  seq_len = ids.shape[0]
  packed = {
    key: tf.ensure_shape(tf.cast(row[key], tf.int32), [seq_len])
    for key in ('input_ids', 'segment_ids', 'positions')
  }
  num_slots = max_predictions(config.plm_k, seq_len)

  special = tf.constant(
    [tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id]
  )
  is_normal = tf.reduce_all(ids[:, None] != special, axis=1)
  num_normal = tf.reduce_sum(tf.cast(is_normal, tf.int32))
  num_predicted = (num_normal + config.plm_k - 1) // config.plm_k

  # Sorting iid uniform scores gives a uniformly random order of the normal
  # tokens; specials score -1 and so come first. The last num_predicted of
  # the order are the top scores, top_k's first entries, highest first.
  scores = tf.random.stateless_uniform([seq_len], seed=seed)
  scores = tf.where(is_normal, scores, -1.0)
  _, top = tf.math.top_k(scores, k=num_slots)
  slot = tf.range(num_slots)
  is_real = slot < num_predicted
  rank = num_predicted - 1 - slot  # top[0] is predicted last

  # Padding slots scatter into an extra, dropped position.
  targets = tf.where(is_real, top, seq_len)[:, None]
  perm_rank = tf.tensor_scatter_nd_update(
    tf.fill([seq_len + 1], -1), targets, tf.where(is_real, rank, -1)
  )[:seq_len]
  # Sorting with padding slots at seq_len puts the real positions first.
  positions = tf.sort(tf.where(is_real, top, seq_len))
  positions = tf.where(is_real, positions, 0)
  return {
    **packed,
    'input_mask': tf.cast(ids != tokenizer.pad_id, tf.int32),
    'perm_rank': tf.ensure_shape(perm_rank, [seq_len]),
    'masked_positions': positions,
    'masked_ids': tf.where(is_real, tf.gather(ids, positions), 0),
    'masked_weights': tf.cast(is_real, tf.float32),
  }
