r"""Sweeps of config overrides: expand, validate, run or launch, summarize.

A sweep is a Python file whose `get_sweep()` returns a list of override
dicts, built with `choice`, `product` and `zip` from this module:

  # experiments/sweeps/bert_lr.py
  from pretrain_lm import sweep

  def get_sweep():
    return sweep.product(
      sweep.choice('optimizer.learning_rate', [1e-4, 3e-4]),
      sweep.choice('optimizer.warmup_steps', [1000, 10_000]),
    )

Run it (from the repository root):

  python -m pretrain_lm.sweep experiments/sweeps/bert_lr.py \
      --base=configs/bert.py:size=small --workdir_root=gs://bucket/bert_lr \
      [--dry_run] [--launcher=local|tpu_pod|slurm|TEMPLATE|FILE] \
      [--parallel=N] [--launcher_args='--tpu=my-v4 --zone=us-central2-b'] \
      [--tpus=a,b,c] [--config.train.num_steps=100000 ...]

Every override of every run is checked against the base config (field names,
types, `pretrain_lm.validate`) before anything starts. Each run gets the
workdir `WORKDIR_ROOT/NAME`, NAME made of its overrides
(`learning_rate=0.0003-warmup_steps=1000`); `--config.x=y` flags after the
sweep file apply to every run and stay out of the names. Runs whose workdir
already reached `train.num_steps` are skipped, so rerunning the same command
resumes an interrupted sweep. `--launcher=local` runs
`python -m pretrain_lm.main` here, `--parallel` at a time; `tpu_pod` runs
`launch/tpu_pod.sh run` once per run, one after the other on the same slice,
or with `--tpus=a,b,c` on whichever of those slices is free; `slurm` submits
`launch/slurm.sbatch` once per run. Any other scheduler (GKE/XPK, ...) takes
a command template, given inline or as a file holding it:

  --launcher='xpk workload create --cluster=C --workload={job} \
      --tpu-type=v5p-32 --command="{command}"'

with the placeholders {name} (the run's name), {job} (the name in lowercase
letters, digits and '-', at most 39 characters, for Kubernetes), {workdir},
{command} (`python -m pretrain_lm.main` and the run's flags, as one command
line) and {args} (the flags alone); `{{` and `}}` are literal braces. Each
value is shell-quoted for where it stands: unquoted it is one word ({args}:
one per flag); inside '...' or "..." it is quoted for the shell that later
runs the quoted text, so paths with spaces or quotes reach the run intact.
The rendered line runs in `sh`, `--parallel` at a time.
`WORKDIR_ROOT/sweep.json` lists the runs.

  python -m pretrain_lm.sweep --summarize WORKDIR_ROOT [--format=csv]

prints each run's overrides, last step, last train loss and last eval
metrics as a markdown (default) or CSV table.
"""

import argparse
import builtins
import collections
import csv
import hashlib
import importlib.util
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import ml_collections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_FILE = 'sweep.json'
LAUNCHERS = ('local', 'tpu_pod', 'slurm')
# What a --launcher template may name; see the module docstring.
PLACEHOLDERS = ('name', 'job', 'workdir', 'command', 'args')
# pretrain_lm.train.EXIT_RESUME: stopped by a signal, checkpoint saved.
EXIT_RESUME = 75
# Longer names are cut and end in a hash of the overrides.
MAX_NAME_LEN = 100

Overrides = dict[str, Any]


class SweepError(ValueError):
  """A sweep file, an override or a run that cannot go ahead."""


# Building sweeps.


def choice(name: str, values: Sequence[Any]) -> list[Overrides]:
  """One run per value of the config field `name` ('optimizer.warmup_steps')."""
  if not isinstance(name, str) or not name:
    raise SweepError(f'choice: the field name must be a string, not {name!r}.')
  if isinstance(values, str | bytes) or not isinstance(values, Sequence):
    raise SweepError(
      f'choice({name!r}, ...): values must be a list, not {values!r}.'
    )
  if not values:
    raise SweepError(f'choice({name!r}, []): needs at least one value.')
  return [{name: v} for v in values]


