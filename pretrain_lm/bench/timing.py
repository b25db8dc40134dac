"""Step timing shared by the bench, its peer and run_exported: jax only.

run_exported imports this on machines without our input stack, so nothing
here may import TensorFlow or ml_collections.
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


def time_in_turn(
  runs: Sequence[Run],
  *,
  steps: int,
  warmup: int,
  each_round: Callable[[], object] | None = None,
) -> None:
  """Runs warmup + steps rounds of one step of each run, timing the last.

  Every other round goes in reverse order. On a machine whose speed drifts
  (one shared with other jobs), timing one run after the other credits
  the drift to one of them; alternating, it slows each alike and their
  ratio holds.

  Each call is waited for, so each time is one step's; dispatch overhead,
  which the training loop hides by running a step ahead, is included.
  Updates each run's state, metrics (the last step's) and times. Steps
  whose metrics count a skipped (non-finite) update are not real steps:
  they raise. `each_round`, if given, is called after every round, warm-up
  ones included (the bench times its CPU matmul probe there).
  """
  for i in range(warmup + steps):
    for run in runs if i % 2 == 0 else runs[::-1]:
      start = time.perf_counter()
      run.state, run.metrics = run.step(run.state, run.batch)
      jax.block_until_ready((run.state, run.metrics))
      if i >= warmup:
        run.times.append(time.perf_counter() - start)
    if each_round is not None:
      each_round()
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


def run_figures(run: Run, tokens: int, flops: float) -> dict[str, float]:
  """A timed run's compile and step times, throughput, XLA's FLOP count,
  memory and last loss: what the bench, its peer and run_exported report."""
  return {
    'compile_s': run.compile_s,
    **step_figures(run.times, tokens, flops),
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
