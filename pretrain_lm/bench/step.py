"""Train-step throughput: step time, tokens/s, model FLOPs and MFU.

The step is the one `python -m pretrain_lm.main` runs (Trainer's jitted,
donated train_step) on a real batch of the config's pipeline, timed alone:
the input pipeline is measured separately (`--what=pipeline`).
"""

from typing import Any

import jax
import ml_collections
import numpy as np

from pretrain_lm import metrics, sharding, train, validate
from pretrain_lm.bench import timing
from pretrain_lm.data import pipeline


def prepare(config: ml_collections.ConfigDict) -> None:
  """Checks `config` for a train step and pins data.seq_len to the first
  stage of its schedule (BERT: 128 of 512). Raises ValueError."""
  validate.check_fields(config)
  validate.check_devices(config)
  seq_len = pipeline.seq_len_stages(config)[0][2]
  if seq_len != config.data.seq_len or config.data.seq_len_schedule:
    config.data.seq_len = seq_len
    config.data.seq_len_schedule = ''
  validate.check_config(config)


def peak_flops(config: ml_collections.ConfigDict) -> tuple[float | None, str]:
  """The FLOP/s MFU divides by, over all devices, and where it comes from:
  train.peak_flops_per_device if set ('configured'), else the device
  kind's datasheet figure (metrics.PEAK_FLOPS; none for a CPU)."""
  configured = config.train.peak_flops_per_device
  per_device = metrics.peak_flops_per_device(configured)
  if not per_device:
    return None, 'none (set --config.train.peak_flops_per_device)'
  source = 'configured' if configured else 'datasheet'
  return per_device * jax.device_count(), source


def tokens_per_row(shapes: dict[str, tuple]) -> int:
  """Tokens a row feeds the model: the encoder's and the decoder's."""
  return sum(
    int(np.prod(s[1:])) for k, s in shapes.items() if k.endswith('input_ids')
  )


def pad_fraction(batch: dict[str, np.ndarray]) -> float:
  """The fraction of [PAD] positions in a host batch (0 if unknown)."""
  for key in ('segment_ids', 'encoder_segment_ids'):
    if key in batch:
      return float(np.mean(batch[key] == 0))
  return 0.0


class TrainBench:
  """Our train step on one real batch of the config's pipeline, compiled.

  Time `run` (timing.time_in_turn), then read `figures()`.
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    trainer = train.Trainer(config, workdir)
    state = trainer.initial_state()
    self.host_batch = next(
      pipeline.train_dataset(
        config, trainer.tokenizer, trainer.row_transform
      ).as_numpy_iterator()
    )
    shapes = {k: v.shape for k, v in self.host_batch.items()}
    with trainer.context():
      batch = sharding.host_to_global(self.host_batch, trainer.mesh)
      self.run = timing.compile_run(trainer.train_step, state, batch)
    self.batch_size = config.data.batch_size
    self.seq_len = config.data.seq_len
    self.tokens = tokens_per_row(shapes) * self.batch_size
    self.flops = trainer.model.train_flops(trainer.model_config, shapes)
    self.microbatches = trainer.microbatches
    self.peak_flops, self.peak_source = peak_flops(config)
    self.prng_impl = config.train.prng_impl

  def figures(self) -> dict[str, Any]:
    """Step time, throughput, MFU, FLOPs and memory of the timed `run`."""
    out = {
      'batch_size': self.batch_size,
      'seq_len': self.seq_len,
      'tokens_per_step': self.tokens,
      'microbatches': self.microbatches,
      **timing.run_figures(self.run, self.tokens, self.flops, self.peak_flops),
      'peak_source': self.peak_source,
      'pad_fraction': pad_fraction(self.host_batch),
      # The dropout masks' PRNG (machine.describe's prng_impl is JAX's
      # default, the state's key).
      'train_prng_impl': self.prng_impl,
    }
    if self.microbatches > 1:
      # XLA's cost analysis counts a loop's body once, so a step scanning
      # its microbatches would read as 1/microbatches of its FLOPs.
      out['xla_flops_per_token'] = None
    return out
