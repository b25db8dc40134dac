"""Step timing shared by the bench and run_exported: jax and numpy only.

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
