"""Where a CPU train step's time outside its matrix products goes.

Compiles the config's train step as `python -m pretrain_lm.bench` does,
runs two untimed steps and profiles two more, then sums the CPU thunks
that are not products (not in `bench.profile.products`, the product
table's instructions: element-wise fusions, copies, reductions) by what
they came from, read off each fusion's op_name in the optimized HLO:

  .venv/bin/python experiments/benchmarks/non_products.py \\
      --config=configs/bert.py:size=base --batch_size=32

The figures are in README.md, Train step: CPU.
"""

import collections
import os
import re
import tempfile

import jax
from absl import app, flags
from ml_collections import config_flags

from pretrain_lm import validate
from pretrain_lm.bench import profile, step

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.')
_BATCH = flags.DEFINE_integer('batch_size', 32, 'Global batch.')

# (category, substrings of the op_name), first match wins; op_names are
# relative to jit(train_step).
CATEGORIES = (
  ('attention: softmax, its dropout, transposes', ('attention/attention.',)),
  ('dropout on the hidden states', ('Dropout',)),
  ('layer norms', ('_norm/',)),
  ('MLP: GELU, bias', ('/mlp/',)),
  ('vocabulary head', ('head',)),
  ('other model ops: residual adds, biases, embeddings', ('Model',)),
  ('loss, outside the model', ('jvp(', 'transpose(')),
  ('microbatch gradient sums', ('while/body',)),
  ('zeros for the sums', ('broadcast_in_dim',)),
  ('optimizer, clipping, non-finite select', ('',)),
)


def category(op_name: str) -> str:
  if not op_name:
    return 'no op_name'
  return next(
    name for name, keys in CATEGORIES if any(k in op_name for k in keys)
  )


def outside_products(config, directory: str) -> tuple[float, dict]:
  """(profiled step seconds, {category: ms per step}) of the thunks that
  are not products, with the workdir and trace under `directory`."""
  run = step.TrainBench(config, os.path.join(directory, 'workdir')).run
  for _ in range(2):
    run.state, metrics = run.step(run.state, run.batch)
    jax.block_until_ready(metrics)
  run.state, summary = profile.profile_steps(
    run.step,
    run.state,
    run.batch,
    steps=2,
    directory=os.path.join(directory, 'profile'),
  )
  hlo = run.step.as_text()
  found = profile.products(hlo)  # the product table's instructions
  sources = profile.hlo_sources(hlo)
  steps = summary['steps']
  totals = collections.Counter()
  for line, name, ms in profile.op_events(summary['trace']):
    if line != 'CPU thunks' or name in found:
      continue
    source = sources.get(re.sub(r'[.\-]', '_', name), '')
    totals[category(source.partition(' ')[2])] += ms / steps
  return summary['wall_s'] / steps, totals


def main(argv):
  del argv
  config = _CONFIG.value
  config.data.batch_size = _BATCH.value
  step.first_stage(config)
  validate.check_config(config)
  with tempfile.TemporaryDirectory(prefix='non_products_') as directory:
    step_s, totals = outside_products(config, directory)
  print(f'step {step_s:.2f} s wall (profiled)')
  print(f'{sum(totals.values()):9.1f} ms/step of thunks outside the products')
  for name, ms in totals.most_common():
    print(f'{ms:9.1f}  {name}')


if __name__ == '__main__':
  app.run(main)
