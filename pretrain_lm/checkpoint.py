"""Orbax checkpoints that commit atomically, verify, restore strictly, retain.

Each checkpoint `workdir/checkpoints/<step>/` holds two items:
  state - the TrainState (params, optimizer state, step, dropout RNG),
          written cooperatively by all hosts, restored straight into the
          target shardings;
  meta  - JSON: the data position (batches consumed), the tokenizer's
          special-token ids, vocab size and file hash, the data stream's
          fields and fingerprint (data/fingerprint.py), the run that wrote it
          (`run_description`: config, commit, versions, mesh), a checksum per
          array of `state` (`checksums`) and, when the save came with an
          evaluation, its metrics (`eval_metrics`).
The workdir's other files (`config.json`, `run_metadata.json`, ...) are
workdir.py's.

Guarantees (tests/checkpoint_test.py, tests/fault_test.py):
  atomic   - Orbax writes `<step>.orbax-checkpoint-tmp` and renames it when
             every item is written; a process killed mid-save leaves only the
             tmp dir, which the next writer removes before anything else.
             Retention renames a step to `deleting-<step>` before removing it,
             so a kill mid-delete never leaves a half-deleted "committed" step.
  verified - the checksums travel in `meta`, inside the same atomic commit,
             and are recomputed after every restore; a mismatch or a file
             Orbax cannot read raises CorruptCheckpointError naming the step
             (and the arrays when known).
  strict   - the saved tree's paths, shapes and dtypes are compared with the
             target before anything is read; TreeMismatchError lists every
             difference (no silent cast, no partial restore).
  retained - the latest `keep` steps, the best `keep_best` by an eval metric
             and every multiple of `keep_every` survive; the newest is never
             deleted (see `retained_steps`).
"""

import contextlib
import functools
import json
import logging as std_logging
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from pretrain_lm import configlib, workdir

CHECKPOINT_DIR = 'checkpoints'
# The choices of checkpoint.on_corrupt and checkpoint.best_mode.
ON_CORRUPT, BEST_MODES = configlib.ON_CORRUPT, configlib.BEST_MODES
# A checkpoint that failed verification is renamed to this (on_corrupt=
# 'previous'): Orbax no longer sees it as a step, and nothing is deleted.
CORRUPT_PREFIX = 'corrupt-'
# Retention renames a step to this before removing it (see module docstring).
DELETING_PREFIX = 'deleting-'
# What Orbax calls a save in progress; a killed save leaves one behind.
TMP_MARKER = '.orbax-checkpoint-tmp'

# The `meta` keys this module owns.
CHECKSUMS_KEY = 'checksums'
EVAL_METRICS_KEY = 'eval_metrics'


class RestoreError(ValueError):
  """A workdir's checkpoints cannot be resumed as asked (main: no traceback)."""


class CorruptCheckpointError(RestoreError):
  """A checkpoint's content differs from what was saved, or is unreadable."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class TreeMismatchError(RestoreError):
  """The saved tree differs from the target (paths, shapes or dtypes)."""


class NoRestorableCheckpointError(RestoreError):
  """A directory holds checkpoints, but none of them restores."""


def checkpoint_dir(path: str) -> str:
  """`path/checkpoints` when `path` is a workdir, else `path` itself."""
  sub = os.path.join(path, CHECKPOINT_DIR)
  return sub if workdir.gfile().isdir(sub) else path


def _barrier(name: str) -> None:
  """All hosts wait here (a no-op, with no compile, in one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _all_hosts(ok: bool) -> bool:
  """Whether `ok` holds on every host."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


# --- Content checksums.


def path_name(path: tuple) -> str:
  """A tree path as 'params/encoder/layer_0/...' (attributes, keys, indices)."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      parts.append(key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    else:  # FlattenedIndexKey and the like
      parts.append(str(getattr(key, 'key', key)))
  return '/'.join(parts)


def flatten(tree: Any) -> dict[str, Any]:
  """{path name: leaf}; empty nodes (None, optax's EmptyState) have none."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {path_name(p): x for p, x in leaves}


def _as_words(x: jax.Array) -> jax.Array:
  """The array's bits as uint32 words, one per element (two for 64-bit)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = np.dtype(x.dtype).itemsize
  if size in (4, 8):  # 8: a trailing dim of 2 words
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    unsigned = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  return x.astype(jnp.uint32)  # sub-byte integers: exact


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """sum_i mix(word_i, i) mod 2^32.

  Integer addition mod 2^32 is exact in any order, so the value does not
  depend on the sharding or the reduction tree, and each shard is summed
  where it lives (only a scalar crosses devices). For a fixed index `mix`
  is a bijection (xor, odd multiplies, xor-shifts: murmur3's finalizer), so
  any one changed word changes the sum; the index makes moved words count.
  """
  w = _as_words(x)
  index = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(w.ndim)):
    iota = jax.lax.broadcasted_iota(jnp.uint32, w.shape, dim)
    index = index + iota * jnp.uint32(stride)
    stride = stride * w.shape[dim] % 2**32
  h = w ^ (index * jnp.uint32(0x9E3779B9))
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  h = h ^ (h >> 16)
  return jnp.sum(h, dtype=jnp.uint32)


