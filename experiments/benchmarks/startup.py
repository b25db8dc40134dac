r"""Start-up costs of a run: building the input pipeline, the first checksums.

  python experiments/benchmarks/startup.py --config=configs/bilm.py:size=tiny

Builds the config's Trainer on 8 fake CPU devices laid out (data, fsdp,
tensor) = (2, 2, 2), rows of 64, batches of 16 (the test suite's shapes),
then times, in this order:
  pipeline        - pipeline.train_dataset as shipped (tf.data functions
                    wrapped in sources.no_autograph); the second build, so
                    TF's own first-use costs are not in it;
  pipeline_ag     - the same with AutoGraph converting every function (what
                    tf.data does to an unwrapped function);
  checksums_host  - checkpoint.checksums of the initial TrainState (arrays
                    in CPU memory: summed in NumPy);
  checksums_xla   - the on-device sum (one jit over all leaves), first call
                    (trace + compile + run) and second call (run).
Prints a markdown table row per figure.
"""

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time

os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
)
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ['JAX_PLATFORMS'] = 'cpu'

import jax  # noqa: E402
import tensorflow as tf  # noqa: E402

from pretrain_lm import checkpoint, configlib, train  # noqa: E402
from pretrain_lm.checkpoint import integrity  # noqa: E402
from pretrain_lm.data import pipeline  # noqa: E402


def timed(fn):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='configs/bilm.py:size=tiny')
  args = parser.parse_args(argv)

  c = configlib.load_file(args.config)
  if c.data.tokenizer_type != 'char':
    c.model.vocab_size = 640
    c.data.tokenizer_max_docs = 2000
  c.data.seq_len = 64
  c.model.max_len = max(c.model.max_len, 128)
  c.data.batch_size = 16
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  workdir = tempfile.mkdtemp(prefix='startup_')
  atexit.register(shutil.rmtree, workdir, ignore_errors=True)
  trainer = train.Trainer(c, workdir)  # builds the pipeline once
  state = trainer.initial_state()

  def build():
    pipeline.train_dataset(c, trainer.tokenizer, trainer.row_transform)

  rows = {'pipeline': timed(build)}
  shipped = tf.autograph.experimental.do_not_convert
  tf.autograph.experimental.do_not_convert = lambda fn: fn
  try:
    rows['pipeline_ag'] = timed(build)
  finally:
    tf.autograph.experimental.do_not_convert = shipped

  flat = checkpoint.flatten(state)
  rows['checksums_host'] = timed(lambda: checkpoint.checksums(state))
  rows['checksums_xla first'] = timed(lambda: integrity._device_checksums(flat))
  rows['checksums_xla again'] = timed(lambda: integrity._device_checksums(flat))
  leaves = jax.tree.leaves(state)
  words = sum(x.size for x in leaves)
  print(f'{args.config}: {len(leaves)} state arrays, {words:,} elements')
  print('| what | seconds |\n|---|---:|')
  for name, seconds in rows.items():
    print(f'| {name} | {seconds:.2f} |')


if __name__ == '__main__':
  sys.exit(main())
