"""Tests for pretrain_lm.workdir: the workdir files besides checkpoints."""

import os
import subprocess
import sys

from pretrain_lm import workdir as workdir_lib


def test_imports_neither_jax_nor_orbax():
  """Read before a backend starts (distributed.py) and by light tools."""
  code = (
    'import sys; import pretrain_lm.workdir; '
    'print([m for m in ("jax", "orbax.checkpoint") if m in sys.modules])'
  )
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=True
  ).stdout
  assert out.strip() == '[]'


def test_run_metadata_names_commit_versions_and_devices(monkeypatch):
  monkeypatch.setenv('PRETRAIN_LM_GIT_COMMIT', 'abc123')
  meta = workdir_lib.run_metadata([f'cpu:{i}' for i in range(20)], 2)
  assert meta['git_commit'] == 'abc123'
  assert meta['versions']['numpy'] != 'not installed'
  assert meta['process_count'] == 2 and meta['device_count'] == 20
  assert len(meta['devices']) == 16  # the first ones are enough to tell


def test_json_round_trip(tmp_path):
  path = str(tmp_path / 'config.json')
  workdir_lib.write_json(path, {'b': (1, 2), 'a': 'x'})
  assert workdir_lib.read_json(path) == {'a': 'x', 'b': [1, 2]}
  assert workdir_lib.absolute('gs://bucket/run') == 'gs://bucket/run'
  assert workdir_lib.absolute('run') == os.path.join(os.getcwd(), 'run')
