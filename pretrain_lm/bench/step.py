"""Train-step throughput: step time, tokens/s, model FLOPs and MFU.

The step is the one `python -m pretrain_lm.main` runs (Trainer's jitted,
donated train_step) on a real batch of the config's pipeline, timed alone:
the input pipeline is measured separately (`--what=pipeline`).
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from pretrain_lm import sharding, train
from pretrain_lm.data import pipeline


def first_stage(config: ml_collections.ConfigDict) -> None:
  """Pins data.seq_len to the schedule's first stage (BERT: 128 of 512)."""
  seq_len = pipeline.seq_len_stages(config)[0][2]
  if seq_len != config.data.seq_len or config.data.seq_len_schedule:
    config.data.seq_len = seq_len
    config.data.seq_len_schedule = ''


def time_steps(
  step: Callable, state: Any, batch: Any, *, steps: int, warmup: int
) -> tuple[Any, Any, list[float]]:
  """Runs warmup + steps calls of `step(state, batch)`, timing the last.

  Returns the final state, the last metrics and the timed steps' seconds.

  Each call is waited for, so each time is one step's; dispatch overhead,
  which the training loop hides by running a step ahead, is included.
  """
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return state, metrics, times


def tokens_per_row(shapes: dict[str, tuple]) -> int:
  """Tokens a row feeds the model: the encoder's and the decoder's."""
  return sum(
    int(np.prod(s[1:])) for k, s in shapes.items() if k.endswith('input_ids')
  )


def xla_flops(compiled: jax.stages.Compiled) -> float:
  """XLA's own count of the compiled program's FLOPs (cost analysis)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, list | tuple):  # one entry per program in old jax
    cost = cost[0]
  return float(cost.get('flops', 0.0)) if cost else 0.0


def peak_memory_gib(compiled: jax.stages.Compiled) -> float:
  """Device memory the step needs per device: state, batch and temporaries
  (donated buffers, both argument and output, counted once)."""
  m = compiled.memory_analysis()
  if m is None:  # not every backend reports it
    return 0.0
  total = (
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
    + m.temp_size_in_bytes
  )
  return total / 2**30


def pad_fraction(batch: dict[str, np.ndarray]) -> float:
  """The fraction of [PAD] positions in a host batch (0 if unknown)."""
  for key in ('segment_ids', 'encoder_segment_ids'):
    if key in batch:
      return float(np.mean(batch[key] == 0))
  return 0.0


def bench_train(
  config: ml_collections.ConfigDict, workdir: str, *, steps: int, warmup: int
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Times `config`'s train step; returns (figures, the host batch used)."""
  trainer = train.Trainer(config, workdir)
  state = trainer.initial_state()
  host_batch = next(
    pipeline.train_dataset(config, trainer.tokenizer).as_numpy_iterator()
  )
  shapes = {k: v.shape for k, v in host_batch.items()}
  with trainer.context():
    batch = sharding.host_to_global(host_batch, trainer.mesh)
    start = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    state, metrics, times = time_steps(
      compiled, state, batch, steps=steps, warmup=warmup
    )
  if int(metrics['skipped_total']):
    raise RuntimeError(
      f'{int(metrics["skipped_total"])} of the timed steps had a '
      'non-finite loss or gradient: the figures would not be real steps.'
    )
  tokens = tokens_per_row(shapes) * config.data.batch_size
  flops = trainer.model.train_flops(trainer.model_config, shapes)
  result = {
    'batch_size': config.data.batch_size,
    'seq_len': config.data.seq_len,
    'tokens_per_step': tokens,
    'compile_s': compile_s,
    **step_figures(times, tokens, flops),
    'xla_flops_per_token': xla_flops(compiled) / tokens,
    'memory_gib': peak_memory_gib(compiled),
    'pad_fraction': pad_fraction(host_batch),
    'loss': float(metrics['loss']),
  }
  return result, host_batch


def step_figures(
  times: list[float], tokens: int, flops: float
) -> dict[str, float]:
  """Median step time and what follows from it."""
  step_s = statistics.median(times)
  return {
    'step_s': step_s,
    'step_s_min': min(times),
    'steps_timed': len(times),
    'tokens_per_s': tokens / step_s,
    'model_flops_per_token': flops / tokens,
    'achieved_tflops': flops / step_s / 1e12,
  }
