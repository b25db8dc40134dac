"""This host's endless stream of training batches, and where it resumes.

The stream is epoch 0, 1, 2, ... back to back; within an epoch the packed
rows are shuffled with a seed from (data.seed, epoch), and the objective's
random choices (e.g. MLM masks) use a stateless seed from (data.seed,
epoch, row index). So every epoch differs, yet the whole stream is a pure
function of the config and a restart at any batch reproduces it. Prepared
corpora are read by index instead (prepared_input.py).
"""

from collections.abc import Iterator

import ml_collections
import numpy as np
import tensorflow as tf

from pretrain_lm.data import prepared, prepared_input, rows
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.data.rows import RowTransform
from pretrain_lm.data.sources import no_autograph

# Keeps the shuffle seeds independent of the per-row seeds.
_SHUFFLE_SALT = 0x5EED
_AUTOTUNE = tf.data.AUTOTUNE


def train_dataset(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  start_batch: int = 0,
  process_index: int = 0,
  process_count: int = 1,
) -> tf.data.Dataset:
  """This host's endless stream of training batches, from `start_batch` on.

  Args:
    config: the full run config (uses `data` and `objective`).
    tokenizer: the run's tokenizer.
    objective: the objective's transform (objectives.row_transform).
    start_batch: the number of batches already consumed (the train step to
      resume at); the stream equals a fresh one with that many batches
      skipped.
    process_index: this host's index.
    process_count: the number of hosts.

  Returns:
    A dataset of dicts of fixed-shape tensors, each with a leading
    per-host batch dimension of data.batch_size // process_count.
  """
  batch = rows.per_host_batch(config.data, process_count)
  if prepared.is_prepared(config.data.source):
    return prepared_input.prepared_dataset(
      config,
      tokenizer,
      objective,
      split='train',
      start_batch=start_batch,
      process_index=process_index,
      process_count=process_count,
    )
  packed = rows.packed_rows(
    config,
    tokenizer,
    objective,
    split='train',
    process_index=process_index,
    process_count=process_count,
  )
  _check_one_batch(packed, batch, config.data, objective)
  start_epoch, skip = _resume_position(packed, start_batch * batch)
  stream = tf.data.Dataset.counter(start_epoch).flat_map(
    no_autograph(lambda epoch: _epoch(packed, config.data, epoch))
  )
  stream = stream.skip(skip)
  if objective.partnered:
    stream = _with_partners(stream, batch, config)
  stream = stream.map(
    no_autograph(_transform(config, tokenizer, objective)),
    num_parallel_calls=_AUTOTUNE,
    deterministic=True,
  )
  stream = stream.batch(batch, drop_remainder=True).prefetch(_AUTOTUNE)
  return stream.with_options(rows.deterministic_options())


def _check_one_batch(packed, batch: int, data_config, objective) -> None:
  """An epoch must give this host at least one full batch of rows."""
  # Every epoch has the same rows (only their order differs), so checking
  # the first batch's worth is enough, and cheap.
  if rows.count(packed.take(batch)) < batch:
    raise ValueError(
      f'data.source={data_config.source!r} gives fewer than {batch} rows '
      f'of {objective.row_length} tokens (data.seq_len={data_config.seq_len}) '
      'per epoch on this host, not one full batch: use more text or a '
      'smaller data.batch_size.'
    )


def _resume_position(packed, skip: int) -> tuple[int, int]:
  """The first `skip` rows of the stream as (whole epochs, rows after).

  Whole epochs are skipped arithmetically (counting one epoch's rows), then
  rows within the epoch. Rows are skipped before the objective's transform,
  so that no skipped row is masked.
  """
  if skip:
    epoch_rows = rows.count(packed.take(skip + 1))
    if epoch_rows <= skip:  # the whole epoch, counted
      return divmod(skip, epoch_rows)
  return 0, skip


def _epoch(packed: tf.data.Dataset, data_config, epoch) -> tf.data.Dataset:
  """`packed` shuffled for `epoch`, as (epoch, index in epoch, row)."""
  epoch = tf.cast(epoch, tf.int64)
  shuffle_seed = tf.random.stateless_uniform(
    [],
    seed=tf.stack([tf.constant(data_config.seed, tf.int64), epoch]),
    minval=None,
    maxval=None,
    dtype=tf.int64,
  )
  shuffle_seed = tf.bitwise.bitwise_xor(shuffle_seed, _SHUFFLE_SALT)
  packed = packed.shuffle(
    data_config.shuffle_buffer,
    seed=shuffle_seed,
    reshuffle_each_iteration=False,
  )
  return packed.enumerate().map(no_autograph(lambda i, row: (epoch, i, row)))


def _with_partners(stream, batch: int, config) -> tf.data.Dataset:
  """(epoch, index, row) -> (epoch, index, row, partner row)."""
  if batch < 2:
    raise ValueError(
      f'objective.sentence_task={config.objective.sentence_task!r} pairs '
      'rows within a host batch and needs at least 2 rows per host; '
      f'data.batch_size={config.data.batch_size} gives {batch}.'
    )
  # Each row's partner is the row before it in its batch (the first's
  # the last): a random other row of the shuffled epoch, at no extra
  # tokenizing. Resumes start at a batch boundary, so pairs replay.
  stream = stream.batch(batch, drop_remainder=True).map(
    no_autograph(
      lambda epoch, index, batch_rows: (
        epoch,
        index,
        batch_rows,
        {k: tf.roll(v, 1, axis=0) for k, v in batch_rows.items()},
      )
    )
  )
  return stream.unbatch()


def _transform(config, tokenizer, objective):
  """(epoch, index, row[, partner]) -> the objective's features."""
  partnered = objective.partnered

  def transform(epoch, index, row, partner=None):
    seed = rows.row_seed(config.data.seed, epoch, index)
    kwargs = {'partner': partner} if partnered else {}
    return objective.fn(
      row, seed, config=config.objective, tokenizer=tokenizer, **kwargs
    )

  return transform


def train_iterator(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  start_batch: int = 0,
  process_index: int = 0,
  process_count: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
  """train_dataset as an iterator of numpy dicts."""
  return train_dataset(
    config,
    tokenizer,
    objective,
    start_batch=start_batch,
    process_index=process_index,
    process_count=process_count,
  ).as_numpy_iterator()