@functools.lru_cache(maxsize=16)
def _checksum_fn(out_sharding):
  return jax.jit(
    lambda leaves: [_leaf_checksum(x) for x in leaves],
    out_shardings=out_sharding,
  )


def _mix_np(w: np.ndarray, index: np.ndarray) -> np.ndarray:
  """_leaf_checksum's `mix`, in NumPy (uint32 arithmetic wraps the same)."""
  h = w ^ (index * np.uint32(0x9E3779B9))
  h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words_np(d: np.ndarray) -> np.ndarray:
  """_as_words in NumPy; 8-byte elements give a trailing dim of 2 words."""
  if d.dtype == np.bool_:
    return d.astype(np.uint32)
  size = d.dtype.itemsize
  if size == 4:
    return d.view(np.uint32)
  if size == 8:
    return np.ascontiguousarray(d).view(np.uint32).reshape(*d.shape, 2)
  if size in (1, 2):
    return d.view(np.uint8 if size == 1 else np.uint16).astype(np.uint32)
  return d.astype(np.uint32)


def _host_checksum(x: jax.Array) -> int:
  """_leaf_checksum's value, summed in NumPy over this process's shards.

  Each distinct shard (replica 0) contributes its words at their global
  indices; the sum mod 2^32 is the same in any order, so this equals the
  on-device value exactly (tests/checkpoint_test.py compares the two).
  """
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  words_shape = x.shape + ((2,) if np.dtype(x.dtype).itemsize == 8 else ())
  strides, stride = [], 1
  for size in reversed(words_shape):
    strides.insert(0, stride)
    stride = stride * size % 2**32
  total = 0
  for shard in x.addressable_shards:
    if shard.replica_id != 0:
      continue
    w = _words_np(np.asarray(shard.data))
    index = np.zeros((), np.uint32)
    for dim, (part, step) in enumerate(
      zip(shard.index, strides[: x.ndim], strict=True)
    ):
      start = part.start or 0
      shape = [1] * w.ndim
      shape[dim] = w.shape[dim]
      iota = np.arange(start, start + w.shape[dim], dtype=np.uint32)
      index = index + iota.reshape(shape) * np.uint32(step)
    if w.ndim > x.ndim:  # the two words of an 8-byte element
      index = index + np.arange(2, dtype=np.uint32)
    index = np.broadcast_to(index, w.shape)
    # 1-d at least: NumPy scalars would warn where uint32 products wrap.
    mixed = _mix_np(np.atleast_1d(w), np.atleast_1d(index))
    total += int(mixed.sum(dtype=np.uint32))
  return total % 2**32


def _on_host(x) -> bool:
  """A jax.Array this process holds whole in host memory (the CPU backend).

  Its checksum is summed in NumPy: no XLA compile per tree structure (one
  fused reduction per leaf takes seconds to compile for a few hundred
  leaves), and on the CPU the arrays are in host memory already.
  """
  return (
    isinstance(x, jax.Array)
    and x.is_fully_addressable
    and all(d.platform == 'cpu' for d in x.sharding.device_set)
  )


def _placement(x) -> tuple:
  """Leaves one jit call can take together: same devices (or numpy)."""
  s = getattr(x, 'sharding', None)
  if s is None:
    return ()
  return tuple(sorted(d.id for d in s.device_set))


