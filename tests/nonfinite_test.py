"""A NaN/Inf loss or gradient never reaches the weights (train_step, run).

The injected fault is a corrupt batch: one token id past the vocabulary,
whose embedding lookup (jnp.take's default 'fill' mode) is NaN, so the
loss and every gradient are NaN.
"""

import functools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import (
  COMPILE_FLAGS,
  REPO,
  assert_trees_equal,
  load_config,
  read_metrics,
)

import pretrain_lm
from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import objectives, sharding, train
from pretrain_lm.data import pipeline
from pretrain_lm.training import loop
from pretrain_lm.training import state as state_lib

VOCAB = 512
LIMIT = 3  # train.max_consecutive_skips of the run test


def small_config(tokenizer_path):
  """BERT tiny, one layer, no dropout, rows of 32, batches of 8, 2x2x2."""
  c = load_config('bert', 'size=tiny')
  c.data.tokenizer = tokenizer_path
  c.model.vocab_size = VOCAB
  c.model.num_layers = 1  # compiles are what these tests spend time on
  # No dropout: a step's result then depends on its inputs, not its number.
  c.model.dropout_rate = 0.0
  c.model.attention_dropout_rate = 0.0
  c.data.seq_len = 32
  c.data.batch_size = 8
  c.data.shuffle_buffer = 64
  c.data.eval_batches = 1
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  c.optimizer.warmup_steps = 0  # the first step already moves the weights
  c.train.num_steps = 20
  c.train.log_every = 10  # metrics are read a step late between logs
  c.train.eval_every = 100
  c.train.max_consecutive_skips = LIMIT
  c.train.progress_bar = False
  c.checkpoint.every = 2
  c.checkpoint.keep = 10
  c.checkpoint.async_save = False
  return c


@pytest.fixture(scope='module')
def trainer(tokenizer_path, tmp_path_factory):
  """One Trainer (one compiled step) shared by the tests of this module."""
  c = small_config(tokenizer_path)
  return train.Trainer(c, str(tmp_path_factory.mktemp('run')))


def poison(batch, vocab_size):
  """A copy of `batch` with one out-of-vocabulary token: a NaN loss."""
  batch = {k: np.array(v) for k, v in batch.items()}
  batch['input_ids'][0, 0] = vocab_size
  return batch


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.mark.parametrize('accum', [1, 2])
def test_nonfinite_step_is_skipped_and_leaves_no_trace(trainer, accum):
  c = trainer.config
  # With 2 microbatches the NaN sits in the first of them.
  step_fn = trainer.train_step if accum == 1 else trainer.jit_step(accum)
  data = pipeline.train_iterator(
    c, trainer.tokenizer, objectives.row_transform(c)
  )
  good1, good2 = next(data), next(data)
  bad = poison(next(data), c.model.vocab_size)
  to_global = functools.partial(sharding.host_to_global, mesh=trainer.mesh)
  copy = lambda state: jax.tree.map(lambda x: x.copy(), state)  # donation
  with trainer.context():
    state = state_lib.create_train_state(
      jax.random.key(0),
      trainer.batch_shapes,
      model=trainer.model,
      tx=trainer.tx,
      shardings=trainer.shardings,
    )
    state, _ = step_fn(state, to_global(good1))
    before, never_bad = host(state), copy(state)
    state, bad_metrics = step_fn(state, to_global(bad))
    after_bad = host(state)
    state, metrics = step_fn(state, to_global(good2))
    want, want_metrics = step_fn(never_bad, to_global(good2))
  bad_metrics, metrics = host(bad_metrics), host(metrics)
  want_metrics = host(want_metrics)

  # The bad step: counted, and params, optimizer state (Adam's moments,
  # its count, hence the LR schedule) and RNG untouched, bit for bit.
  assert not np.isfinite(bad_metrics['loss'])
  assert bad_metrics['skipped'] == 1 and bad_metrics['skipped_total'] == 1
  for field in ('params', 'opt_state', 'rng'):
    assert_trees_equal(getattr(after_bad, field), getattr(before, field))
  # The data position moves on past the bad batch.
  assert after_bad.step == before.step + 1 == 2

  # The next good step is exactly the one the run would have taken had it
  # never seen the bad batch.
  assert metrics['skipped'] == 0 and metrics['skipped_total'] == 1
  assert want_metrics['skipped_total'] == 0
  assert np.isfinite(metrics['loss'])
  for key in ('loss', 'grad_norm', 'learning_rate'):
    assert metrics[key] == want_metrics[key], key
  got, want = host(state), host(want)
  assert_trees_equal(got.params, want.params)
  assert_trees_equal(got.opt_state, want.opt_state)
  assert got.step == 3
  unchanged = jax.tree.map(np.array_equal, got.params, before.params)
  assert not all(jax.tree.leaves(unchanged)), 'the good step did nothing'


