"""Masked-language modelling (BERT, Devlin et al. 2019), masks drawn per epoch.

Of the tokens that are not [PAD]/[CLS]/[SEP]/[MASK], exactly
round(mask_rate * n) are predicted (at least one), at most
ceil(mask_rate * seq_len) per row; of those, mask_token_rate become [MASK],
random_token_rate a uniformly random normal token and the rest stay as they
are. The model predicts only at the chosen positions (`masked_positions`), so
its output is mlm_logits[B, P, V] rather than [B, L, V].
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
import optax
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib

FAMILIES = ('encoder',)


def max_predictions(mask_rate: float, seq_len: int) -> int:
  """P: the number of prediction slots per row."""
  return math.ceil(mask_rate * seq_len)


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """Masks one packed row; all randomness comes from the stateless `seed`.

  Args:
    row: a packed row, {'input_ids', 'segment_ids', 'positions'} int32[L].
    seed: int32/int64[2], a stateless seed unique to (epoch, row).
    config: the `objective` config section.
    tokenizer: gives the special ids, first_normal_id and vocab_size.

  Returns:
    input_ids int32[L] (masked); the row's segment_ids and positions
    int32[L] unchanged (the packed documents, for attention and position
    embeddings); token_type_ids int32[L] (BERT's sentence A/B ids, all 0);
    input_mask int32[L]; masked_positions int32[P] (ascending, 0-padded),
    masked_ids int32[P] (the original tokens), masked_weights float32[P]
    (1 real, 0 padding).
  """
  ids = tf.cast(row['input_ids'], tf.int32)
  seq_len = ids.shape[0]
  num_slots = max_predictions(config.mask_rate, seq_len)
  # Masking keeps the packed documents' segments and positions.
  packed = {
    key: tf.ensure_shape(tf.cast(row[key], tf.int32), [seq_len])
    for key in ('segment_ids', 'positions')
  }
  seeds = tf.random.experimental.stateless_split(seed, num=4)

  special = tf.constant(
    [tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id]
  )
  is_candidate = tf.reduce_all(ids[:, None] != special, axis=1)
  num_candidates = tf.reduce_sum(tf.cast(is_candidate, tf.int32))
  # float64 and round-half-to-even, so the count equals Python's
  # round(mask_rate * n) exactly.
  num_masked = tf.cast(
    tf.round(tf.cast(num_candidates, tf.float64) * config.mask_rate),
    tf.int32,
  )
  num_masked = tf.maximum(num_masked, tf.minimum(num_candidates, 1))
  num_masked = tf.minimum(num_masked, num_slots)

  # A uniformly random subset of size num_masked: the candidates with the
  # largest random scores (non-candidates score -1 and are never reached).
  scores = tf.random.stateless_uniform([seq_len], seed=seeds[0])
  scores = tf.where(is_candidate, scores, -1.0)
  _, top = tf.math.top_k(scores, k=num_slots)
  is_real = tf.range(num_slots) < num_masked
  # Sorting with padding slots at seq_len puts the real positions first.
  positions = tf.sort(tf.where(is_real, top, seq_len))
  positions = tf.where(is_real, positions, 0)
  originals = tf.gather(ids, positions)

  # 80% [MASK] / 10% random / 10% unchanged (with the default rates).
  action = tf.random.stateless_uniform([num_slots], seed=seeds[1])
  random_ids = tf.random.stateless_uniform(
    [num_slots],
    seed=seeds[2],
    minval=tokenizer.first_normal_id,
    maxval=tokenizer.vocab_size,
    dtype=tf.int32,
  )
  replaced = tf.where(
    action < config.mask_token_rate,
    tokenizer.mask_id,
    tf.where(
      action < config.mask_token_rate + config.random_token_rate,
      random_ids,
      originals,
    ),
  )
  # Padding slots scatter into an extra, dropped position, so they can never
  # overwrite a real one.
  targets = tf.where(is_real, positions, seq_len)[:, None]
  padded_ids = tf.concat([ids, [0]], axis=0)
  masked_input = tf.tensor_scatter_nd_update(padded_ids, targets, replaced)
  return {
    'input_ids': tf.ensure_shape(masked_input[:seq_len], [seq_len]),
    **packed,
    'token_type_ids': tf.zeros([seq_len], tf.int32),
    'input_mask': tf.cast(ids != tokenizer.pad_id, tf.int32),
    'masked_positions': positions,
    'masked_ids': tf.where(is_real, originals, 0),
    'masked_weights': tf.cast(is_real, tf.float32),
  }


def loss(
  outputs: dict[str, jax.Array], batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean cross-entropy over the masked positions, and metrics.

  Args:
    outputs: {'mlm_logits': float[B, P, V]}, logits at `masked_positions`.
    batch: the transform's features, batched.

  Returns:
    The scalar loss and {'loss', 'mlm_accuracy', 'num_predictions'}.
  """
  # float32 softmax: bfloat16 log-sum-exp over a large vocab loses precision.
  logits = outputs['mlm_logits'].astype(jnp.float32)
  labels = batch['masked_ids']
  weights = batch['masked_weights'].astype(jnp.float32)
  xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  num_predictions = jnp.sum(weights)
  # A batch with nothing to predict gives 0, not NaN.
  denominator = jnp.maximum(num_predictions, 1e-8)
  mean_loss = jnp.sum(xent * weights) / denominator
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  accuracy = jnp.sum(correct * weights) / denominator
  metrics = {
    'loss': mean_loss,
    'mlm_accuracy': accuracy,
    'num_predictions': num_predictions,
  }
  return mean_loss, metrics