def _device_checksums(flat: dict[str, Any]) -> dict[str, int]:
  """{name: _leaf_checksum}, one jit call per group of co-located leaves."""
  groups: dict[tuple, list[str]] = {}
  for name, x in flat.items():
    groups.setdefault(_placement(x), []).append(name)
  out = {}
  for names in groups.values():
    leaves = [flat[k] for k in names]
    first = getattr(leaves[0], 'sharding', None)
    replicated = None
    if isinstance(first, jax.sharding.NamedSharding):
      # Replicated scalars: every host reads them without a gather.
      replicated = jax.sharding.NamedSharding(
        first.mesh, jax.sharding.PartitionSpec()
      )
    sums = jax.device_get(_checksum_fn(replicated)(leaves))
    out.update((k, int(v)) for k, v in zip(names, sums, strict=True))
  return out


def checksums(tree: Any) -> dict[str, int]:
  """{path name: uint32 checksum of the leaf's bits}.

  Arrays on accelerators or spread over hosts are summed on device (only a
  scalar per array crosses devices); arrays this process holds in host
  memory are summed in NumPy, to the same value.
  """
  flat = flatten(tree)
  host = {k: x for k, x in flat.items() if _on_host(x)}
  out = {k: _host_checksum(x) for k, x in host.items()}
  rest = {k: x for k, x in flat.items() if k not in host}
  if rest:
    out.update(_device_checksums(rest))
  return {k: out[k] for k in flat}


# --- Strict restore.


def _describe(shape, dtype) -> str:
  return f'{np.dtype(dtype).name}[{",".join(map(str, shape))}]'


def tree_differences(
  saved: Mapping[str, Any], target: Mapping[str, Any]
) -> list[str]:
  """Every path missing, extra, or of another shape or dtype, one per line.

  Both map path names to anything with `.shape` and `.dtype` (Orbax's
  ArrayMetadata, jax.ShapeDtypeStruct, arrays).
  """
  lines = []
  for name in sorted(target.keys() - saved.keys()):
    t = target[name]
    lines.append(
      f'missing from the checkpoint: {name} (the target expects '
      f'{_describe(t.shape, t.dtype)})'
    )
  for name in sorted(saved.keys() - target.keys()):
    s = saved[name]
    lines.append(
      f'not in the target: {name} (saved as {_describe(s.shape, s.dtype)})'
    )
  for name in sorted(saved.keys() & target.keys()):
    s, t = saved[name], target[name]
    if tuple(s.shape) != tuple(t.shape):
      lines.append(
        f'shape of {name}: saved {tuple(s.shape)}, the target expects '
        f'{tuple(t.shape)}'
      )
    if np.dtype(s.dtype) != np.dtype(t.dtype):
      lines.append(
        f'dtype of {name}: saved {np.dtype(s.dtype).name}, the target '
        f'expects {np.dtype(t.dtype).name}'
      )
  return lines


# --- Retention.


def retained_steps(
  steps: Iterable[int],
  *,
  keep: int,
  keep_best: int = 0,
  metrics: Mapping[int, float | None] | None = None,
  best_mode: str = 'min',
  keep_every: int = 0,
) -> set[int]:
  """The steps a retention policy keeps: latest ∪ best ∪ permanent ∪ newest.

  Args:
    steps: the committed checkpoints' steps.
    keep: the latest `keep` steps are kept (for resuming); 0 keeps all.
    keep_best: the `keep_best` steps with the best metric are kept; steps
      without a (finite) metric are never among them. 0: none.
    metrics: step -> the metric the best ones are ranked by.
    best_mode: 'min' (a loss) or 'max' (an accuracy) is best.
    keep_every: steps that are multiples of it are kept forever; 0: none.

  Returns:
    The steps to keep; the newest step is always among them.
  """
  steps = sorted(set(steps))
  if not steps:
    return set()
  kept = {steps[-1]}
  kept.update(steps if keep <= 0 else steps[-keep:])
  if keep_best > 0:
    ranked = [
      s
      for s in steps
      if (metrics or {}).get(s) is not None and math.isfinite(metrics[s])
    ]
    sign = 1 if best_mode == 'min' else -1
    # Ties go to the later step: it has trained longer.
    ranked.sort(key=lambda s: (sign * metrics[s], -s))
    kept.update(ranked[:keep_best])
  if keep_every > 0:
    kept.update(s for s in steps if s % keep_every == 0)
  return kept


