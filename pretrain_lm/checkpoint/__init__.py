"""Orbax checkpoints that commit atomically, verify, restore strictly, retain.

A workdir's `checkpoints/<step>/` holds the TrainState and a JSON meta item.
manager.py writes and reads them (its docstring lists the guarantees),
integrity.py checksums and compares trees, retention.py picks the steps to
keep, meta.py reads the meta item without Orbax. The workdir's other files
(`config.json`, `run_metadata.json`, ...) are pretrain_lm/workdir.py's.
"""

from pretrain_lm.checkpoint.errors import (
  CorruptCheckpointError,
  NoRestorableCheckpointError,
  RestoreError,
  TreeMismatchError,
)
from pretrain_lm.checkpoint.integrity import (
  checksums,
  flatten,
  path_name,
  tree_differences,
)
from pretrain_lm.checkpoint.manager import (
  BEST_MODES,
  CORRUPT_PREFIX,
  DELETING_PREFIX,
  ON_CORRUPT,
  TMP_MARKER,
  Checkpointer,
)
from pretrain_lm.checkpoint.meta import (
  CHECKPOINT_DIR,
  CHECKSUMS_KEY,
  EVAL_METRICS_KEY,
  META_PATH,
  check_tokenizer,
  checkpoint_dir,
  read_meta,
  run_description,
)
from pretrain_lm.checkpoint.retention import retained_steps

__all__ = [
  'BEST_MODES',
  'CHECKPOINT_DIR',
  'CHECKSUMS_KEY',
  'CORRUPT_PREFIX',
  'DELETING_PREFIX',
  'EVAL_METRICS_KEY',
  'META_PATH',
  'ON_CORRUPT',
  'TMP_MARKER',
  'Checkpointer',
  'CorruptCheckpointError',
  'NoRestorableCheckpointError',
  'RestoreError',
  'TreeMismatchError',
  'check_tokenizer',
  'checkpoint_dir',
  'checksums',
  'flatten',
  'path_name',
  'read_meta',
  'retained_steps',
  'run_description',
  'tree_differences',
]
