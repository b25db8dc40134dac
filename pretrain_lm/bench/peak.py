"""The peak FLOP/s that MFU divides by.

Accelerators: the vendor's dense bf16 datasheet figure (metrics.PEAK_FLOPS).
CPUs have no datasheet figure we can trust (clocks, vector width and core
sharing vary), so there the peak is measured in the same process: the best
FLOP/s of large square matmuls under XLA. NumPy's BLAS and PyTorch (when
installed) are timed too, to show how far XLA's own matmul is from the
best any library reaches on the machine.
"""

import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pretrain_lm import metrics as metrics_lib

# Square matmul sizes tried; the best is the peak. 1024-4096 spans the
# shapes of base-size layers (D = 768, F = 3072, B x L = 1024 rows).
SIZES = (1024, 2048, 4096)
REPEATS = 5


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


def best_matmul_flops(
  operands: Callable[[int], tuple], matmul: Callable, sizes, repeats
) -> float:
  """The best FLOP/s of `matmul(*operands(n))` over the n x n sizes.

  The fastest call counts: a peak is what the hardware can do, and a
  higher peak only makes the MFU it divides more conservative.
  """
  best = 0.0
  for n in sizes:
    s = min(call_seconds(matmul, *operands(n), repeats=repeats))
    best = max(best, 2 * n**3 / s)
  return best


def matmul_operands(dtype: str, n: int) -> tuple[jax.Array, jax.Array]:
  """Two random n x n matrices (constant ones could let XLA skip work)."""
  a, b = jax.random.normal(jax.random.key(n), (2, n, n), dtype)
  return a, b


def compiled_matmul(a: jax.Array, b: jax.Array, compiler_options=None):
  """XLA's a @ b, compiled for these shapes with `compiler_options`
  (XLA's defaults when None). bfloat16 operands accumulate in float32, as
  a bfloat16 model's products do (layers.matmul_f32_acc): on the CPU XLA
  runs that form in bfloat16, and a bfloat16 result upcast, several times
  slower."""
  matmul = jnp.matmul
  if a.dtype != jnp.float32:
    matmul = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)
  return jax.jit(matmul).lower(a, b).compile(compiler_options)


def xla_matmul_flops(
  dtype: str, sizes=SIZES, repeats=REPEATS, compiler_options=None
) -> float:
  """The best FLOP/s of a jitted n x n matmul on the default device,
  compiled with `compiler_options` (XLA's defaults when None)."""
  compiled = {}

  def matmul(a, b):
    if a.shape not in compiled:  # the untimed warm-up call compiles
      compiled[a.shape] = compiled_matmul(a, b, compiler_options)
    return compiled[a.shape](a, b)

  return best_matmul_flops(
    lambda n: matmul_operands(dtype, n), matmul, sizes, repeats
  )


class InTurnMatmul:
  """XLA's n x n matmul, timed once a round between the steps.

  A shared machine's speed drifts within a run and from one run to the
  next (experiments/benchmarks/README.md, Method), so a peak timed once,
  before the steps, can credit the drift to the step. Called after each
  round of timing.time_in_turn, this times `calls` matmuls (the fastest
  counts) at the conditions of that round's steps, with XLA's defaults
  and, if given, the step's compiler options (the faster counts, as in
  `peaks`).
  `flops` holds each round's FLOP/s.
  """

  def __init__(self, dtype: str, n: int, compiler_options=None, calls: int = 3):
    self._operands = matmul_operands(dtype, n)
    variants = [None] + ([compiler_options] if compiler_options else [])
    self._matmuls = [
      compiled_matmul(*self._operands, options) for options in variants
    ]
    self._work, self._calls = 2 * n**3, calls
    self.flops: list[float] = []

  def __call__(self) -> None:
    seconds = min(
      min(call_seconds(matmul, *self._operands, repeats=self._calls))
      for matmul in self._matmuls
    )
    self.flops.append(self._work / seconds)


