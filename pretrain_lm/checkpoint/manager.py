"""The Checkpointer: Orbax saves that commit atomically, verify, retain.

Each checkpoint `<directory>/<step>/` holds two Orbax items: `state` (the
TrainState, written cooperatively by all hosts, restored straight into
the target shardings) and `meta` (JSON; meta.py).

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
             deleted (see retention.py).
"""

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from pretrain_lm import configlib, workdir
from pretrain_lm.checkpoint import errors, integrity, orbax_setup
from pretrain_lm.checkpoint.errors import (
  CorruptCheckpointError,
  NoRestorableCheckpointError,
  TreeMismatchError,
)
from pretrain_lm.checkpoint.meta import CHECKSUMS_KEY, EVAL_METRICS_KEY
from pretrain_lm.checkpoint.retention import retained_steps

# The choices of checkpoint.on_corrupt and checkpoint.best_mode.
ON_CORRUPT, BEST_MODES = configlib.ON_CORRUPT, configlib.BEST_MODES
# A checkpoint that failed verification is renamed to this (on_corrupt=
# 'previous'): Orbax no longer sees it as a step, and nothing is deleted.
CORRUPT_PREFIX = 'corrupt-'
# Retention renames a step to this before removing it (see "atomic" above).
DELETING_PREFIX = 'deleting-'
# What Orbax calls a save in progress; a killed save leaves one behind.
TMP_MARKER = '.orbax-checkpoint-tmp'


def _barrier(name: str) -> None:
  """All hosts wait here (a no-op, with no compile, in one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _all_hosts(ok: bool) -> bool:
  """Whether `ok` holds on every host."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


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
      orbax_setup.write_shards_whole()
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
    with orbax_setup.without_read_only_notice():
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
    meta = dict(meta, **{CHECKSUMS_KEY: integrity.checksums(state)})
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
      return integrity.flatten(getattr(tree, 'tree', tree))
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
    return errors.unreadable(self.directory, step, what, error)

  def _check_matches(
    self, step: int, saved: dict, target: dict, what: str
  ) -> None:
    lines = integrity.tree_differences(saved, target)
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
    got = integrity.checksums([restored[k] for k in names])
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
      step, self._saved_tree(step), integrity.flatten(abstract_state), 'state'
    )
    meta = self._read_meta(step)
    try:
      state = self.manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)),
      ).state
    except Exception as e:  # noqa: BLE001 - tensorstore's errors vary
      raise self._corrupt(step, 'its state item', e) from e
    self._verify(step, integrity.flatten(state), meta)
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
    target = integrity.flatten(abstract_params)
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
      step,
      {f'params/{k}': v for k, v in integrity.flatten(params).items()},
      meta,
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
      try:
        state, meta = self._restore_everywhere(step, abstract_state)
      except CorruptCheckpointError as error:
        if on_corrupt == 'fail':
          raise CorruptCheckpointError(
            f'{error}\nNothing was changed on disk. To resume from the newest '
            'older checkpoint that verifies instead (this one is then '
            'moved aside, not deleted), rerun with '
            '--config.checkpoint.on_corrupt=previous.',
            step,
          ) from error
        failures.append(self._skip_corrupt(step, error))
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

  def _restore_everywhere(self, step: int, abstract_state: Any):
    """restore(), raising CorruptCheckpointError unless every host could."""
    error = None
    try:
      state, meta = self.restore(step, abstract_state)
    except CorruptCheckpointError as e:
      error = e
    # Each host reads its own shards: all must agree, or one would move
    # on to an older step while the others train on this one. Every host
    # takes part in this gather, failed or not.
    if not _all_hosts(error is None) and error is None:
      error = CorruptCheckpointError(
        f'Checkpoint step {step} in {self.directory} failed to restore on '
        'another host (see its log).',
        step,
      )
    if error is not None:
      raise error
    return state, meta

  def _skip_corrupt(self, step: int, error: CorruptCheckpointError) -> str:
    """Moves step `step` aside (unless read-only), says so; the failure."""
    moved = None if self.read_only else self._move_aside(step)
    message = (
      f'WARNING: checkpoint step {step} is corrupt and is skipped '
      f'(checkpoint.on_corrupt=previous); '
      + (f'moved to {moved}. ' if moved else '')
      + f'{error}'
    )
    logging.error(message)
    print(message, file=sys.stderr, flush=True)
    return f'step {step}: {error}'

  def wait(self) -> None:
    """Blocks until any background save has committed; applies retention."""
    self.manager.wait_until_finished()
    self.apply_retention()

  def close(self) -> None:
    self.wait()
    self.manager.close()
