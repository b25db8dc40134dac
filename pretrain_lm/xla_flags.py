"""XLA options that GPU steps run faster with, added to XLA_FLAGS.

  from pretrain_lm import xla_flags
  xla_flags.apply_gpu_defaults()  # first thing: before JAX starts a backend

XLA reads XLA_FLAGS once, when JAX creates its first backend, so the
command-line entry points (pretraining, fine-tuning, the benchmarks) call
this before anything touches a device. It adds each of GPU_DEFAULTS that
XLA_FLAGS does not already name, and only where JAX has a CUDA plugin to
load: a CPU or TPU run sees no change. Set a flag in XLA_FLAGS yourself to
override its default (`XLA_FLAGS=--xla_gpu_enable_triton_gemm=true`).
Standard library only: experiments/benchmarks/gpu/run_exported.py imports
it on machines with JAX alone.
"""

import importlib.util
import os
import re
from collections.abc import MutableMapping

# name -> value, each measured (experiments/benchmarks/README.md, Train
# step: GPU).
GPU_DEFAULTS = {
  # XLA's matmul fusions through cuBLAS rather than Triton: Triton ran
  # GPT-2 small's vocabulary projection as three kernels well below
  # cuBLAS's rate, and BERT-base's step is shorter with cuBLAS too.
  'xla_gpu_enable_triton_gemm': 'false',
}

CUDA_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin')


def cuda_plugin_installed() -> bool:
  """Whether JAX can load a CUDA backend here (without starting one)."""
  return any(importlib.util.find_spec(name) for name in CUDA_PLUGINS)


def apply_gpu_defaults(
  environ: MutableMapping[str, str] = os.environ, gpu: bool | None = None
) -> list[str]:
  """Adds the GPU_DEFAULTS that XLA_FLAGS lacks; returns those added.

  `gpu` (default: whether a CUDA plugin is installed) says whether to.
  """
  if not (cuda_plugin_installed() if gpu is None else gpu):
    return []
  current = environ.get('XLA_FLAGS', '')
  named = set(re.findall(r'--([\w]+)', current))
  added = [
    f'--{name}={value}'
    for name, value in GPU_DEFAULTS.items()
    if name not in named
  ]
  if added:
    environ['XLA_FLAGS'] = ' '.join([current, *added]).strip()
  return added