def in_turn_figures(
  step_times: list[float], probe_flops: list[float], step_flops: float
) -> dict[str, float]:
  """The step's MFU against the matmul timed beside it, round by round.

  Round i's ratio is the step's FLOP/s in that round (`step_flops` over
  `step_times[i]`) over the matmul's FLOP/s right after it (the last
  len(step_times) of `probe_flops`: warm-up rounds are dropped);
  `mfu_in_turn` is their median, so a machine that slows down or speeds
  up during the run moves both sides alike.
  """
  if not step_times or len(probe_flops) < len(step_times):
    raise ValueError(
      f'{len(probe_flops)} matmul timings for {len(step_times)} timed '
      'steps: the matmul must be timed after every round.'
    )
  rounds = probe_flops[-len(step_times) :]
  ratios = [step_flops / t / f for t, f in zip(step_times, rounds, strict=True)]
  return {
    'xla_matmul_tflops_in_turn': statistics.median(rounds) / 1e12,
    'mfu_in_turn': statistics.median(ratios),
  }


def in_turn_size(sizes) -> int:
  """The probe's n: the middle of the survey's sizes (2048 by default),
  large enough to run at the peak, small enough to cost little a round."""
  return sorted(sizes)[len(sizes) // 2]


def numpy_matmul_flops(dtype: str, sizes=SIZES, repeats=REPEATS) -> float:
  """The best FLOP/s of NumPy's BLAS matmul (float32; NumPy has no bf16)."""
  if dtype != 'float32':
    return 0.0
  rng = np.random.default_rng(0)
  return best_matmul_flops(
    lambda n: rng.standard_normal((2, n, n), np.float32),
    np.matmul,
    sizes,
    repeats,
  )


def torch_matmul_flops(dtype: str, sizes=SIZES, repeats=REPEATS) -> float:
  """The best FLOP/s of PyTorch's CPU matmul, or 0 if torch is missing."""
  try:
    import torch  # noqa: PLC0415 (optional; installed by the test extra)
  except ImportError:
    return 0.0
  torch_dtype = getattr(torch, dtype)
  return best_matmul_flops(
    lambda n: torch.randn((2, n, n)).to(torch_dtype),
    torch.matmul,
    sizes,
    repeats,
  )


def peaks(
  dtype: str, sizes=SIZES, compiler_options=None
) -> dict[str, float | str]:
  """The peak for MFU (per process, all its devices) and the matmul survey.

  Returns peak_tflops with its source ('datasheet' or 'xla_matmul'), and
  on CPU the measured matmul TFLOP/s of XLA, NumPy and PyTorch (n x n
  matmuls for each n in `sizes`) and the best of them. With the step's
  `compiler_options` (train.compiler_options), XLA's matmul is timed with
  XLA's defaults and with those options, and the faster counts: a config
  that turns YNNPACK off must not lower the peak its MFU divides by.
  """
  datasheet = metrics_lib.peak_flops_per_device()
  if datasheet:
    return {
      'peak_tflops': datasheet * jax.local_device_count() / 1e12,
      'peak_source': 'datasheet',
    }
  # CPU: every local device shares the same cores, so the process's peak
  # is what one device's matmul reaches using all of them.
  xla = xla_matmul_flops(dtype, sizes)
  if compiler_options:
    with_options = xla_matmul_flops(
      dtype, sizes, compiler_options=compiler_options
    )
    xla = max(xla, with_options)
  measured = {
    'xla': xla,
    'numpy': numpy_matmul_flops(dtype, sizes),
    'torch': torch_matmul_flops(dtype, sizes),
  }
  best = max(measured, key=measured.get)
  out = {f'{k}_matmul_tflops': v / 1e12 for k, v in measured.items()}
  out.update(
    peak_tflops=measured['xla'] / 1e12,
    peak_source='xla_matmul',
    best_matmul_tflops=measured[best] / 1e12,
    best_matmul_library=best,
  )
  return out