def product(*sweeps: Sequence[Overrides]) -> list[Overrides]:
  """Every combination of one run from each sweep (the first varies slowest)."""
  return [_merge(runs, 'product') for runs in itertools.product(*sweeps)]


def zip(*sweeps: Sequence[Overrides]) -> list[Overrides]:
  """Run i of every sweep merged into one; the sweeps' lengths must agree."""
  lengths = [len(s) for s in sweeps]
  if len(set(lengths)) > 1:
    raise SweepError(f'zip: sweeps of different lengths {lengths}.')
  return [_merge(runs, 'zip') for runs in builtins.zip(*sweeps, strict=True)]


def _merge(runs: Sequence[Overrides], how: str) -> Overrides:
  merged = {}
  for run in runs:
    for key, value in run.items():
      if key in merged:
        raise SweepError(f'{how}: field {key!r} is set by two of its sweeps.')
      merged[key] = value
  return merged


def load_sweep(path: str) -> list[Overrides]:
  """The list of override dicts a sweep file's get_sweep() returns."""
  if not os.path.isfile(path):
    raise SweepError(f'Sweep file {path!r} does not exist.')
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(f'{name}_sweep', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    raise SweepError(f'{path} has no get_sweep() function.')
  runs = module.get_sweep()
  if not isinstance(runs, list) or not runs:
    raise SweepError(f'{path}: get_sweep() must return a non-empty list.')
  for i, run in enumerate(runs):
    if not isinstance(run, dict) or not all(isinstance(k, str) for k in run):
      raise SweepError(
        f'{path}: run {i} is {run!r}, not a dict of field names to values.'
      )
  if len({_fingerprint(r) for r in runs}) < len(runs):
    raise SweepError(f'{path}: get_sweep() lists the same run twice.')
  return runs


# Names and command lines.


def format_value(value: Any) -> str:
  """A value as `--config.x=VALUE` spells it (parsed back by config_flags)."""
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, float):
    return repr(value)
  if isinstance(value, tuple | list):
    return repr(tuple(value))  # config_flags reads tuples by literal_eval
  return str(value)


def override_flags(overrides: Overrides) -> list[str]:
  return [f'--config.{k}={format_value(v)}' for k, v in overrides.items()]


def _fingerprint(run: Overrides) -> str:
  text = json.dumps(run, sort_keys=True, default=repr)
  return hashlib.sha1(text.encode()).hexdigest()[:8]


def labels(runs: Sequence[Overrides]) -> dict[str, str]:
  """Field -> short label: its last component, unless two fields share it."""
  keys = list(dict.fromkeys(k for run in runs for k in run))
  last = {k: k.rsplit('.', 1)[-1] for k in keys}
  counts = collections.Counter(last.values())
  return {k: last[k] if counts[last[k]] == 1 else k for k in keys}


def run_names(runs: Sequence[Overrides]) -> list[str]:
  """Unique, filesystem-safe, deterministic workdir names for the runs."""
  label = labels(runs)
  names = []
  for run in runs:
    name = '-'.join(f'{label[k]}={format_value(v)}' for k, v in run.items())
    # Only characters that are safe in paths, URLs and shells.
    name = re.sub(r'[^A-Za-z0-9._=+,-]', '_', name) or 'base'
    if len(name) > MAX_NAME_LEN:
      name = f'{name[: MAX_NAME_LEN - 9]}-{_fingerprint(run)}'
    names.append(name)
  # Different values can sanitise to the same name ('a/b' and 'a_b').
  counts = collections.Counter(names)
  return [
    f'{n}-{_fingerprint(r)}' if counts[n] > 1 else n
    for n, r in builtins.zip(names, runs, strict=True)
  ]


def join(root: str, *names: str) -> str:
  """`root/name/...` for local paths and gs:// URLs alike."""
  if '://' in root:
    return '/'.join([root.rstrip('/'), *names])
  return os.path.join(root, *names)


