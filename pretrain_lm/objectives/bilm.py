"""Bidirectional LM (ELMo, Peters et al. 2018): next and previous token.

The `bilm` model runs a forward causal stack over the row and a backward
one over the row reversed. Every token is a target of both directions
within its packed document: the forward direction predicts the token after
each input, the backward direction the token before it, and the loss is
the sum of the two mean cross-entropies, ELMo's joint log-likelihood of
both directions (each normalised by its own number of predictions).

Rows are packed as for `clm` ('concat': doc [SEP] doc [SEP] ...) but with
no extra token: both targets come from inside the row, so its first token
has no backward target and its last no forward target. The [SEP] ending a
document is a forward target (end of text); a document's first token has
no backward target, as nothing marks a document's start.
"""

import jax
import jax.numpy as jnp
import ml_collections
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import clm

FAMILIES = ('bilm',)


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """A packed row and its next- and previous-token targets (no randomness).

  Returns:
    input_ids, segment_ids, positions int32[L] (the row), target_ids and
    backward_target_ids int32[L] (the next and the previous token, 0 where
    there is none), target_weights and backward_target_weights
    float32[L] (1 where that token is in the same document).
  """
  del seed, config, tokenizer
  ids = tf.cast(row['input_ids'], tf.int32)
  segments = tf.cast(row['segment_ids'], tf.int32)
  # Neighbour pairs (i, i + 1) in one document: the forward target of i and
  # the backward target of i + 1.
  same = tf.logical_and(segments[1:] == segments[:-1], segments[1:] != 0)
  no = tf.zeros([1], tf.bool)
  has_next = tf.concat([same, no], axis=0)
  has_previous = tf.concat([no, same], axis=0)
  zero = tf.zeros([1], tf.int32)
  return {
    'input_ids': ids,
    'segment_ids': segments,
    'positions': tf.cast(row['positions'], tf.int32),
    'target_ids': tf.where(has_next, tf.concat([ids[1:], zero], 0), 0),
    'target_weights': tf.cast(has_next, tf.float32),
    'backward_target_ids': tf.where(
      has_previous, tf.concat([zero, ids[:-1]], 0), 0
    ),
    'backward_target_weights': tf.cast(has_previous, tf.float32),
  }


def loss(
  outputs: dict[str, jax.Array], batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Forward + backward mean cross-entropy of `logits`/`backward_logits`.

  Returns:
    The loss and {'loss', 'forward_loss', 'backward_loss', 'accuracy' (over
    both directions' predictions), 'num_predictions' (both directions)}.
  """
  forward_loss, forward = clm.token_cross_entropy(
    outputs['logits'], batch['target_ids'], batch['target_weights']
  )
  backward_loss, backward = clm.token_cross_entropy(
    outputs['backward_logits'],
    batch['backward_target_ids'],
    batch['backward_target_weights'],
  )
  total = forward_loss + backward_loss
  num_predictions = forward['num_predictions'] + backward['num_predictions']
  correct = (
    forward['accuracy'] * forward['num_predictions']
    + backward['accuracy'] * backward['num_predictions']
  )
  metrics = {
    'loss': total,
    'forward_loss': forward_loss,
    'backward_loss': backward_loss,
    'accuracy': correct / jnp.maximum(num_predictions, 1e-8),
    'num_predictions': num_predictions,
  }
  return total, metrics
