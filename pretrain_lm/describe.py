r"""What a workdir's checkpoints hold: `python -m pretrain_lm.describe WORKDIR`.

  python -m pretrain_lm.describe /tmp/run [--step=N] [--json] [--full_config]

Lists the checkpoints (step, when saved, size on disk, the eval metrics
logged at that step), sums the run's wall time over its starts into goodput
and badput by cause (pretrain_lm/goodput.py), and describes one
checkpoint, the latest by default, from what it recorded: its config (as a
diff against the workdir's config.json, or in full), git commit, package
versions, mesh, process count, tokenizer hash, data stream fingerprint,
and the params' names, shapes and dtypes, read from
Orbax's metadata without loading an array. Files are read through
tf.io.gfile and Orbax, so gs:// workdirs work; JAX stays on the CPU.
In Python: `describe(workdir, step)` returns the same as a dict.
"""

import argparse
import datetime
import hashlib
import json
import math
import os
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp
import tensorflow as tf
from absl import logging
from etils import epath

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import goodput
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import tokenizer as tokenizer_lib


def _flatten(tree: Any, prefix: str = '') -> dict[str, Any]:
  """Nested dicts as {'a.b.c': leaf}."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flatten(v, f'{prefix}.{k}' if prefix else str(k)))
  return out


def _size_on_disk(path: str) -> int:
  """Bytes of every file under `path`."""
  total = 0
  for root, _, files in tf.io.gfile.walk(path):
    total += sum(tf.io.gfile.stat(os.path.join(root, f)).length for f in files)
  return total


def _saved_time(step_dir: str, meta: dict) -> str | None:
  """When the checkpoint was written: its meta's, else Orbax's commit time."""
  if meta.get('run', {}).get('saved'):
    return meta['run']['saved']
  path = os.path.join(step_dir, '_CHECKPOINT_METADATA')
  if not tf.io.gfile.exists(path):
    return None
  nsecs = workdir_lib.read_json(path).get('commit_timestamp_nsecs')
  if not nsecs:
    return None
  # Orbax's timestamps are UTC nanoseconds; shown as the meta's are.
  when = datetime.datetime.fromtimestamp(nsecs / 1e9, datetime.UTC)
  return when.strftime('%Y-%m-%dT%H:%M:%SZ')


def _eval_metrics(workdir: str) -> dict[int, dict[str, float]]:
  """Step -> the eval_* metrics logged at it (metrics.jsonl)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  out = {}
  if not tf.io.gfile.exists(path):
    return out
  with tf.io.gfile.GFile(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:  # a line cut short by a killed run
        continue
      evals = {k: v for k, v in record.items() if k.startswith('eval_')}
      if evals and 'step' in record:
        out.setdefault(int(record['step']), {}).update(evals)
  return out


def _params(state_dir: str) -> dict[str, Any]:
  """The params' [name, shape, dtype] and total size, from Orbax metadata."""
  tree = ocp.StandardCheckpointHandler().metadata(epath.Path(state_dir)).tree
  leaves = jax.tree_util.tree_flatten_with_path(tree.get('params', {}))[0]
  arrays = [
    [
      jax.tree_util.keystr(path, simple=True, separator='/'),
      list(leaf.shape),
      str(leaf.dtype),
    ]
    for path, leaf in leaves
  ]
  return {
    'count': sum(math.prod(shape) for _, shape, _ in arrays),
    'arrays': arrays,
  }


def _tokenizer(workdir: str, saved: dict | None) -> dict[str, Any] | None:
  """The meta's tokenizer facts, and whether the workdir's file matches."""
  if not saved:
    return None
  out = dict(saved)
  path = os.path.join(workdir, tokenizer_lib.WORKDIR_FILENAME)
  if 'sha256' in saved and tf.io.gfile.exists(path):
    with tf.io.gfile.GFile(path, 'rb') as f:
      sha = hashlib.sha256(f.read()).hexdigest()
    out['matches_workdir_file'] = sha == saved['sha256']
  return out


def _steps(directory: str) -> list[int]:
  """The checkpoint steps saved in `directory`; [] if none (or no directory)."""
  if not tf.io.gfile.isdir(directory):
    return []
  checkpointer = checkpoint_lib.Checkpointer(directory, keep=0, read_only=True)
  steps = checkpointer.all_steps()
  checkpointer.close()
  return steps


def _listing(workdir: str, directory: str, steps: list[int]) -> list[dict]:
  """One entry per checkpoint: step, when saved, bytes on disk, eval metrics."""
  evals = _eval_metrics(workdir)
  listing = []
  for s in steps:
    step_dir = os.path.join(directory, str(s))
    meta = checkpoint_lib.read_meta(directory, s) or {}
    listing.append(
      {
        'step': s,
        'saved': _saved_time(step_dir, meta),
        'bytes': _size_on_disk(step_dir),
        # Stored with the checkpoint when saved with an evaluation (eval
        # steps), else what metrics.jsonl logged at that step.
        'eval': meta.get(checkpoint_lib.EVAL_METRICS_KEY) or evals.get(s, {}),
      }
    )
  return listing


def _config_diff(run: dict, workdir_config: dict | None) -> dict | None:
  """{field: [the checkpoint's value, config.json's]} where they differ.

  None when either config is missing.
  """
  if 'config' not in run or workdir_config is None:
    return None
  saved, now = _flatten(run['config']), _flatten(workdir_config)
  return {
    k: [saved.get(k), now.get(k)]
    for k in sorted(saved.keys() | now.keys())
    if saved.get(k) != now.get(k)
  }


def _checkpoint(
  workdir: str, directory: str, step: int, saved: str | None
) -> dict[str, Any]:
  """What checkpoint `step` recorded of its run, config and params."""
  meta = checkpoint_lib.read_meta(directory, step) or {}
  run = meta.get('run', {})
  config_path = os.path.join(workdir, 'config.json')
  workdir_config = (
    workdir_lib.read_json(config_path)
    if tf.io.gfile.exists(config_path)
    else None
  )
  return {
    'saved': saved,
    # From before checkpoints described themselves: only config.json.
    'recorded': bool(run),
    'config': run.get('config', workdir_config),
    # {field: [this checkpoint's value, config.json's]}
    'config_diff_vs_config_json': _config_diff(run, workdir_config),
    'git_commit': run.get('git_commit'),
    'versions': run.get('versions'),
    'mesh': run.get('mesh'),
    'process_count': run.get('process_count'),
    'device_count': run.get('device_count'),
    'device_kind': run.get('device_kind'),
    'platform': run.get('platform'),
    'model_family': meta.get('model_family'),
    'objective': meta.get('objective'),
    'batches_consumed': meta.get('batches_consumed'),
    'tokenizer': _tokenizer(workdir, meta.get('tokenizer')),
    'data': meta.get('data'),
    'params': _params(os.path.join(directory, str(step), 'state')),
  }


def describe(workdir: str, step: int | None = None) -> dict[str, Any]:
  """The workdir's checkpoints, and checkpoint `step` (default: the latest).

  Raises FileNotFoundError naming the directory when there is no checkpoint.
  """
  workdir = workdir_lib.absolute(workdir)
  directory = checkpoint_lib.checkpoint_dir(workdir)
  steps = _steps(directory)
  if not steps:
    raise FileNotFoundError(
      f'No checkpoint in {directory!r}: not a pretrain_lm workdir, or no '
      'checkpoint saved yet.'
    )
  step = steps[-1] if step is None else step
  if step not in steps:
    raise FileNotFoundError(
      f'No checkpoint {step} in {directory!r}; there are {steps}.'
    )
  listing = _listing(workdir, directory, steps)
  saved = listing[steps.index(step)]['saved']
  return {
    'workdir': workdir,
    'directory': directory,
    'checkpoints': listing,
    # Wall time over every start of the run, by cause (goodput.summarize).
    'goodput': goodput.summarize(goodput.read_records(workdir)),
    'step': step,
    'checkpoint': _checkpoint(workdir, directory, step, saved),
  }


def _megabytes(n: int) -> str:
  return f'{n / 1e6:.1f} MB'


def format_text(d: dict[str, Any], full_config: bool = False) -> str:
  """describe()'s dict as the command prints it."""
  c = d['checkpoint']
  lines = [f'Checkpoints in {d["directory"]}:']
  for item in d['checkpoints']:
    evals = '  '.join(f'{k}={v:.4g}' for k, v in sorted(item['eval'].items()))
    mark = '*' if item['step'] == d['step'] else ' '
    lines.append(
      f'{mark} step {item["step"]:>8}  {item["saved"] or "?":20}  '
      f'{_megabytes(item["bytes"]):>10}  {evals}'.rstrip()
    )
  if d.get('goodput'):
    lines += ['', goodput.format_summary(d['goodput'])]
  lines += ['', f'Checkpoint {d["step"]} (saved {c["saved"] or "?"}):']
  if not c['recorded']:
    lines.append(
      '  (written before checkpoints recorded their run: config, commit '
      'and versions are in config.json and run_metadata.json)'
    )
  else:
    mesh = ' x '.join(f'{k}={v}' for k, v in (c['mesh'] or {}).items())
    lines += [
      f'  git commit:   {c["git_commit"]}',
      f'  mesh:         {mesh} on {c["device_count"]} {c["device_kind"]} '
      f'device(s), {c["process_count"]} process(es)',
      '  versions:     '
      + ', '.join(f'{k} {v}' for k, v in (c['versions'] or {}).items()),
    ]
  lines.append(
    f'  model:        {c["model_family"]}, objective {c["objective"]}'
  )
  tok = c['tokenizer']
  if tok:
    check = {True: ' (= the workdir file)', False: ' (workdir file DIFFERS)'}
    lines.append(
      f'  tokenizer:    {tok["vocab_size"]} pieces, sha256 '
      f'{tok.get("sha256", "not recorded")}'
      + check.get(tok.get('matches_workdir_file'), '')
    )
  data = c['data']
  if data:
    lines.append(
      f'  data stream:  fingerprint {data["fingerprint"]}, read from step '
      f'{data["start_step"]} ({c["batches_consumed"]} batches consumed)'
    )
    lines += [f'    {k} = {v!r}' for k, v in sorted(data['fields'].items())]
    lines.append(f'    (data.source = {data["source"]!r})')
  if full_config or c['config_diff_vs_config_json'] is None:
    lines.append('  config:' if c['recorded'] else '  config (config.json):')
    lines += [
      f'    {k} = {v!r}' for k, v in sorted(_flatten(c['config'] or {}).items())
    ]
  elif c['config_diff_vs_config_json']:
    lines.append(
      '  config: differs from config.json (this checkpoint -> file):'
    )
    lines += [
      f'    {k}: {a!r} -> {b!r}'
      for k, (a, b) in c['config_diff_vs_config_json'].items()
    ]
  else:
    lines.append(
      '  config:       the same as config.json (--full_config shows it)'
    )
  params = c['params']
  lines.append(
    f'  params:       {params["count"]:,} in {len(params["arrays"])} arrays'
  )
  width = max((len(name) for name, _, _ in params['arrays']), default=0)
  lines += [
    f'    {name:{width}}  {tuple(shape)!s:16} {dtype}'
    for name, shape, dtype in params['arrays']
  ]
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  """The command line; returns the exit code."""
  parser = argparse.ArgumentParser(
    prog='python -m pretrain_lm.describe',
    description="Lists a workdir's checkpoints and describes one.",
  )
  parser.add_argument('workdir', help='a training workdir (or gs:// path)')
  parser.add_argument('--step', type=int, help='default: the latest')
  parser.add_argument('--json', action='store_true', help='print JSON')
  parser.add_argument(
    '--full_config',
    action='store_true',
    help='print the whole config, not its diff against config.json',
  )
  args = parser.parse_args(argv)
  # Reading metadata needs no accelerator, and another process may hold it.
  jax.config.update('jax_platforms', 'cpu')
  # Orbax warns at every read-only open; the answer goes to stdout.
  logging.set_verbosity(logging.ERROR)
  try:
    d = describe(args.workdir, args.step)
  except FileNotFoundError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(
    json.dumps(d, indent=2) if args.json else format_text(d, args.full_config)
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