# --- The checkpointer.


def _write_shards_whole() -> None:
  """In a single process, Orbax writes each array's shards whole.

  Orbax's default on CPU and TPU is replica-parallel saving: a replicated
  shard is cut into one slice per replica so that several hosts share its
  writing. In one process the same process writes every slice, and each
  slice is a small XLA program compiled on the first save of its shape:
  about 100 of them for a tiny BERT on a 2x2x2 mesh of CPU devices, whose
  compiles made most of its first save. Multi-host runs keep the
  default, which is what it is for. The file format is the same either
  way (only the chunking differs), so restores do not care.
  """
  if jax.process_count() > 1:
    return
  default = ocp.type_handlers.get_type_handler(jax.Array)
  if type(default) is not ocp.type_handlers.ArrayHandler:
    return  # somebody registered their own: theirs stands
  if not getattr(default, '_use_replica_parallel', True):
    return  # done already
  # The same handler as Orbax registers (defaults plus its array metadata
  # store, which it only exposes as this attribute) but for that switch.
  # Should a later Orbax drop the attribute, its default stands: slower
  # first saves, never checkpoints without their array metadata.
  store = getattr(default, '_array_metadata_store', None)
  if store is None:
    return
  handler = ocp.type_handlers.ArrayHandler(
    use_replica_parallel=False, array_metadata_store=store
  )
  # Orbax warns of every override (through absl); this one is deliberate.
  notice = 'Type handler registry type'
  quiet = lambda record: not record.getMessage().startswith(notice)
  absl_logger = logging.get_absl_logger()
  absl_logger.addFilter(quiet)
  try:
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
  finally:
    absl_logger.removeFilter(quiet)


