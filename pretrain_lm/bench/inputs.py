"""Input pipeline throughput: raw text, cached token ids, prepared rows.

The pipeline is the training one (pipeline.train_dataset: read, tokenize,
pack, shuffle, the objective's on-the-fly masking, batch), drained as fast
as it goes with no model attached. 'Pre-tokenized' is the same pipeline
with data.cache_tokens on and its cache filled by a first full epoch, so
the timed batches pay for packing, shuffling and masking only.
"""

import os
import time
from typing import Any

import ml_collections
import numpy as np

from pretrain_lm import metrics as metrics_lib
from pretrain_lm import objectives
from pretrain_lm.data import pipeline, prepared
from pretrain_lm.data import tokenizer as tokenizer_lib


def cores() -> int:
  """The CPU cores this process may run on (what tf.data's threads share)."""
  return len(os.sched_getaffinity(0))


def drain(
  config, tokenizer, *, batches: int, skip: int, start_step: int = 0
) -> dict[str, float]:
  """Tokens/s of `batches` batches after `skip` untimed ones.

  first_batch_s: from building the stream at `start_step` (a resume there)
  to its first batch.
  """
  start = time.perf_counter()
  it = pipeline.train_dataset(
    config, tokenizer, objectives.row_transform(config), start_batch=start_step
  ).as_numpy_iterator()
  next(it)
  first_batch_s = time.perf_counter() - start
  for _ in range(skip):
    next(it)
  tokens = real = 0
  start = time.perf_counter()
  for _ in range(batches):
    batch = next(it)
    # Tokens the model reads: input_ids, or the encoder's and the decoder's;
    # segment id 0 marks [PAD].
    for key in (k for k in batch if k.endswith('input_ids')):
      tokens += batch[key].size
      segments = batch.get(key.replace('input_ids', 'segment_ids'))
      real += (
        batch[key].size if segments is None else np.count_nonzero(segments)
      )
  seconds = time.perf_counter() - start
  return {
    'first_batch_s': first_batch_s,
    'tokens_per_s': tokens / seconds,
    'tokens_per_s_per_core': tokens / seconds / cores(),
    'rows_per_s': batches * config.data.batch_size / seconds,
    'non_pad_fraction': real / tokens,
  }


def bench_pipeline(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  *,
  batches: int,
  model_flops_per_token: float,
  start_step: int = 0,
  cached: bool = True,
) -> dict[str, Any]:
  """The run's input stream from `start_step`, and the packing efficiency.

  first_batch_s and tokens_per_s are the stream the run reads (raw text or
  prepared rows). For raw text with `cached`, the cached_* figures are the
  same stream with data.cache_tokens on, timed after a first epoch fills
  the cache (so they pay for packing, shuffling and masking only).
  """
  # A few batches warm tf.data's autotuner and the tokenizer up.
  stream = drain(
    config, tokenizer, batches=batches, skip=2, start_step=start_step
  )
  out = {
    'cores': cores(),
    'batch_size': config.data.batch_size,
    'seq_len': config.data.seq_len,
    'start_step': start_step,
    **stream,
    'model_flops_per_token': model_flops_per_token,
    **_needed(model_flops_per_token),
  }
  if cached and not prepared.is_prepared(config.data.source):
    epoch_rows = pipeline.rows_per_epoch(
      config, tokenizer, objectives.row_transform(config)
    )
    epoch_batches = max(epoch_rows // config.data.batch_size, 1)
    cached_config = config.copy_and_resolve_references()
    cached_config.data.cache_tokens = True
    got = drain(
      cached_config, tokenizer, batches=batches, skip=epoch_batches + 1
    )
    out['epoch_batches'] = epoch_batches
    out['cached_tokens_per_s'] = got['tokens_per_s']
    out['cached_tokens_per_s_per_core'] = got['tokens_per_s_per_core']
  return out


def _needed(model_flops_per_token: float) -> dict[str, float]:
  """What one H100 eats at 50% MFU (datasheet peak), and per 8 host cores."""
  h100 = dict(metrics_lib.PEAK_FLOPS)['H100']
  eats = 0.5 * h100 / model_flops_per_token
  return {
    'h100_tokens_per_s_at_50pct_mfu': eats,
    'h100_tokens_per_s_per_8_cores_needed': eats / 8,
  }
