"""run_sweep: check every run, then start them on free slots, skip finished."""

import os
import shlex
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from pretrain_lm.sweep import launchers, workdirs
from pretrain_lm.sweep.check import check_run, resolve_config
from pretrain_lm.sweep.spec import (
  SweepError,
  load_sweep,
  override_flags,
  run_names,
)

# pretrain_lm.training.loop.EXIT_RESUME: stopped by a signal, checkpoint saved.
EXIT_RESUME = 75


def run_all(
  commands: list[tuple[str, Any]],
  slots: Sequence[str | None],
  log_root: str,
) -> dict[str, int]:
  """Runs each command on a free slot; returns each one's exit code.

  `commands` holds (name, build): build(slot) is the command to run there.
  Slots are TPU slices, or len(slots) = --parallel anonymous ones (None).
  """
  pending, running, codes = list(commands), {}, {}
  free = list(slots)
  try:
    while pending or running:
      while pending and free:
        slot = free.pop(0)
        name, build = pending.pop(0)
        cmd = build(slot)
        where = f' on {slot}' if slot else ''
        log = None
        # With several at once their consoles would interleave: each
        # writes its own log file instead.
        if len(slots) > 1:
          log_path = os.path.join(log_root, f'{name}.log')
          log = open(log_path, 'a')  # noqa: SIM115 - closed when it ends
          print(f'[start] {name}{where} (log: {log_path})', flush=True)
        else:
          print(f'[start] {name}{where}: {launchers.show(cmd)}', flush=True)
        proc = subprocess.Popen(
          cmd,
          shell=isinstance(cmd, str),
          stdout=log,
          stderr=subprocess.STDOUT if log else None,
        )
        running[name] = (proc, log, time.monotonic(), slot)
      for name, (proc, log, start, slot) in list(running.items()):
        if proc.poll() is None:
          continue
        if log:
          log.close()
        codes[name] = proc.returncode
        free.append(slot)
        del running[name]
        print(
          f'[exit {proc.returncode}] {name} ({time.monotonic() - start:.0f} s)',
          flush=True,
        )
      time.sleep(0.2)
  except KeyboardInterrupt:
    # Ctrl-C reached the runs too: let them save their checkpoints.
    print('Interrupted: waiting for the running runs to save.', flush=True)
    for name, (proc, _, _, _) in running.items():
      codes[name] = proc.wait()
    for name, _ in pending:
      codes[name] = EXIT_RESUME
  return codes


def _check_options(
  launcher: str,
  template: str | None,
  parallel: int,
  launcher_args: Sequence[str],
  tpus: Sequence[str],
  fixed: Sequence[str],
) -> None:
  """Raises SweepError for flags that contradict each other."""
  if parallel < 1:
    raise SweepError(f'--parallel={parallel} must be >= 1.')
  if template is not None and launcher_args:
    raise SweepError(
      '--launcher_args is for the built-in launchers: put those flags in '
      'the --launcher template.'
    )
  if tpus and launcher != 'tpu_pod':
    raise SweepError(f'--tpus needs --launcher=tpu_pod, not {launcher!r}.')
  if tpus and any(a.startswith('--tpu=') for a in launcher_args):
    raise SweepError('--tpus and --launcher_args=--tpu=...: give one of them.')
  if len(set(tpus)) < len(tpus):
    raise SweepError(f'--tpus={",".join(tpus)} names a slice twice.')
  bad = [a for a in fixed if not a.startswith('--config.')]
  if bad:
    raise SweepError(f'Unexpected arguments {bad}: only --config.x=y.')


def run_sweep(
  sweep_file: str,
  *,
  base: str,
  workdir_root: str,
  fixed: Sequence[str] = (),
  launcher: str = 'local',
  parallel: int = 1,
  launcher_args: Sequence[str] = (),
  tpus: Sequence[str] = (),
  dry_run: bool = False,
) -> int:
  """Expands, validates and runs (or prints) a sweep; returns an exit code."""
  template = launchers.load_template(launcher)
  _check_options(launcher, template, parallel, launcher_args, tpus, fixed)
  runs = load_sweep(sweep_file)
  names = run_names(runs)
  try:
    resolve_config([f'--config={base}', *fixed])
  except SweepError as e:
    raise SweepError(f'--base={base} {shlex.join(fixed)}: {e}') from None

  # Every run is checked before the first one starts: a typo in run 7 must
  # not surface hours into the sweep.
  configs, errors = [], []
  for name, overrides in zip(names, runs, strict=True):
    try:
      configs.append(check_run(base, fixed, overrides))
    except SweepError as e:
      errors.append(f'  {name}: {e}')
  if errors:
    raise SweepError('Invalid runs, nothing started:\n' + '\n'.join(errors))

  records, commands, planned = [], [], 0
  for name, overrides, config in zip(names, runs, configs, strict=True):
    workdir = workdirs.join(workdir_root, name)
    argv = [
      f'--config={base}',
      f'--workdir={workdir}',
      *fixed,
      *override_flags(overrides),
    ]

    def build(slot, argv=argv, name=name):
      extra = [f'--tpu={slot}'] if slot else []
      return launchers.launch_command(
        launcher, argv, name, [*launcher_args, *extra], template
      )

    # With --tpus the slice is the first free one; sweep.json lists them.
    records.append(
      dict(name=name, workdir=workdir, overrides=overrides, command=build(None))
    )
    step = workdirs.completed_step(workdir, dry_run=dry_run)
    if step is not None and step >= config.train.num_steps:
      print(f'[skip] {name}: finished (step {step})', flush=True)
    elif dry_run:
      # The slices in turn here; a real sweep takes whichever is free.
      slot = tpus[planned % len(tpus)] if tpus else None
      planned += 1
      print(launchers.show(build(slot)), flush=True)
    else:
      commands.append((name, build))
  if dry_run:
    return 0
  workdirs.write_sweep_json(
    workdir_root,
    dict(
      sweep_file=sweep_file,
      base=base,
      fixed=list(fixed),
      launcher=launcher,
      **(dict(tpus=list(tpus)) if tpus else {}),
      runs=records,
    ),
  )
  return _start(commands, len(runs), workdir_root, launcher, parallel, tpus)


def _start(
  commands: list[tuple[str, Any]],
  num_runs: int,
  workdir_root: str,
  launcher: str,
  parallel: int,
  tpus: Sequence[str],
) -> int:
  """Runs the unfinished runs, prints the tally; returns the exit code."""
  # Logs of parallel runs: beside the workdirs, or here for a bucket.
  if '://' in workdir_root:
    log_root = tempfile.mkdtemp(prefix='pretrain_lm_sweep_')
  else:
    log_root = workdir_root
  # One slice runs one job at a time; sbatch only queues them.
  if launcher in ('tpu_pod', 'slurm') and parallel > 1:
    print(
      f'--parallel={parallel} ignored: {launcher} runs one at a time'
      + (' per slice of --tpus.' if tpus else '.')
    )
    parallel = 1
  slots = list(tpus) if tpus else [None] * parallel
  codes = run_all(commands, slots, log_root)
  failed = {n: c for n, c in codes.items() if c}
  print(
    f'{num_runs} runs: {num_runs - len(commands)} already finished, '
    f'{len(codes) - len(failed)} ran, {len(failed)} failed'
    + (f' {failed}' if failed else '')
    + '.',
    flush=True,
  )
  if any(c == EXIT_RESUME for c in failed.values()):
    return EXIT_RESUME
  return 1 if failed else 0