# Validation.


def resolve_config(argv: Sequence[str]) -> ml_collections.ConfigDict:
  """The config main.py would build from `--config=... --config.x=y` argv.

  Raises SweepError naming the field for an unknown field or a value of the
  wrong type.
  """
  from absl import flags
  from ml_collections import config_flags

  from pretrain_lm import validate

  argv = ['pretrain_lm.main', *argv]
  flag_values = flags.FlagValues()
  try:
    holder = config_flags.DEFINE_config_file(
      'config', None, '', flag_values=flag_values, sys_argv=argv
    )
    flag_values(argv)
    return holder.value
  except (flags.Error, AttributeError, KeyError, TypeError) as e:
    raise SweepError(validate.unknown_override(argv) or str(e)) from None


def check_run(
  base: str, fixed: Sequence[str], overrides: Overrides
) -> ml_collections.ConfigDict:
  """The run's resolved config, after every check main.py makes at start."""
  from pretrain_lm import validate

  config = resolve_config(
    [f'--config={base}', *fixed, *override_flags(overrides)]
  )
  # A value that does not survive the trip through the command line (a
  # string with a comma for a tuple field, say) would run something else.
  for key, value in overrides.items():
    got = config
    for part in key.split('.'):
      got = got[part]
    if isinstance(value, list):
      value = tuple(value)
    if got != value:
      raise SweepError(
        f'{key}={value!r} reads back from the command line as {got!r}.'
      )
  try:
    validate.check_config(config)
  except (ValueError, FileNotFoundError) as e:
    raise SweepError(str(e)) from None
  return config


# Finished runs.


