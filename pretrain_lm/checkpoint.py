"""A thin wrapper over Orbax's CheckpointManager, plus the run's metadata.

Each checkpoint `workdir/checkpoints/<step>/` holds two items:
  state - the TrainState (params, optimizer state, step, dropout RNG),
          written cooperatively by all hosts, restored straight into the
          target shardings;
  meta  - JSON: the data position (batches consumed), the tokenizer's
          special-token ids and vocab size, and what wrote it.
The workdir itself holds `config.json` (the resolved config), `tokenizer.model`
and `run_metadata.json` (git commit, package versions, command line).
"""

import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp
import tensorflow as tf

CHECKPOINT_DIR = 'checkpoints'
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


def checkpoint_dir(path: str) -> str:
  """`path/checkpoints` when `path` is a workdir, else `path` itself."""
  sub = os.path.join(path, CHECKPOINT_DIR)
  return sub if tf.io.gfile.isdir(sub) else path


class Checkpointer:
  """Saves and restores (TrainState, meta) pairs under `workdir/checkpoints`."""

  def __init__(
    self,
    directory: str,
    *,
    keep: int,
    async_save: bool = True,
    read_only: bool = False,
  ):
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep or None,
      # The training loop decides when to save; every call is honoured.
      save_interval_steps=1,
      enable_async_checkpointing=async_save,
      create=not read_only,
      read_only=read_only,
      # An interrupted (killed) save leaves a tmp dir; never restore it.
      cleanup_tmp_directories=not read_only,
    )
    directory = absolute(directory)
    self.directory = directory
    self.manager = ocp.CheckpointManager(
      directory, item_names=('state', 'meta'), options=options
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Starts writing checkpoint `step` (in the background when async)."""
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
      ),
      force=True,
    )

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Restores `step` into the shapes, dtypes and shardings of the target."""
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        meta=ocp.args.JsonRestore(),
      ),
    )
    return restored.state, restored.meta

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Restores only the params of `step` (e.g. to start a new run from it)."""
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
          item={'params': abstract_params},
          restore_args={
            'params': ocp.checkpoint_utils.construct_restore_args(
              abstract_params
            )
          },
          partial_restore=True,
        )
      ),
    )
    return restored.state['params']

  def wait(self) -> None:
    """Blocks until any background save has finished."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


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


def _versions() -> dict[str, str]:
  versions = {'python': sys.version.split()[0]}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = 'not installed'
  return versions


def run_metadata() -> dict[str, Any]:
  """What a later reader needs to reproduce this run."""
  return {
    'git_commit': git_commit(),
    'versions': _versions(),
    'argv': sys.argv,
    'started': datetime.datetime.now(datetime.UTC).isoformat(),
    'process_count': jax.process_count(),
    'devices': [str(d) for d in jax.devices()][:16],
    'device_count': jax.device_count(),
  }


def write_json(path: str, obj: Any) -> None:
  """Writes `obj` as indented JSON via tf.io.gfile (so gs:// works)."""
  with tf.io.gfile.GFile(path, 'w') as f:
    f.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + '\n')


def read_json(path: str) -> Any:
  with tf.io.gfile.GFile(path) as f:
    return json.load(f)
