r"""The best matmul FLOP/s on this machine: a CPU's peak for MFU.

  python experiments/benchmarks/matmul_peak.py [--dtype=float32]
      [--sizes=1024,2048,4096] [--xla_only]

A CPU has no datasheet figure we can trust (clocks, vector width and core
sharing vary), so its peak is measured: the fastest of --repeats calls of
a jitted n x n matmul under XLA, for each n in --sizes (1024-4096 spans
the shapes of base-size layers). NumPy's BLAS and PyTorch (when installed)
are timed too, to show how far XLA's own matmul is from the best any
library reaches. Prints a line per library and one JSON line; the XLA
figure, in FLOP/s, is the peak to give the bench:

  python -m pretrain_lm.bench --config=... \
      --config.train.peak_flops_per_device=<xla_matmul_flops>

On a GPU (jax only, as in gpu/run_device.sh) --xla_only times XLA's
matmul against the datasheet figure the bench uses there.
"""

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def best_seconds(fn: Callable, *args, repeats: int) -> float:
  """The fastest of `repeats` waited calls of fn(*args), after one untimed
  call (which compiles a jitted function)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times)


def best_flops(operands: Callable[[int], tuple], matmul, sizes, repeats):
  """The best FLOP/s of `matmul(*operands(n))` over the n x n sizes. The
  fastest call counts: a higher peak only makes an MFU more conservative."""
  return max(
    2 * n**3 / best_seconds(matmul, *operands(n), repeats=repeats)
    for n in sizes
  )


def xla_flops(dtype: str, sizes, repeats: int) -> float:
  """XLA's jitted matmul on the default device. bfloat16 operands
  accumulate in float32, as a bfloat16 model's products do."""

  def operands(n):  # random: constant ones could let XLA skip work
    return tuple(jax.random.normal(jax.random.key(n), (2, n, n), dtype))

  kw = {} if dtype == 'float32' else {'preferred_element_type': jnp.float32}
  matmul = jax.jit(functools.partial(jnp.matmul, **kw))
  return best_flops(operands, matmul, sizes, repeats)


def numpy_flops(dtype: str, sizes, repeats: int) -> float:
  """NumPy's BLAS matmul (float32 only: NumPy has no bfloat16)."""
  if dtype != 'float32':
    return 0.0
  rng = np.random.default_rng(0)
  return best_flops(
    lambda n: rng.standard_normal((2, n, n), np.float32),
    np.matmul,
    sizes,
    repeats,
  )


def torch_flops(dtype: str, sizes, repeats: int) -> float:
  """PyTorch's CPU matmul, or 0 if torch is missing."""
  try:
    import torch  # noqa: PLC0415 (optional; installed by the test extra)
  except ImportError:
    return 0.0
  return best_flops(
    lambda n: torch.randn((2, n, n)).to(getattr(torch, dtype)),
    torch.matmul,
    sizes,
    repeats,
  )


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--sizes', default='1024,2048,4096')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--xla_only', action='store_true')
  args = parser.parse_args(argv)
  sizes = [int(n) for n in args.sizes.split(',')]
  libraries = {'xla': xla_flops}
  if not args.xla_only:
    libraries.update(numpy=numpy_flops, torch=torch_flops)
  result = {
    'what': 'matmul_peak',
    'device_kind': jax.devices()[0].device_kind,
    'dtype': args.dtype,
    'sizes': sizes,
  }
  for name, flops in libraries.items():
    result[f'{name}_matmul_flops'] = flops(args.dtype, sizes, args.repeats)
    print(f'{name:6s} {result[f"{name}_matmul_flops"] / 1e12:.3f} TFLOP/s')
  print(json.dumps(result))


if __name__ == '__main__':
  main(sys.argv[1:])
