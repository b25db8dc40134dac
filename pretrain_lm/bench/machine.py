"""What a benchmark's figures were measured on: backend, devices, CPU, jax."""

import datetime
import os
import platform
import re

import jax


def cpu_model() -> dict[str, str]:
  """The CPU's model name, family and widest vector extension (/proc/cpuinfo).

  CPU figures depend on them: XLA's float32 matmul runs several times
  faster with AVX-512 than with AVX2 alone, and a model name such as "AMD
  EPYC" does not tell AMD's generations apart where the family does (26
  is Zen 5). `amx_bf16` (Intel's bf16 matrix tiles) is named first where
  the CPU exposes it: bf16 products run on them.
  """
  try:
    with open('/proc/cpuinfo') as f:
      info = f.read()
  except OSError:  # not Linux
    return {}

  def field(key):
    found = re.search(rf'^{key}\s*:\s*(.*)$', info, re.MULTILINE)
    return found.group(1).strip() if found else ''

  flags = set(field('flags').split())
  widest = ('amx_bf16', 'avx512_bf16', 'avx512f', 'avx2', 'avx')
  return {
    'cpu_model': field('model name'),
    'cpu_family': f'{field("cpu family")}/{field("model")}'.strip('/'),
    'cpu_simd': next((x for x in widest if x in flags), 'none'),
  }


def describe() -> dict[str, str | int]:
  """What the figures were measured on."""
  return {
    'backend': jax.default_backend(),
    'device_kind': jax.devices()[0].device_kind,
    'devices': jax.device_count(),
    'cpu': platform.processor() or platform.machine(),
    **cpu_model(),
    'cpu_cores': len(os.sched_getaffinity(0)),
    'jax': jax.__version__,
    # JAX's default PRNG (JAX_DEFAULT_PRNG_IMPL), the state's key; a train
    # run's dropout masks follow train.prng_impl (its train_prng_impl).
    'prng_impl': jax.config.jax_default_prng_impl,
    'date': datetime.date.today().isoformat(),
  }
