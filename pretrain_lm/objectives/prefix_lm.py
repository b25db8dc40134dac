"""Prefix language modelling (T5 §3.2.2; UniLM, Dong et al. 2019).

Each packed document is split into a prefix, which the decoder reads with
bidirectional attention and is not trained to predict, and the rest, which
it predicts token by token as a causal LM. Rows are packed and shifted as
in `clm` (row_length = seq_len + 1).

The prefix of a document with n tokens in the packed row (counting its
[SEP]; a document cut across rows counts its piece in this row) is its
first p tokens, p drawn uniformly from the integers
[ceil(min_prefix * n), floor((1 - min_prefix) * n)] (both ends included;
if min_prefix leaves no integer, p = ceil(min_prefix * n)). With the
default min_prefix = 0 that is {0, ..., n}: p = 0 is a plain causal LM of
the document, p = n a document that is only read.

`prefix_mask` [L] marks the input positions in a prefix: the model lets
them attend to each other both ways (within their document). A target is
predicted only outside its document's prefix, so the last prefix token
predicts the first target token and nothing in the prefix is a target.
"""

import ml_collections
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import clm

FAMILIES = ('decoder',)

row_length = clm.row_length
loss = clm.loss

# Keeps ceil(0.3 * 10) at 3 although 0.3 * 10 is 3.0000000000000004 in
# float64; far smaller than any real step of rate * n.
_EPS = 1e-9


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError unless objective.min_prefix is in [0, 0.5]."""
  m = config.objective.min_prefix
  if not 0 <= m <= 0.5:
    raise ValueError(
      f'objective.min_prefix={m} must be in [0, 0.5]: the prefix is '
      'Uniform over [min_prefix, 1 - min_prefix] of each document.'
    )


def prefix_lengths(
  counts: tf.Tensor, seed: tf.Tensor, min_prefix: float
) -> tf.Tensor:
  """Uniform prefix lengths int32[K] for documents of counts int32[K]."""
  n = tf.cast(counts, tf.float64)
  low = tf.math.ceil(min_prefix * n - _EPS)
  high = tf.maximum(tf.math.floor((1.0 - min_prefix) * n + _EPS), low)
  u = tf.random.stateless_uniform(tf.shape(counts), seed, dtype=tf.float64)
  # u < 1, so floor(u * m) is uniform on {0, ..., m - 1}; the minimum guards
  # the float product rounding up to m.
  offset = tf.minimum(tf.math.floor(u * (high - low + 1)), high - low)
  return tf.cast(low + offset, tf.int32)


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """Shifts a packed row into inputs and targets and draws the prefixes.

  Args:
    row: a packed row, {'input_ids', 'segment_ids', 'positions'} int32[R],
      R = seq_len + 1.
    seed: int64[2], the row's stateless seed.
    config: the `objective` section (reads min_prefix).
    tokenizer: unused (no special ids are needed).

  Returns:
    clm's input_ids, segment_ids, positions, target_ids int32[L] and
    target_weights float32[L] (now 0 where the target is in a prefix), and
    prefix_mask int32[L], 1 on the input tokens in their document's prefix.
  """
  features = clm.transform(row, seed, config=config, tokenizer=tokenizer)
  segments = tf.cast(row['segment_ids'], tf.int32)
  positions = tf.cast(row['positions'], tf.int32)
  R = segments.shape[0]
  # Segment ids are < R + 1: one length per possible id, 0 ([PAD]) unused.
  counts = tf.math.unsorted_segment_sum(
    tf.ones_like(segments), segments, num_segments=R + 1
  )
  lengths = prefix_lengths(counts, seed, config.min_prefix)
  in_prefix = tf.logical_and(
    positions < tf.gather(lengths, segments), segments != 0
  )
  weights = features['target_weights'] * tf.cast(
    tf.logical_not(in_prefix[1:]), tf.float32
  )
  return {
    **features,
    'target_weights': weights,
    'prefix_mask': tf.cast(in_prefix[:-1], tf.int32),
  }
