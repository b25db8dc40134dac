"""Every config preset trains on the bundled corpus and round-trips.

Each config file's `tiny` preset, and every objective's preset, trains for
a few dozen steps on the 8-device fake mesh laid out (data, fsdp, tensor) =
(2, 2, 2), shrunk to at most 2 layers (per stack), rows of 32 and batches
of 16: the loss must fall, the evaluation must run, the run's metrics and
files must be there, `pretrain_lm.load` must give back exactly the trained
params, and a resume exactly the whole train state. The objectives' noise
is tested statistically in their own test files; this is the end-to-end
check that each one trains. (Why so small: experiments/benchmarks/README.md,
"Test-suite time".)
"""

import glob
import json
import math
import os

import jax
import numpy as np
import pytest
from conftest import REPO, assert_trees_equal, load_config, read_metrics

import pretrain_lm
from pretrain_lm import configlib, objectives, train
from pretrain_lm.objectives import OBJECTIVES

CONFIGS = sorted(
  os.path.basename(p)[:-3]
  for p in glob.glob(os.path.join(REPO, 'configs', '*.py'))
)
VOCAB = 512  # conftest's tokenizer_path
STEPS = 30

# (config file, arg, objective.name, model overrides): every config file
# and every objective (with each of its options) at least once.
PRESETS = [
  ('bert', 'size=tiny', 'mlm', {}),
  ('bert', 'size=tiny,objective=whole_word', 'mlm', {}),
  ('bert', 'size=tiny,objective=span', 'mlm', {}),
  ('bert', 'size=tiny,objective=nsp', 'mlm', {}),
  ('roberta', 'size=tiny', 'mlm', {}),
  ('albert', 'size=tiny', 'mlm', {}),  # + sentence-order prediction
  ('electra', 'size=tiny', 'electra', {}),
  ('gpt', 'size=tiny', 'clm', {}),
  ('gpt', 'size=tiny,objective=prefix_lm', 'prefix_lm', {}),
  ('bilm', 'size=tiny', 'bilm', {}),
  ('t5', 'size=tiny', 'span_corruption', {}),
  # Scanned, rematerialised layers: parameters stacked on a 'layers' axis.
  (
    't5',
    'size=tiny',
    'span_corruption',
    {'scan_layers': True, 'remat': 'full'},
  ),
  ('bart', 'size=tiny', 'denoising', {}),
  ('ul2', 'size=tiny', 'ul2', {}),
  ('ul2', 'size=tiny,decoder', 'ul2_decoder', {}),
  ('xlnet', 'size=tiny', 'plm', {}),
]
# Runs in `make test-all` only (by test id). BERT's masking options change
# its stream only (the model and the step are the plain preset's);
# test_word_masking_presets_predict_whole_words checks their streams.
# T5's unscanned preset: its scanned, rematerialised run trains the same
# model and objective, and BART and UL2 train the unscanned encoder-decoder.
SLOW = {
  'bert:size=tiny,objective=whole_word',
  'bert:size=tiny,objective=span',
  't5:size=tiny',
}


def _id(name, arg, model_overrides):
  return f'{name}:{arg}' + ('+scan' if model_overrides else '')


def shrunk(name: str, arg: str, tokenizer_path: str, model_overrides=None):
  """The preset as this file trains it: 2x2x2 mesh, <= 2 layers, rows of 32.

  resume_test trains the same shapes, so with the suite's persistent
  compilation cache each preset's step is compiled once for both files.
  """
  c = load_config(name, arg)
  c.model.update(model_overrides or {})
  c.model.num_layers = min(c.model.num_layers, 2)
  if c.data.tokenizer_type != 'char':
    c.data.tokenizer = tokenizer_path
    # Room for the ids span corruption and UL2 reserve (sentinels, modes).
    c.model.vocab_size = VOCAB + 128
  c.data.seq_len = 32
  c.model.max_len = max(c.model.max_len, 128)
  c.data.batch_size = 16
  c.data.shuffle_buffer = 256
  c.data.eval_batches = 1
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  c.optimizer.warmup_steps = 3
  c.train.num_steps = STEPS
  c.train.log_every = 1
  c.train.eval_every = STEPS
  c.train.progress_bar = False
  c.checkpoint.every = STEPS
  c.checkpoint.async_save = True
  return c


def test_every_config_file_and_objective_is_covered():
  assert set(CONFIGS) == {name for name, *_ in PRESETS}
  # reconstruct is the plain autoencoder smoke objective, not a paper's.
  covered = {objective for _, _, objective, _ in PRESETS}
  assert covered == set(OBJECTIVES) - {'reconstruct'}


