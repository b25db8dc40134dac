"""Step timing and the figures that follow from it; jax only.

The GPU scripts in experiments/benchmarks/gpu/ import this on machines
without our input stack, so nothing here may import TensorFlow or
ml_collections.
"""

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


@dataclasses.dataclass
class Run:
  """A compiled step with its state and batch, and what timing it gave."""

  step: Callable
  state: Any
  batch: Any
  compile_s: float
  metrics: Any = None
  times: list[float] = dataclasses.field(default_factory=list)


def compile_run(jitted: Any, state: Any, batch: Any) -> Run:
  """Compiles `jitted` for (state, batch), timing the compile."""
  start = time.perf_counter()
  compiled = jitted.lower(state, batch).compile()
  return Run(compiled, state, batch, time.perf_counter() - start)


def time_in_turn(runs: Sequence[Run], *, steps: int, warmup: int) -> None:
  """Runs warmup + steps rounds of one step of each run, timing the last.

  Every other round goes in reverse order. On a machine whose speed drifts
  (one shared with other jobs), timing one run after the other credits
  the drift to one of them; alternating, it slows each alike and their
  ratio holds.

  Each call is waited for, so each time is one step's; dispatch overhead,
  which the training loop hides by running a step ahead, is included.
  Updates each run's state, metrics (the last step's) and times. Steps
  whose metrics count a skipped (non-finite) update are not real steps:
  they raise.
  """
  for i in range(warmup + steps):
    for run in runs if i % 2 == 0 else runs[::-1]:
      start = time.perf_counter()
      run.state, run.metrics = run.step(run.state, run.batch)
      jax.block_until_ready((run.state, run.metrics))
      if i >= warmup:
        run.times.append(time.perf_counter() - start)
  for run in runs:
    skipped = int(run.metrics.get('skipped_total', 0))
    if skipped:
      raise RuntimeError(
        f'{skipped} of the timed steps had a non-finite loss or gradient: '
        'the figures would not be real steps.'
      )


def time_pipelined(run: Run, *, steps: int) -> float:
  """Mean step time over `steps` steps dispatched back to back, waited for
  at the end only: as the training loop runs them (it fetches each step's
  metrics a step late), so one step's dispatch overlaps the last's work.
  Updates the run's state and metrics."""
  jax.block_until_ready(run.state)
  start = time.perf_counter()
  for _ in range(steps):
    run.state, run.metrics = run.step(run.state, run.batch)
  jax.block_until_ready((run.state, run.metrics))
  return (time.perf_counter() - start) / steps


def call_seconds(
  fn: Callable[..., object], *args, repeats: int, warmup: int = 1
) -> list[float]:
  """Wall times of `repeats` calls of `fn(*args)`, each waited for, after
  `warmup` untimed ones (the first compiles a jitted function)."""
  times = []
  for i in range(warmup + repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return times


def step_figures(
  times: list[float], tokens: int, flops: float, peak_flops: float | None
) -> dict[str, float]:
  """Median step time and what follows from it.

  MFU is the model FLOPs a second the step achieves over `peak_flops`
  (FLOP/s of all the devices the step runs on); left out without a peak.
  """
  step_s = statistics.median(times)
  out = {
    'step_s': step_s,
    'step_s_min': min(times),
    'steps_timed': len(times),
    'tokens_per_s': tokens / step_s,
    'model_flops_per_token': flops / tokens,
    'achieved_tflops': flops / step_s / 1e12,
  }
  if peak_flops:
    out['peak_tflops'] = peak_flops / 1e12
    out['mfu'] = flops / step_s / peak_flops
  return out


def run_figures(
  run: Run, tokens: int, flops: float, peak_flops: float | None
) -> dict[str, float]:
  """A timed run's compile and step times, throughput, MFU, XLA's FLOP
  count, memory and last loss."""
  return {
    'compile_s': run.compile_s,
    **step_figures(run.times, tokens, flops, peak_flops),
    'xla_flops_per_token': xla_flops(run.step) / tokens,
    'memory_gib': peak_memory_gib(run.step),
    'loss': float(run.metrics['loss']),
  }


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
