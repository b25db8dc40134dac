"""Causal language modelling (GPT): predict every next token of a row.

Rows are packed with one extra token (row_length = seq_len + 1) so that a
row of seq_len inputs has seq_len targets, as in nanoGPT's x = data[i:i+L],
y = data[i+1:i+L+1]. A target in another packed document than its input
(the token after a document's final [SEP]) or on padding is not predicted.
"""

import jax
import jax.numpy as jnp
import ml_collections
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import xent as xent_lib

FAMILIES = ('decoder',)


def row_length(config: ml_collections.ConfigDict) -> int:
  """Packed row length: seq_len inputs plus the last one's target."""
  return config.data.seq_len + 1


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """Shifts a packed row into inputs and targets (no randomness).

  Returns input_ids, segment_ids, positions, target_ids int32[L] and
  target_weights float32[L], L = seq_len.
  """
  del seed, config, tokenizer
  ids = tf.cast(row['input_ids'], tf.int32)
  segments = tf.cast(row['segment_ids'], tf.int32)
  same = tf.logical_and(segments[1:] == segments[:-1], segments[1:] != 0)
  return {
    'input_ids': ids[:-1],
    'segment_ids': segments[:-1],
    'positions': tf.cast(row['positions'][:-1], tf.int32),
    'target_ids': ids[1:],
    'target_weights': tf.cast(same, tf.float32),
  }


def loss(
  outputs: dict[str, jax.Array], batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean cross-entropy of `logits` [B, L, V] over the weighted targets.

  With model.logits_chunk the model hands over the per-token terms
  (`target_xent`, `target_correct`) instead of the logits.
  """
  if 'target_xent' in outputs:
    return weighted_means(
      outputs['target_xent'], outputs['target_correct'], batch['target_weights']
    )
  return token_cross_entropy(
    outputs['logits'], batch['target_ids'], batch['target_weights']
  )


def token_cross_entropy(logits, labels, weights):
  """Weighted mean cross-entropy and accuracy; also for seq2seq targets."""
  xent, correct = xent_lib.token_xent(logits, labels)
  return weighted_means(xent, correct, weights)


def weighted_means(xent, correct, weights):
  """The loss and accuracy over the weighted tokens, and their count."""
  weights = weights.astype(jnp.float32)
  num_predictions = jnp.sum(weights)
  denominator = jnp.maximum(num_predictions, 1e-8)  # empty batch: 0, not NaN
  mean_loss = jnp.sum(xent * weights) / denominator
  metrics = {
    'loss': mean_loss,
    'accuracy': jnp.sum(correct * weights) / denominator,
    'num_predictions': num_predictions,
  }
  return mean_loss, metrics