def _read_lines(path: str) -> list[dict]:
  import tensorflow as tf

  if not tf.io.gfile.exists(path):
    return []
  with tf.io.gfile.GFile(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def completed_step(workdir: str, dry_run: bool = False) -> int | None:
  """The last step the run saved (its latest checkpoint), or logged."""
  import tensorflow as tf

  if dry_run:
    # A dry run may be planned where the bucket is out of reach.
    try:
      return completed_step(workdir)
    except tf.errors.OpError as e:
      print(f'# cannot read {workdir}: {e.message.splitlines()[0]}')
      return None
  checkpoints = join(workdir, 'checkpoints')
  if tf.io.gfile.isdir(checkpoints):
    # Orbax writes `<step>.orbax-checkpoint-tmp-*` first: digits only count.
    steps = [
      int(n.rstrip('/'))
      for n in tf.io.gfile.listdir(checkpoints)
      if n.rstrip('/').isdigit()
    ]
    return max(steps, default=None)
  records = _read_lines(join(workdir, 'metrics.jsonl'))
  return max((r['step'] for r in records if 'step' in r), default=None)


def is_finished(workdir: str, num_steps: int) -> bool:
  step = completed_step(workdir)
  return step is not None and step >= num_steps


# Running.


# Launcher templates.


def load_template(launcher: str) -> str | None:
  """The command template --launcher names, or None for a built-in launcher.

  Raises SweepError for a value that is neither, or a template that names an
  unknown placeholder, has unbalanced quotes or passes no flags to the run.
  """
  if launcher in LAUNCHERS:
    return None
  if os.path.isfile(launcher):
    with open(launcher) as f:
      lines = [ln for ln in f.read().splitlines() if not ln.startswith('#')]
    template = '\n'.join(lines).strip()
  elif '{' in launcher:
    template = launcher
  else:
    raise SweepError(
      f'--launcher={launcher!r}: not one of {list(LAUNCHERS)}, a file, or a '
      f'command template with placeholders {{{"}, {".join(PLACEHOLDERS)}}}.'
    )
  fields = _template_fields(template)
  if not {'command', 'args'} & set(fields):
    raise SweepError(
      f'--launcher template {template!r} passes no flags to the run: it '
      'needs {command} or {args}.'
    )
  return template


def job_name(name: str) -> str:
  """A run name as Kubernetes names jobs: [a-z0-9-], a letter first, <= 39."""
  slug = re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')
  if not slug[:1].isalpha():
    slug = f'r-{slug}'.rstrip('-')
  digest = hashlib.sha1(name.encode()).hexdigest()[:6]
  return f'{slug[:32].rstrip("-")}-{digest}'


def _template_parts(template: str):
  """Yields (literal text, None) and (field, quote context) pieces.

  The context is '' outside quotes, "'" or '"' inside them, as a POSIX shell
  reads the template.
  """
  quote, i, text = '', 0, []
  while i < len(template):
    c = template[i]
    pair = template[i : i + 2]
    if pair in ('{{', '}}'):
      text.append(c)
      i += 2
      continue
    if c == '{':
      end = template.find('}', i)
      if end < 0:
        raise SweepError(f'--launcher template: unclosed {{ in {template!r}.')
      yield ''.join(text), None
      text = []
      yield template[i + 1 : end], quote
      i = end + 1
      continue
    if c == '}':
      raise SweepError(
        f"--launcher template: single '}}' in {template!r} (write '}}}}')."
      )
    if c == '\\' and quote != "'":
      text.append(template[i : i + 2])
      i += 2
      continue
    if c in '\'"' and quote in ('', c):
      quote = '' if quote else c
    text.append(c)
    i += 1
  if quote:
    raise SweepError(f'--launcher template: unclosed {quote} in {template!r}.')
  yield ''.join(text), None


def _template_fields(template: str) -> list[str]:
  fields = [f for f, q in _template_parts(template) if q is not None]
  unknown = sorted(set(fields) - set(PLACEHOLDERS))
  if unknown:
    raise SweepError(
      f'--launcher template names {unknown}; placeholders: '
      f'{", ".join("{" + p + "}" for p in PLACEHOLDERS)}.'
    )
  return fields


def render_template(template: str, values: dict[str, Any]) -> str:
  """The template with each placeholder quoted for where it stands.

  `values` maps a placeholder to a string (one word) or, for 'command' and
  'args', to an argv list. Outside quotes a value becomes shell words;
  inside quotes, the text a shell given the quoted string will read back as
  those words.
  """
  out = []
  for part, quote in _template_parts(template):
    if quote is None:
      out.append(part)
      continue
    value = values[part]
    if part == 'command':
      line = shlex.join(value)
      words = shlex.quote(line)  # one word: the whole command line
    elif part == 'args':
      line = words = shlex.join(value)
    else:
      line = words = shlex.quote(value)
    if quote == "'":
      out.append(line.replace("'", "'\\''"))
    elif quote == '"':
      out.append(re.sub(r'([\\"$`])', r'\\\1', line))
    else:
      out.append(words)
  return ''.join(out)


def _launch_command(
  launcher: str,
  argv: list[str],
  name: str,
  launcher_args: list[str],
  template: str | None = None,
) -> list[str] | str:
  """The argv (built-in launchers) or shell line (a template) of one run."""
  if template is not None:
    workdir = next(a for a in argv if a.startswith('--workdir='))
    return render_template(
      template,
      dict(
        name=name,
        job=job_name(name),
        workdir=workdir.split('=', 1)[1],
        command=['python', '-m', 'pretrain_lm.main', *argv],
        args=argv,
      ),
    )
  if launcher == 'local':
    return [sys.executable, '-m', 'pretrain_lm.main', *argv]
  if launcher == 'tpu_pod':
    script = os.path.join(REPO, 'launch', 'tpu_pod.sh')
    return [script, 'run', *launcher_args, *argv]
  script = os.path.join(REPO, 'launch', 'slurm.sbatch')
  return ['sbatch', f'--job-name={name}', *launcher_args, script, *argv]


Command = list[str] | str  # an argv, or a line for the shell


def _show(cmd: Command) -> str:
  return cmd if isinstance(cmd, str) else shlex.join(cmd)


def _run_all(
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
          print(f'[start] {name}{where}: {_show(cmd)}', flush=True)
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


def _write_sweep_json(root: str, record: dict) -> None:
  """Writes the run list; runs of earlier versions of the sweep stay listed."""
  import tensorflow as tf

  path = join(root, SWEEP_FILE)
  if tf.io.gfile.exists(path):
    with tf.io.gfile.GFile(path) as f:
      old = json.load(f)
    new_names = {r['name'] for r in record['runs']}
    kept = [r for r in old.get('runs', []) if r['name'] not in new_names]
    record = dict(record, runs=kept + record['runs'])
  tf.io.gfile.makedirs(root)
  with tf.io.gfile.GFile(path, 'w') as f:
    f.write(json.dumps(record, indent=2, default=repr) + '\n')


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
  template = load_template(launcher)
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
  runs = load_sweep(sweep_file)
  names = run_names(runs)
  try:
    resolve_config([f'--config={base}', *fixed])
  except SweepError as e:
    raise SweepError(f'--base={base} {shlex.join(fixed)}: {e}') from None

  # Every run is checked before the first one starts: a typo in run 7 must
  # not surface hours into the sweep.
  configs, errors = [], []
  for name, overrides in builtins.zip(names, runs, strict=True):
    try:
      configs.append(check_run(base, fixed, overrides))
    except SweepError as e:
      errors.append(f'  {name}: {e}')
  if errors:
    raise SweepError('Invalid runs, nothing started:\n' + '\n'.join(errors))

  records, commands, planned = [], [], 0
  for name, overrides, config in builtins.zip(
    names, runs, configs, strict=True
  ):
    workdir = join(workdir_root, name)
    argv = [
      f'--config={base}',
      f'--workdir={workdir}',
      *fixed,
      *override_flags(overrides),
    ]

    def build(slot, argv=argv, name=name):
      extra = [f'--tpu={slot}'] if slot else []
      return _launch_command(
        launcher, argv, name, [*launcher_args, *extra], template
      )

    # With --tpus the slice is the first free one; sweep.json lists them.
    records.append(
      dict(name=name, workdir=workdir, overrides=overrides, command=build(None))
    )
    step = completed_step(workdir, dry_run=dry_run)
    if step is not None and step >= config.train.num_steps:
      print(f'[skip] {name}: finished (step {step})', flush=True)
    elif dry_run:
      # The slices in turn here; a real sweep takes whichever is free.
      slot = tpus[planned % len(tpus)] if tpus else None
      planned += 1
      print(_show(build(slot)), flush=True)
    else:
      commands.append((name, build))
  if dry_run:
    return 0
  _write_sweep_json(
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
  codes = _run_all(commands, slots, log_root)
  failed = {n: c for n, c in codes.items() if c}
  print(
    f'{len(runs)} runs: {len(runs) - len(commands)} already finished, '
    f'{len(codes) - len(failed)} ran, {len(failed)} failed'
    + (f' {failed}' if failed else '')
    + '.',
    flush=True,
  )
  if any(c == EXIT_RESUME for c in failed.values()):
    return EXIT_RESUME
  return 1 if failed else 0


# Summaries.


def _fmt(value: Any) -> str:
  if value is None:
    return ''
  if isinstance(value, float):
    return f'{value:.4g}'
  return format_value(value)


def summary_rows(workdir_root: str) -> tuple[list[str], list[list[str]]]:
  """(header, rows): overrides, last step, train loss, eval metrics per run."""
  import tensorflow as tf

  if not tf.io.gfile.isdir(workdir_root):
    raise SweepError(
      f'{workdir_root} is not a directory: --summarize takes the '
      '--workdir_root of a sweep, or a directory of training workdirs.'
    )
  path = join(workdir_root, SWEEP_FILE)
  if tf.io.gfile.exists(path):
    with tf.io.gfile.GFile(path) as f:
      runs = json.load(f)['runs']
  else:  # a root of plain workdirs
    runs = [
      dict(name=n.rstrip('/'), workdir=join(workdir_root, n.rstrip('/')))
      for n in sorted(tf.io.gfile.listdir(workdir_root))
      if tf.io.gfile.exists(join(workdir_root, n.rstrip('/'), 'metrics.jsonl'))
    ]
  if not runs:
    raise SweepError(f'No runs in {workdir_root}.')
  overrides = [r.get('overrides', {}) for r in runs]
  label = labels(overrides)
  results, eval_keys = [], {}
  for run in runs:
    records = _read_lines(join(run['workdir'], 'metrics.jsonl'))
    train = [r for r in records if r.get('loss') is not None]
    evals = [r for r in records if any(k.startswith('eval_') for k in r)]
    last_eval = {k: v for k, v in (evals[-1] if evals else {}).items()}
    last_eval.pop('step', None)
    eval_keys.update(dict.fromkeys(last_eval))
    results.append(
      dict(
        step=max((r['step'] for r in records), default=None),
        loss=train[-1]['loss'] if train else None,
        **last_eval,
      )
    )
  header = ['run', *label.values(), 'step', 'loss', *sorted(eval_keys)]
  rows = [
    [
      run['name'],
      *(_fmt(o.get(k)) for k in label),
      *(_fmt(res.get(k)) for k in ['step', 'loss', *sorted(eval_keys)]),
    ]
    for run, o, res in builtins.zip(runs, overrides, results, strict=True)
  ]
  return header, rows


def summarize(workdir_root: str, fmt: str = 'markdown') -> str:
  """The sweep's results as a markdown or CSV table."""
  header, rows = summary_rows(workdir_root)
  if fmt == 'csv':
    out = io.StringIO()
    writer = csv.writer(out, lineterminator='\n')
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()
  if fmt != 'markdown':
    raise SweepError(f'--format={fmt!r}; valid: markdown, csv.')
  lines = [header, ['---'] * len(header), *rows]
  return '\n'.join('| ' + ' | '.join(line) + ' |' for line in lines) + '\n'


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m pretrain_lm.sweep',
    allow_abbrev=False,
    description=__doc__.split('\n', 1)[0],
    epilog='Arguments --config.x=y after the sweep file apply to every run.',
  )
  parser.add_argument('sweep_file', nargs='?', help='experiments/sweeps/*.py')
  parser.add_argument('--base', help='base config, configs/bert.py:size=small')
  parser.add_argument('--workdir_root', help='runs go to WORKDIR_ROOT/NAME')
  parser.add_argument(
    '--launcher',
    default='local',
    help=f'{"|".join(LAUNCHERS)}, a command template or a file with one',
  )
  parser.add_argument('--parallel', type=int, default=1)
  parser.add_argument(
    '--launcher_args',
    default='',
    help="flags for the launcher script, e.g. '--tpu=t --zone=z'",
  )
  parser.add_argument(
    '--tpus',
    default='',
    help='tpu_pod: slices to spread the runs over, a,b,c (one run each)',
  )
  parser.add_argument('--dry_run', action='store_true')
  parser.add_argument('--summarize', metavar='WORKDIR_ROOT')
  parser.add_argument(
    '--format', default='markdown', choices=('markdown', 'csv')
  )
  args, rest = parser.parse_known_args(argv)
  try:
    if args.summarize:
      print(summarize(args.summarize, args.format), end='')
      return 0
    if not (args.sweep_file and args.base and args.workdir_root):
      parser.error('a sweep file, --base and --workdir_root are required')
    return run_sweep(
      args.sweep_file,
      base=args.base,
      workdir_root=args.workdir_root,
      fixed=rest,
      launcher=args.launcher,
      parallel=args.parallel,
      launcher_args=shlex.split(args.launcher_args),
      tpus=[t for t in args.tpus.split(',') if t],
      dry_run=args.dry_run,
    )
  except (SweepError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
