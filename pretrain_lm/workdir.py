"""A run's workdir files besides its checkpoints: JSON, commit, versions.

The workdir holds `config.json` (the resolved config), `run_metadata.json`
(per start: git commit, package versions, command line, devices),
`batch_spec.json` and the tokenizer; `checkpoints/` is the checkpoint package's.
Nothing here imports JAX or Orbax: these files are read and written before
a backend starts, and by tools that need neither.
"""

import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

# The per-example feature shapes and dtypes of a run (pretrain_lm.load
# builds the model's params from it).
BATCH_SPEC_FILE = 'batch_spec.json'
PACKAGES = (
  'pretrain_lm',
  'jax',
  'jaxlib',
  'flax',
  'optax',
  'orbax-checkpoint',
  'tensorflow',
  'tensorflow-text',
  'tensorflow-datasets',
  'sentencepiece',
  'ml-collections',
  'numpy',
)


def absolute(path: str) -> str:
  """Makes a local path absolute (Orbax requires it); leaves gs:// alone."""
  return path if '://' in path else os.path.abspath(path)


def gfile():
  """tf.io.gfile (every scheme TF knows), imported on first use.

  Only the workdir's JSON files need it: the checkpoints themselves go
  through Orbax's epath, so restoring one costs no TensorFlow start-up.
  """
  import tensorflow as tf

  return tf.io.gfile


def write_json(path: str, obj: Any) -> None:
  """Writes `obj` as indented JSON via tf.io.gfile (so gs:// works)."""
  with gfile().GFile(path, 'w') as f:
    f.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + '\n')


def read_json(path: str) -> Any:
  with gfile().GFile(path) as f:
    return json.load(f)


def git_commit() -> str:
  """The source tree's commit, with '+dirty' when it has local changes."""
  # Launchers that copy the code without .git (launch/tpu_pod.sh) say it.
  if os.environ.get('PRETRAIN_LM_GIT_COMMIT'):
    return os.environ['PRETRAIN_LM_GIT_COMMIT']
  src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    commit = subprocess.run(
      ['git', 'rev-parse', 'HEAD'],
      cwd=src,
      capture_output=True,
      text=True,
      check=True,
      timeout=10,
    ).stdout.strip()
    dirty = subprocess.run(
      ['git', 'status', '--porcelain', '--untracked-files=no'],
      cwd=src,
      capture_output=True,
      text=True,
      timeout=10,
    ).stdout.strip()
    return commit + ('+dirty' if dirty else '')
  except (OSError, subprocess.SubprocessError):
    return 'unknown'


def versions() -> dict[str, str]:
  """Python's version and each of PACKAGES' (or 'not installed')."""
  found = {'python': sys.version.split()[0]}
  for name in PACKAGES:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = 'not installed'
  return found


def run_metadata(devices: Sequence[Any], process_count: int) -> dict[str, Any]:
  """What a later reader needs to reproduce this run.

  Args:
    devices: every device of the run (`jax.devices()`).
    process_count: the number of hosts (`jax.process_count()`).
  """
  return {
    'git_commit': git_commit(),
    'versions': versions(),
    'argv': sys.argv,
    'started': datetime.datetime.now(datetime.UTC).isoformat(),
    'process_count': process_count,
    'devices': [str(d) for d in devices][:16],
    'device_count': len(devices),
  }
