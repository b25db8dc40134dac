"""launch/local.sh builds the command it runs."""

import os
import shlex
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dry_run(*args):
  return subprocess.run(
    [os.path.join(REPO, 'launch', 'local.sh'), '--dry_run', *args],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()


def test_local_dry_run_passes_arguments_through():
  out = dry_run(
    '--config=configs/bert.py:size=tiny',
    '--workdir=/tmp/a b',
    '--config.train.num_steps=5',
  )
  assert shlex.split(out) == [
    '.venv/bin/python',
    '-m',
    'pretrain_lm.main',
    '--config=configs/bert.py:size=tiny',
    '--workdir=/tmp/a b',
    '--config.train.num_steps=5',
  ]


def test_local_fake_devices_sets_xla_flags():
  out = shlex.split(dry_run('--fake_devices=8', '--workdir=/tmp/w'))
  assert out[0].startswith('XLA_FLAGS=')
  assert '--xla_force_host_platform_device_count=8' in out[0]
  assert out[1] == 'JAX_PLATFORMS=cpu'
  assert out[2:] == [
    '.venv/bin/python',
    '-m',
    'pretrain_lm.main',
    '--workdir=/tmp/w',
  ]