class _ReadOnlyNotice(std_logging.Filter):
  """Drops Orbax's warning that a manager opened read-only is read-only."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.msg != 'Given directory is read only=%s'


@contextlib.contextmanager
def _without_read_only_notice():
  """Loading a checkpoint (a notebook, describe) is read-only by request."""
  notice = _ReadOnlyNotice()
  logger = std_logging.getLogger('absl')
  logger.addFilter(notice)
  try:
    yield
  finally:
    logger.removeFilter(notice)


class Checkpointer:
  """Saves and restores (TrainState, meta) pairs under `workdir/checkpoints`."""

  def __init__(
    self,
    directory: str,
    *,
    keep: int,
    async_save: bool = True,
    read_only: bool = False,
    keep_best: int = 0,
    best_metric: str = 'eval_loss',
    best_mode: str = 'min',
    keep_every: int = 0,
  ):
    if best_mode not in BEST_MODES:
      raise ValueError(
        f'checkpoint.best_mode={best_mode!r}; expected one of {BEST_MODES}.'
      )
    directory = workdir.absolute(directory)
    self.directory = directory
    self.read_only = read_only
    self.keep, self.keep_best, self.keep_every = keep, keep_best, keep_every
    self.best_metric, self.best_mode = best_metric, best_mode
    self._metric_cache: dict[int, float | None] = {}
    if not read_only:
      self._remove_leftovers()
      _write_shards_whole()
    options = ocp.CheckpointManagerOptions(
      # Retention is ours (`retained_steps`): Orbax keeps everything.
      max_to_keep=None,
      # The training loop decides when to save; every call is honoured.
      save_interval_steps=0 if read_only else 1,
      enable_async_checkpointing=async_save,
      create=not read_only,
      read_only=read_only,
      # Local leftovers are removed above, synchronously. Orbax's own pass
      # runs in the background, so it is kept for object stores only (their
      # uncommitted steps carry no tmp suffix, only a missing
      # commit_success.txt): locally it could still be deleting while
      # another Checkpointer on the directory starts a save.
      cleanup_tmp_directories=not read_only and '://' in directory,
    )
    # Handlers named up front: a manager that has not saved yet (a restart)
    # can then read the state's tree metadata before restoring it.
    with _without_read_only_notice():
      self.manager = ocp.CheckpointManager(
        directory,
        item_handlers={
          'state': ocp.StandardCheckpointHandler(),
          'meta': ocp.JsonCheckpointHandler(),
        },
        options=options,
      )

  # -- Directory housekeeping.

  def _remove_leftovers(self) -> None:
    """Removes what killed saves and deletes left: never a committed step."""
    root = epath.Path(self.directory)
    if jax.process_index() == 0 and root.is_dir():
      for path in root.iterdir():
        if TMP_MARKER in path.name or path.name.startswith(DELETING_PREFIX):
          logging.warning('Removing an interrupted save or delete: %s', path)
          path.rmtree()
    # No host may list the directory while the chief is still cleaning it.
    _barrier('checkpoint leftovers removed')

  def leftovers(self) -> list[str]:
    """Names in the directory that are not a restorable step (sorted)."""
    root = epath.Path(self.directory)
    if not root.is_dir():
      return []
    steps = {str(s) for s in self.all_steps()}
    return sorted(p.name for p in root.iterdir() if p.name not in steps)

  def _step_path(self, step: int) -> epath.Path:
    return epath.Path(self.directory) / str(step)

  def _move_aside(self, step: int) -> str:
    """Renames step `step` to corrupt-<step> (never overwriting); the path."""
    root = epath.Path(self.directory)
    target = root / f'{CORRUPT_PREFIX}{step}'
    n = 1
    while target.exists():
      n += 1
      target = root / f'{CORRUPT_PREFIX}{step}.{n}'
    if jax.process_index() == 0:
      self._step_path(step).rename(target)
    _barrier(f'checkpoint {step} moved aside')
    self.manager.reload()
    return os.fspath(target)

  # -- Steps.

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  # -- Saving and retention.

  def save(
    self,
    step: int,
    state: Any,
    meta: dict[str, Any],
    metrics: Mapping[str, float] | None = None,
  ) -> None:
    """Starts writing checkpoint `step` (in the background when async).

    `metrics` (an evaluation of exactly this state) is stored with it and
    ranks it for `keep_best`; a checkpoint saved without one is never among
    the best, only kept as one of the latest or a permanent one.
    """
    # Before Orbax copies the state: the next train step donates it.
    meta = dict(meta, **{CHECKSUMS_KEY: checksums(state)})
    if metrics:
      meta[EVAL_METRICS_KEY] = {k: float(v) for k, v in metrics.items()}
    # The previous save must have committed before retention looks at it;
    # Orbax's save would wait for it anyway.
    self.manager.wait_until_finished()
    self.apply_retention()
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
      ),
      force=True,
    )
    self._metric_cache[step] = self._metric_of(meta)
    if self.keep_best and metrics and self.best_metric not in metrics:
      self.wait()
      raise ValueError(
        f'checkpoint.best_metric={self.best_metric!r} is not an eval metric '
        f'of this run; valid: {sorted(metrics)}. Checkpoint {step} is saved: '
        'fix the field and rerun to continue.'
      )

  def _metric_of(self, meta: Mapping[str, Any]) -> float | None:
    value = (meta.get(EVAL_METRICS_KEY) or {}).get(self.best_metric)
    return None if value is None else float(value)

  def _metric(self, step: int) -> float | None:
    """Step `step`'s ranking metric, read from its meta once."""
    if step not in self._metric_cache:
      path = self._step_path(step) / 'meta' / 'metadata'
      try:
        self._metric_cache[step] = self._metric_of(json.loads(path.read_text()))
      except (OSError, ValueError, AttributeError):
        self._metric_cache[step] = None  # unreadable: never among the best
    return self._metric_cache[step]

  def apply_retention(self) -> list[int]:
    """Deletes the committed steps the policy does not keep; returns them."""
    if self.read_only:
      return []
    steps = self.all_steps()
    metrics = {s: self._metric(s) for s in steps} if self.keep_best else {}
    kept = retained_steps(
      steps,
      keep=self.keep,
      keep_best=self.keep_best,
      metrics=metrics,
      best_mode=self.best_mode,
      keep_every=self.keep_every,
    )
    doomed = [s for s in steps if s not in kept]
    if not doomed:
      return []
    if jax.process_index() == 0:
      for step in doomed:
        # Rename first (atomic), so a kill never leaves half a step.
        trash = epath.Path(self.directory) / f'{DELETING_PREFIX}{step}'
        self._step_path(step).rename(trash)
        trash.rmtree()
    _barrier('checkpoint retention applied')
    self.manager.reload()
    return doomed

  # -- Restoring.

  def _saved_tree(self, step: int) -> dict[str, Any]:
    """{path name: ArrayMetadata} of step `step`'s state, read from disk."""
    try:
      tree = self.manager.item_metadata(step)['state']
      if tree is None:
        raise FileNotFoundError('no state item metadata')
      return flatten(getattr(tree, 'tree', tree))
    except Exception as e:  # noqa: BLE001 - any unreadable metadata
      raise self._corrupt(step, 'its tree metadata', e) from e

  def _read_meta(self, step: int) -> dict[str, Any]:
    try:
      return dict(
        self.manager.restore(
          step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        ).meta
      )
    except Exception as e:  # noqa: BLE001
      raise self._corrupt(step, 'its meta item', e) from e

  def _corrupt(self, step: int, what: str, error: Exception):
    """CorruptCheckpointError for an Orbax/tensorstore read failure."""
    text = str(error).strip()
    # tensorstore appends its whole spec; the cause comes before it.
    text = text.split(' [tensorstore_spec=')[0].splitlines()
    detail = text[0][:400] if text else ''
    # tensorstore names the zarr array it was opening ("params.a.b/.zarray").
    arrays = sorted(
      set(re.findall(r'"([^"/]+)/\.z', str(error)))
      | set(re.findall(r"'path': '([^'/]+)/'", str(error)))
    )
    where = (
      f' (array {", ".join(a.replace(".", "/") for a in arrays)})'
      if arrays
      else ''
    )
    return CorruptCheckpointError(
      f'Checkpoint step {step} in {self.directory} is unreadable: {what}'
      f'{where} could not be read: {type(error).__name__}: {detail}',
      step,
    )

  def _check_matches(
    self, step: int, saved: dict, target: dict, what: str
  ) -> None:
    lines = tree_differences(saved, target)
    if lines:
      raise TreeMismatchError(
        f'Checkpoint step {step} in {self.directory} does not match the '
        f'{what} it is restored into ({len(lines)} differences; nothing was '
        'restored):\n  ' + '\n  '.join(lines)
      )

  def _verify(self, step: int, restored: dict, meta: dict) -> None:
    """Recomputes the checksums of `restored` ({path: array})."""
    saved = meta.get(CHECKSUMS_KEY)
    if saved is None:  # written before checksums existed
      logging.warning('Checkpoint %d has no checksums to verify.', step)
      return
    names = sorted(restored)
    got = checksums([restored[k] for k in names])
    bad = [
      name
      for i, name in enumerate(names)
      if name in saved and got[str(i)] != saved[name]
    ]
    if bad:
      raise CorruptCheckpointError(
        f'Checkpoint step {step} in {self.directory} is corrupt: the '
        f'content of {len(bad)} arrays differs from what was saved '
        f'(checksum mismatch): {", ".join(bad)}.',
        step,
      )

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Restores `step` into the shapes, dtypes and shardings of the target.

    Raises:
      TreeMismatchError: the saved tree is not exactly the target's.
      CorruptCheckpointError: its content is unreadable or not what was
        saved.
    """
    self._check_matches(
      step, self._saved_tree(step), flatten(abstract_state), 'state'
    )
    meta = self._read_meta(step)
    try:
      state = self.manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)),
      ).state
    except Exception as e:  # noqa: BLE001 - tensorstore's errors vary
      raise self._corrupt(step, 'its state item', e) from e
    self._verify(step, flatten(state), meta)
    return state, meta

  def restore_params(
    self, step: int, abstract_params: Any, *, partial: bool = False
  ) -> Any:
    """Restores only the params of `step` (e.g. to start a new run from it).

    The params must match the target exactly; with `partial`, top-level
    entries of the saved params that the target lacks (heads a fine-tuned
    model drops) are allowed and stay on disk.
    """
    saved = {
      k[len('params/') :]: v
      for k, v in self._saved_tree(step).items()
      if k.startswith('params/')
    }
    target = flatten(abstract_params)
    if partial:
      wanted = {k.split('/')[0] for k in target}
      saved = {k: v for k, v in saved.items() if k.split('/')[0] in wanted}
    self._check_matches(step, saved, target, 'params')
    meta = self._read_meta(step)
    try:
      # A reader of its own: the manager's `state` handler is the standard
      # one, which cannot leave the optimizer state on disk.
      with ocp.PyTreeCheckpointer() as reader:
        params = reader.restore(
          self._step_path(step) / 'state',
          args=ocp.args.PyTreeRestore(
            item={'params': abstract_params},
            restore_args={
              'params': ocp.checkpoint_utils.construct_restore_args(
                abstract_params
              )
            },
            partial_restore=True,
          ),
        )['params']
    except Exception as e:  # noqa: BLE001
      raise self._corrupt(step, 'its params', e) from e
    self._verify(
      step, {f'params/{k}': v for k, v in flatten(params).items()}, meta
    )
    return params

  def restore_latest(
    self, abstract_state: Any, *, on_corrupt: str = 'fail'
  ) -> tuple[int, Any, dict] | None:
    """The newest checkpoint that restores, as (step, state, meta).

    None only when the directory holds nothing that looks like a
    checkpoint: a run never starts over on top of checkpoints. A corrupt
    checkpoint raises (on_corrupt='fail'), or is moved to corrupt-<step>
    and the next older one is tried (on_corrupt='previous').

    Raises:
      CorruptCheckpointError: the latest is corrupt and on_corrupt='fail'.
      TreeMismatchError: a checkpoint differs from the target's tree (a
        config change, not damage: no fallback).
      NoRestorableCheckpointError: there are checkpoints, none restores.
    """
    if on_corrupt not in ON_CORRUPT:
      raise ValueError(
        f'checkpoint.on_corrupt={on_corrupt!r}; expected one of {ON_CORRUPT}.'
      )
    failures = []
    for step in reversed(self.all_steps()):
      error = None
      try:
        state, meta = self.restore(step, abstract_state)
      except CorruptCheckpointError as e:
        error = e
      # Each host reads its own shards: all must agree, or one would move
      # on to an older step while the others train on this one.
      if not _all_hosts(error is None) and error is None:
        error = CorruptCheckpointError(
          f'Checkpoint step {step} in {self.directory} failed to restore on '
          'another host (see its log).',
          step,
        )
      if error is not None:
        if on_corrupt == 'fail':
          raise CorruptCheckpointError(
            f'{error}\nNothing was changed on disk. To resume from the newest '
            'older checkpoint that verifies instead (this one is then '
            'moved aside, not deleted), rerun with '
            '--config.checkpoint.on_corrupt=previous.',
            step,
          ) from error
        moved = None if self.read_only else self._move_aside(step)
        failures.append(f'step {step}: {error}')
        message = (
          f'WARNING: checkpoint step {step} is corrupt and is skipped '
          f'(checkpoint.on_corrupt=previous); '
          + (f'moved to {moved}. ' if moved else '')
          + f'{error}'
        )
        logging.error(message)
        print(message, file=sys.stderr, flush=True)
        continue
      return step, state, meta
    found = self.leftovers()
    if not failures and not found:
      return None
    raise NoRestorableCheckpointError(
      f'{self.directory} holds checkpoints, but none can be restored; '
      'refusing to start from scratch on top of them.\n'
      + ''.join(f'  {f}\n' for f in failures)
      + (f'  Also there: {", ".join(found)}.\n' if found else '')
      + 'Repair or move them away, or train in a new workdir.'
    )

  def wait(self) -> None:
    """Blocks until any background save has committed; applies retention."""
    self.manager.wait_until_finished()
    self.apply_retention()

  def close(self) -> None:
    self.wait()
    self.manager.close()


# --- What each checkpoint's meta says about itself (items shown by
# `python -m pretrain_lm.describe WORKDIR`).

# The meta item's file inside a checkpoint (Orbax's JsonSave layout).
META_PATH = os.path.join('meta', 'metadata')


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
