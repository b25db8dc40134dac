r"""Compile time of a config's state initialisation, and its fusion count.

  .venv/bin/python experiments/benchmarks/init_compile.py \
      --config=configs/t5.py:size=base --config.model.dtype=bfloat16 \
      [--config.model.scan_layers=True]

Times `jax.jit(training.state.init_fn)` lowered and compiled for this machine's
backend on the config's batch shapes (batch 8), the program
Trainer.initial_state runs on a fresh start, and counts the fusions XLA
made of it: every parameter's random initialiser is inlined, so unscanned
layers multiply them. Prints one JSON line.
"""

import functools
import json
import re
import shutil
import sys
import tempfile
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from pretrain_lm import train
from pretrain_lm.training import state as state_lib

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Run config.')
flags.mark_flags_as_required(['config'])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  config.data.batch_size = 8
  workdir = tempfile.mkdtemp(prefix='init_compile_')
  try:
    trainer = train.Trainer(config, workdir)
    init = functools.partial(
      state_lib.init_fn, model=trainer.model, tx=trainer.tx
    )
    with trainer.context():
      lowered = jax.jit(init).lower(jax.random.key(0), trainer.batch_shapes)
      start = time.perf_counter()
      compiled = lowered.compile()
      compile_s = time.perf_counter() - start
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  print(
    json.dumps(
      {
        'args': ' '.join(sys.argv[1:]),
        'backend': jax.default_backend(),
        'scan_layers': config.model.scan_layers,
        'init_compile_s': round(compile_s, 2),
        'lowered_lines': len(lowered.as_text().splitlines()),
        'fusions': len(re.findall(r' fusion\(', compiled.as_text())),
      }
    )
  )


if __name__ == '__main__':
  app.run(main)
