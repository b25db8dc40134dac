"""Each checkpoint's meta item: its keys, and what is read without Orbax.

`workdir/checkpoints/<step>/meta` is JSON: the data position, the
tokenizer's facts, the data stream's fingerprint, the run that wrote it
(`run_description`), a checksum per state array (CHECKSUMS_KEY) and the
evaluation saved with it (EVAL_METRICS_KEY). `python -m
pretrain_lm.describe WORKDIR` shows them.
"""

import json
import os
from typing import Any

import jax
import ml_collections
from etils import epath

from pretrain_lm import workdir
from pretrain_lm.checkpoint.errors import RestoreError

CHECKPOINT_DIR = 'checkpoints'
# The meta item's file inside a checkpoint (Orbax's JsonSave layout).
META_PATH = os.path.join('meta', 'metadata')

# The `meta` keys the checkpointer owns.
CHECKSUMS_KEY = 'checksums'
EVAL_METRICS_KEY = 'eval_metrics'


def checkpoint_dir(path: str) -> str:
  """`path/checkpoints` when `path` is a workdir, else `path` itself."""
  sub = os.path.join(path, CHECKPOINT_DIR)
  return sub if workdir.gfile().isdir(sub) else path


def read_meta(directory: str, step: int) -> dict[str, Any] | None:
  """Checkpoint `step`'s meta JSON, read without Orbax; None if absent."""
  path = epath.Path(directory) / str(step) / META_PATH
  return workdir.read_json(str(path)) if path.exists() else None


def check_tokenizer(saved: dict | None, tokenizer, checkpoint: str) -> None:
  """Raises unless `tokenizer` is the one a checkpoint's meta describes.

  Only the facts the meta has are compared: checkpoints from before the
  hash was stored are checked on size and special ids, older ones not.
  """
  from pretrain_lm.data import records  # TensorFlow: only when asked

  now = records.tokenizer_meta(tokenizer)
  changed = [
    f'{k} {saved[k]} -> {now[k]}'
    for k in now
    if saved and k in saved and saved[k] != now[k]
  ]
  if changed:
    raise RestoreError(
      f'{checkpoint} was trained with another tokenizer than '
      f'{tokenizer.path!r} ({"; ".join(changed)}): its embeddings mean '
      "something only with the ids it was trained on. Use its workdir's "
      f'{os.path.basename(tokenizer.path)}.'
    )


def run_description(
  config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> dict[str, Any]:
  """The run facts stored with each checkpoint (config, code, hardware)."""
  device = jax.devices()[0]
  return {
    'config': json.loads(json.dumps(config.to_dict(), default=str)),
    'git_commit': workdir.git_commit(),
    'versions': workdir.versions(),
    'mesh': dict(mesh.shape),
    'process_count': jax.process_count(),
    'device_count': jax.device_count(),
    'device_kind': device.device_kind,
    'platform': device.platform,
  }
