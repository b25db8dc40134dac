"""Step timing shared by the bench, its peer and run_exported: jax only.

run_exported imports this on machines without our input stack, so nothing
here may import TensorFlow or ml_collections.
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


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


def compile_and_time(
  jitted: Any, state: Any, batch: Any, *, steps: int, warmup: int
) -> tuple[jax.stages.Compiled, float, Any, list[float]]:
  """Compiles `jitted` for (state, batch), then times it as time_steps does.

  Returns the compiled step, the compile seconds, the last metrics and the
  timed steps' seconds. Steps whose metrics count a skipped (non-finite)
  update are not real steps: they raise.
  """
  start = time.perf_counter()
  compiled = jitted.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  _, metrics, times = time_steps(
    compiled, state, batch, steps=steps, warmup=warmup
  )
  skipped = int(metrics.get('skipped_total', 0))
  if skipped:
    raise RuntimeError(
      f'{skipped} of the timed steps had a non-finite loss or gradient: '
      'the figures would not be real steps.'
    )
  return compiled, compile_s, metrics, times


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
