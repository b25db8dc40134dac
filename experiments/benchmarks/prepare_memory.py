r"""Preparation throughput and peak memory: one JSON line per run.

  python experiments/benchmarks/prepare_memory.py --output=/tmp/prep_1gb -- \
      --config=configs/bert.py:size=tiny --config.data.source='/data/*.txt' \
      --config.data.tokenizer=/tmp/tok.model

Runs `python -m pretrain_lm.data.prepare ARGS --output=OUTPUT` and samples
the resident memory of its whole process tree (the driver and Beam's
workers) every 0.2 s: peak_rss_mb is the largest sum seen. mb_per_s is
text in (the source files' bytes) over the wall time.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import psutil

from pretrain_lm.data import records


def tree_rss(process: psutil.Process) -> int:
  """Bytes resident in `process` and all its descendants."""
  total = 0
  for p in [process, *process.children(recursive=True)]:
    try:
      total += p.memory_info().rss
    except psutil.NoSuchProcess:
      pass
  return total


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--output', required=True)
  parser.add_argument('args', nargs='*', help='prepare flags after --')
  a = parser.parse_args()
  cmd = [sys.executable, '-m', 'pretrain_lm.data.prepare', *a.args]
  cmd.append(f'--output={a.output}')
  start = time.perf_counter()
  proc = subprocess.Popen(
    cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
  )
  watched, peak = psutil.Process(proc.pid), 0
  while proc.poll() is None:
    peak = max(peak, tree_rss(watched))
    time.sleep(0.2)
  seconds = time.perf_counter() - start
  if proc.returncode:
    sys.exit(proc.stderr.read().decode()[-3000:])
  manifest = records.read_manifest(a.output)
  # A range's train and eval shards share their input: count it once.
  inputs = {
    (s['input']['path'], s['input']['start'], s['input']['stop'])
    for split in manifest['splits'].values()
    for s in split['shards']
  }
  text = sum(stop - start for _, start, stop in inputs)
  print(
    json.dumps(
      {
        'source': manifest['source']['spec'],
        'text_mb': text / 1e6,
        'seconds': seconds,
        'mb_per_s': text / 1e6 / seconds,
        'peak_rss_mb': peak / 1e6,
        'cores': len(os.sched_getaffinity(0)),
        'train_rows': manifest['splits']['train']['rows'],
        'shards': len(manifest['splits']['train']['shards']),
      }
    )
  )


if __name__ == '__main__':
  main()
