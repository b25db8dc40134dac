"""What a sweep's workdirs hold: finished steps, the run list, the summary."""

import csv
import io
import json
import os
from typing import Any

from pretrain_lm.sweep.spec import SweepError, format_value, labels

SWEEP_FILE = 'sweep.json'


def join(root: str, *names: str) -> str:
  """`root/name/...` for local paths and gs:// URLs alike."""
  if '://' in root:
    return '/'.join([root.rstrip('/'), *names])
  return os.path.join(root, *names)


def _read_lines(path: str) -> list[dict]:
  import tensorflow as tf

  if not tf.io.gfile.exists(path):
    return []
  with tf.io.gfile.GFile(path) as f:
    return [json.loads(line) for line in f if line.strip()]


# Finished runs.


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


# The run list.


def write_sweep_json(root: str, record: dict) -> None:
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
    for run, o, res in zip(runs, overrides, results, strict=True)
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
