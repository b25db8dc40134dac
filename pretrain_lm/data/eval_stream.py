"""The evaluation batches: the eval split unshuffled, with fixed masks."""

import ml_collections
import numpy as np
import tensorflow as tf

from pretrain_lm.data import prepared_input, rows, sources
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.data.rows import RowTransform
from pretrain_lm.data.sources import no_autograph

# Keeps the eval partners' shuffle seed apart from data.seed's other uses.
_PARTNER_SALT = 0x9A1
_AUTOTUNE = tf.data.AUTOTUNE


def eval_batches(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  process_index: int = 0,
  process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
  """The data.eval_batches evaluation batches: unshuffled, fixed masks."""
  data_config = config.data
  batch = rows.per_host_batch(data_config, process_count)
  if prepared_input.eval_is_prepared(data_config):
    return prepared_input.prepared_eval(
      config, tokenizer, objective, process_index, process_count
    )
  packed = rows.packed_rows(
    config,
    tokenizer,
    objective,
    split='eval',
    process_index=process_index,
    process_count=process_count,
  )

  partnered = objective.partnered

  def transform(index, row, partner=None):
    seed = rows.row_seed(data_config.seed, 0, index)
    kwargs = {'partner': partner} if partnered else {}
    return objective.fn(
      row, seed, config=config.objective, tokenizer=tokenizer, **kwargs
    )

  ds = packed.enumerate()
  if partnered:
    # Eval rows are in document order, so a neighbour would be the same
    # document: partners come from a fixed shuffle of the split instead.
    partners = packed.shuffle(
      data_config.shuffle_buffer,
      seed=data_config.seed ^ _PARTNER_SALT,
      reshuffle_each_iteration=False,
    )
    ds = tf.data.Dataset.zip(ds, partners).map(
      no_autograph(lambda indexed, partner: (*indexed, partner))
    )
  ds = ds.map(
    no_autograph(transform), num_parallel_calls=_AUTOTUNE, deterministic=True
  )
  ds = ds.batch(batch, drop_remainder=True).take(data_config.eval_batches)
  batches = list(
    ds.with_options(rows.deterministic_options()).as_numpy_iterator()
  )
  if len(batches) < data_config.eval_batches:
    # Every host must run the same number of eval steps, so a short eval
    # split is an error rather than fewer batches.
    source = sources.eval_source(data_config) or data_config.source
    raise ValueError(
      f'The eval split ({source!r}) gives {len(batches)} batches of '
      f'{batch} rows on this host, fewer than data.eval_batches='
      f'{data_config.eval_batches}: lower data.eval_batches or use more '
      'eval text.'
    )
  return batches