@pytest.mark.parametrize(
  'name, arg, objective, model_overrides',
  [
    pytest.param(
      n,
      a,
      objective,
      o,
      id=_id(n, a, o),
      marks=pytest.mark.slow if _id(n, a, o) in SLOW else (),
    )
    for n, a, objective, o in PRESETS
  ],
)
def test_preset_trains_loss_falls_and_round_trips_on_a_2x2x2_mesh(
  name, arg, objective, model_overrides, tmp_path, tokenizer_path
):
  c = shrunk(name, arg, tokenizer_path, model_overrides)
  assert c.objective.name == objective

  workdir = str(tmp_path / name)
  state = train.train_and_evaluate(c, workdir)
  assert int(state.step) == STEPS

  records = read_metrics(workdir)
  losses = [r['loss'] for r in records if 'loss' in r]
  assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
  # Five-step means; 0.3 nats is far beyond their step-to-step noise.
  first, last = np.mean(losses[:5]), np.mean(losses[-5:])
  assert first - last > 0.3, (first, last)
  evals = [r for r in records if 'eval_loss' in r]
  assert evals and math.isfinite(evals[-1]['eval_loss'])
  # What every run logs (throughput from the second step, after the
  # compile) and leaves in its workdir.
  for key in (
    'perplexity',
    'learning_rate',
    'grad_norm',
    'tokens_per_s',
    'model_tflops_per_s',
  ):
    assert key in records[1], records[1]
  assert os.path.isdir(os.path.join(workdir, 'tensorboard'))
  for file in ('config.json', 'run_metadata.json'):
    assert os.path.exists(os.path.join(workdir, file)), file
  with open(os.path.join(workdir, 'run_metadata.json')) as f:
    assert json.load(f)['starts'][0]['versions']['jax'] == jax.__version__

  loaded = pretrain_lm.load(workdir)
  assert loaded.step == STEPS and loaded.config.model.family == c.model.family
  # load read the run's copy of its tokenizer (workdir/tokenizer.model);
  # each checkpoint names the same special ids.
  meta = os.path.join(workdir, 'checkpoints', str(STEPS), 'meta', 'metadata')
  with open(meta) as f:
    assert json.load(f)['tokenizer']['special_ids'] == (
      loaded.tokenizer.special_ids
    )
  assert_trees_equal(state.params, loaded.params)

  # What a resume starts from: a new Trainer on the workdir restores the
  # whole state (step, params, optimizer state, RNG) bit for bit, with its
  # shardings, and accepts the checkpoint's tokenizer and data stream.
  # With each objective's stream restarting at its batch (resume_test) and
  # the step's draws folded from (state.rng, state.step), that is what
  # makes a resume of this preset exact; resume_test resumes one across
  # processes, and every objective under `make test-all`.
  trainer = train.Trainer(c, workdir)
  resumed = trainer.initial_state()
  trainer.checkpointer.close()
  assert trainer.data_start_step == 0
  assert_trees_equal(state, resumed)
  for a, b in zip(
    jax.tree.leaves(state), jax.tree.leaves(resumed), strict=True
  ):
    assert a.sharding == b.sharding, (a.sharding, b.sharding)


def test_word_masking_presets_predict_whole_words(tmp_path, tokenizer_path):
  """BERT's whole_word and span presets reach their masking: each predicts
  whole words (every piece of a word or none), the two choose differently,
  and the plain preset's token masking splits words. mlm_test checks the
  masking's statistics; the presets' runs are slow (SLOW)."""
  import tensorflow as tf

  from pretrain_lm.data import pipeline
  from pretrain_lm.data import tokenizer as tokenizer_lib
  from pretrain_lm.objectives import mlm

  chosen, splits = {}, {}
  for masking, arg in (
    ('token', 'size=tiny'),
    ('whole_word', 'size=tiny,objective=whole_word'),
    ('span', 'size=tiny,objective=span'),
  ):
    c = shrunk('bert', arg, tokenizer_path)
    assert c.objective.masking == masking
    tokenizer = tokenizer_lib.setup_tokenizer(
      c.data, vocab_size=c.model.vocab_size, workdir=str(tmp_path / masking)
    )
    special = [
      tokenizer.pad_id,
      tokenizer.cls_id,
      tokenizer.sep_id,
      tokenizer.mask_id,
    ]
    batches = pipeline.train_dataset(
      c, tokenizer, objectives.row_transform(c)
    ).take(4)
    chosen[masking], splits[masking] = [], 0
    for batch in batches.as_numpy_iterator():
      for r, corrupted in enumerate(batch['input_ids']):
        weights = batch['masked_weights'][r] > 0
        positions = batch['masked_positions'][r][weights]
        row = corrupted.copy()  # the row before masking
        row[positions] = batch['masked_ids'][r][weights]
        is_candidate = ~np.isin(row, special)
        words = mlm._words(
          tf.constant(row), tf.constant(is_candidate), tokenizer
        )[0].numpy()
        lengths = np.bincount(words[words >= 0])
        hits = np.bincount(words[positions], minlength=len(lengths))
        # Rows where some word is predicted in part.
        splits[masking] += int(np.any((hits > 0) & (hits < lengths)))
        chosen[masking].append(tuple(positions))
  assert splits['whole_word'] == splits['span'] == 0, splits
  assert splits['token'] > 0, splits
  assert chosen['whole_word'] != chosen['span']


def test_load_file_is_what_the_config_flag_loads():
  path = os.path.join(REPO, 'configs', 'bert.py')
  loaded = configlib.load_file(f'{path}:size=tiny,objective=nsp')
  assert loaded == load_config('bert', 'size=tiny,objective=nsp')
  with pytest.raises(FileNotFoundError, match='no_such.py'):
    configlib.load_file('configs/no_such.py:size=tiny')
