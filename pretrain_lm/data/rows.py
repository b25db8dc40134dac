"""A host's packed rows of a raw-text split, and what streams of them share.

The objective's part of the pipeline (RowTransform), the per-row stateless
seeds, the host's share of a batch and the deterministic tf.data options:
the training stream (train_stream.py) and the eval batches (eval_stream.py)
are both built from these.
"""

import dataclasses
from collections.abc import Callable

import ml_collections
import tensorflow as tf

from pretrain_lm.data import packing, sources
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.data.sources import no_autograph

# Keeps the per-row seeds independent of the shuffle seeds.
_ROW_SALT = 0xA5C


@dataclasses.dataclass(frozen=True)
class RowTransform:
  """The objective's part of the pipeline, resolved by the caller.

  `objectives.row_transform(config)` builds it from config.objective.name,
  so the data layer never looks objectives up itself.
  """

  # (row, seed, *, config, tokenizer[, partner]) -> features: the
  # objective's tf.data map (see pretrain_lm.objectives).
  fn: Callable[..., dict[str, tf.Tensor]]
  # The packed row length: data.seq_len unless the objective says (a
  # causal LM packs data.seq_len + 1 tokens and shifts them).
  row_length: int
  # Whether `fn` takes `partner=`, another packed row of the same epoch.
  partnered: bool = False
  # Ids the objective needs after the tokenizer's vocabulary (prepare.py
  # trains the tokenizer with that many fewer).
  reserved_ids: int = 0


def packed_rows(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  split: str,
  process_index: int,
  process_count: int,
) -> tf.data.Dataset:
  """One epoch of this host's packed rows of `split`, unshuffled."""
  docs = sources.documents(
    config.data,
    split=split,
    process_index=process_index,
    process_count=process_count,
  )
  tokens = packing.tokenize(docs, tokenizer)
  if config.data.cache_tokens:
    tokens = tokens.cache()
  return packing.pack(
    tokens,
    row_len=objective.row_length,
    packing=config.data.packing,
    cls_id=tokenizer.cls_id,
    sep_id=tokenizer.sep_id,
    pad_id=tokenizer.pad_id,
  )


def rows_per_epoch(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  process_index: int = 0,
  process_count: int = 1,
) -> int:
  """How many packed training rows one epoch gives this host (reads it all)."""
  rows = packed_rows(
    config,
    tokenizer,
    objective,
    split='train',
    process_index=process_index,
    process_count=process_count,
  )
  return count(rows)


def row_seed(data_seed: int, epoch, index) -> tf.Tensor:
  """The stateless seed (shape [2]) of row `index` of `epoch`."""
  seed = tf.constant([data_seed, _ROW_SALT], tf.int64)
  seed = tf.random.experimental.stateless_fold_in(seed, epoch)
  return tf.random.experimental.stateless_fold_in(seed, index)


def per_host_batch(data_config, process_count: int) -> int:
  """data.batch_size // process_count; an error unless it divides."""
  if data_config.batch_size % process_count:
    raise ValueError(
      f'data.batch_size={data_config.batch_size} is not divisible by the '
      f'{process_count} processes.'
    )
  return data_config.batch_size // process_count


def count(ds: tf.data.Dataset) -> int:
  """The number of elements of `ds` (reads it all)."""
  one_more = no_autograph(lambda n, _: n + 1)
  return int(ds.reduce(tf.constant(0, tf.int64), one_more))


def deterministic_options() -> tf.data.Options:
  """tf.data options for a stream whose order restarts replay."""
  options = tf.data.Options()
  # Order must never depend on thread timing: restarts replay the stream.
  options.deterministic = True
  return options