def restore(trainer, step):
  """Checkpoint `step` of the trainer's workdir, on the host."""
  abstract = trainer.abstract_state()
  ckpt = checkpoint_lib.Checkpointer(
    os.path.join(trainer.workdir, checkpoint_lib.CHECKPOINT_DIR),
    keep=0,
    read_only=True,
  )
  try:
    return host(ckpt.restore(step, abstract)[0])
  finally:
    ckpt.close()


def test_consecutive_skips_stop_the_run_at_the_last_good_state(
  trainer, monkeypatch, capsys
):
  # Every batch from step 3 on is corrupt; steps 1 and 2 are good.
  first_bad = 3
  stage_data = trainer._stage_data

  def corrupt_from(step):
    batches, end, shapes = stage_data(step)

    def stream():
      for i, batch in enumerate(batches, start=step + 1):  # step it feeds
        yield batch if i < first_bad else poison(batch, VOCAB)

    return stream(), end, shapes

  monkeypatch.setattr(trainer, '_stage_data', corrupt_from)
  state = trainer.run()
  out = capsys.readouterr().out

  # Stopped right at the LIMIT-th skip, saying so, not asking to be rerun.
  stop = first_bad + LIMIT - 1
  assert int(state.step) == stop
  assert trainer.nonfinite_stop and not trainer.preempted
  assert f'Stopping at step {stop}: the last {LIMIT} steps had' in out, out
  for step in range(first_bad, stop + 1):
    assert f'Step {step}: non-finite loss or gradient' in out, out
  # The saved state is the last good one (step 2's), bit for bit.
  names = os.listdir(trainer.checkpointer.directory)
  steps = sorted(int(s) for s in names if s.isdigit())
  assert steps == [2, 4, stop], steps
  good, saved = restore(trainer, 2), restore(trainer, stop)
  for field in ('params', 'opt_state', 'rng'):
    assert_trees_equal(getattr(saved, field), getattr(good, field))
  assert saved.step == stop
  # The stop logs the steps since the last log, skips included.
  last = [r for r in read_metrics(trainer.workdir) if 'loss' in r][-1]
  assert last['step'] == stop
  assert last['skipped_total'] == LIMIT
  assert last['skipped'] == pytest.approx(LIMIT / stop)


def test_main_exits_with_its_own_code_not_resume(tmp_path, tokenizer_path):
  # A learning rate of 1e30 from the first step: the loss and gradients
  # are finite, the update's norm is not (it overflows float32), so every
  # step is skipped and the optimizer's count, hence the rate, stays put.
  flags = {
    'data.tokenizer': tokenizer_path,
    'model.vocab_size': VOCAB,
    'model.num_layers': 1,
    'data.seq_len': 32,
    'data.batch_size': 8,
    'data.shuffle_buffer': 64,
    'data.eval_batches': 1,
    'optimizer.learning_rate': 1e30,
    'optimizer.warmup_steps': 0,
    'train.num_steps': 20,
    'train.max_consecutive_skips': 2,
    'train.progress_bar': False,
  }
  workdir = str(tmp_path / 'run')
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'pretrain_lm.main',
      f'--config={REPO}/configs/bert.py:size=tiny',
      f'--workdir={workdir}',
      *[f'--config.{k}={v}' for k, v in flags.items()],
    ],
    cwd=REPO,
    env=dict(os.environ, XLA_FLAGS=COMPILE_FLAGS, JAX_PLATFORMS='cpu'),
    capture_output=True,
    text=True,
    timeout=600,
  )
  out = result.stdout + result.stderr
  assert result.returncode == loop.EXIT_NONFINITE != loop.EXIT_RESUME, out
  assert 'Stopping at step 2: the last 2 steps had' in out, out
  assert 'rerun to resume' not in out and 'Traceback' not in out, out
  # The checkpoint holds finite weights: the initial ones.
  loaded = pretrain_lm.load(workdir)
  assert loaded.step == 2
  for leaf in jax.tree.leaves(jax.device_get(loaded.params)):
    assert np.isfinite(leaf).all()
