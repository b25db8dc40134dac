"""pretrain_lm.xla_flags: the GPU defaults added to XLA_FLAGS."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

from pretrain_lm import xla_flags


def test_adds_the_gpu_defaults_after_the_users_flags():
  env = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  added = xla_flags.apply_gpu_defaults(env, gpu=True)
  assert added == ['--xla_gpu_enable_triton_gemm=false']
  assert env['XLA_FLAGS'] == (
    '--xla_force_host_platform_device_count=8 '
    '--xla_gpu_enable_triton_gemm=false'
  )
  assert xla_flags.apply_gpu_defaults(env, gpu=True) == []  # once only
  empty = {}
  xla_flags.apply_gpu_defaults(empty, gpu=True)
  assert empty == {'XLA_FLAGS': '--xla_gpu_enable_triton_gemm=false'}


def test_a_flag_the_user_set_is_left_as_it_is():
  env = {'XLA_FLAGS': '--xla_gpu_enable_triton_gemm=true'}
  assert xla_flags.apply_gpu_defaults(env, gpu=True) == []
  assert env == {'XLA_FLAGS': '--xla_gpu_enable_triton_gemm=true'}


def test_nothing_changes_without_a_gpu():
  env = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  assert xla_flags.apply_gpu_defaults(env, gpu=False) == []
  assert env == {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  # By default the decision is whether JAX has a CUDA plugin to load.
  env = {}
  added = xla_flags.apply_gpu_defaults(env)
  assert bool(added) == xla_flags.cuda_plugin_installed()


def run_jax(xla_flags_value: str) -> subprocess.CompletedProcess:
  """A sum on the CPU in a fresh Python started with these XLA_FLAGS."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=xla_flags_value)
  return subprocess.run(
    [sys.executable, '-c', 'import jax; print(jax.numpy.ones(3).sum())'],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
  )


def test_xla_knows_every_default_flag():
  # XLA aborts on a flag it does not know: a misspelt default would stop
  # every GPU run at start-up. Its flags are the same on every backend.
  out = run_jax(
    ' '.join(
      f'--{name}={value}' for name, value in xla_flags.GPU_DEFAULTS.items()
    )
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == '3.0'
  # The check checks: a misspelt flag fails.
  assert run_jax('--xla_gpu_enable_triton_gem=false').returncode != 0


# Each entry point runs as `python -m` with apply_gpu_defaults replaced by a
# stand-in that sets XLA_FLAGS to a flag XLA does not know and asks for the
# devices. XLA reads XLA_FLAGS when JAX starts its first backend, and aborts
# on an unknown flag: if no backend had started yet, the run stops there.
_UNKNOWN_FLAG = 'xla_flag_read_when_the_backend_starts'
_ENTRY_POINT = f"""
import os, runpy, sys
import jax
from pretrain_lm import xla_flags

def applied(*args, **kwargs):
  print('apply_gpu_defaults called', flush=True)
  os.environ['XLA_FLAGS'] = '--{_UNKNOWN_FLAG}=1'
  jax.devices()
  print('a backend had started before it')
  raise SystemExit(0)

xla_flags.apply_gpu_defaults = applied
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
runpy.run_module(module, run_name='__main__', alter_sys=True)
print('never applied')
"""


@pytest.mark.parametrize(
  'module, args',
  [
    ('pretrain_lm.main', ['--config=configs/bert.py:size=tiny']),
    (
      'pretrain_lm.finetune',
      ['--config=configs/finetune/glue.py:task=sst2', '--init=unused'],
    ),
    ('pretrain_lm.bench', ['--config=configs/bert.py:size=tiny']),
  ],
)
def test_every_entry_point_applies_the_defaults_before_jax_starts(
  module, args, tmp_path
):
  args = [*args, f'--workdir={tmp_path}']
  out = subprocess.run(
    [sys.executable, '-c', _ENTRY_POINT, module, *args],
    cwd=REPO,
    env=dict(os.environ, JAX_PLATFORMS='cpu'),
    capture_output=True,
    text=True,
  )
  said = out.stdout.strip().splitlines()
  assert 'apply_gpu_defaults called' in said, (
    f'{module} did not call apply_gpu_defaults: {out.stderr[-2000:]}'
  )
  assert said[-1] == 'apply_gpu_defaults called', said
  assert out.returncode != 0
  assert _UNKNOWN_FLAG in out.stderr, out.stderr[-2000:]
