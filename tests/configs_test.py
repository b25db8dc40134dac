"""Every config file's `tiny` preset trains and round-trips a checkpoint.

Two steps on the 8-device fake mesh laid out (data, fsdp, tensor) = (2, 2,
2), then `pretrain_lm.load` must give back exactly the trained params.
"""

import glob
import importlib.util
import json
import math
import os

import jax
import numpy as np
import pytest

import pretrain_lm
from pretrain_lm import train
from pretrain_lm.data import sources
from pretrain_lm.data import tokenizer as tokenizer_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(
  os.path.basename(p)[:-3]
  for p in glob.glob(os.path.join(REPO, 'configs', '*.py'))
)
VOCAB = 512


def get_config(name: str, arg: str):
  path = os.path.join(REPO, 'configs', f'{name}.py')
  spec = importlib.util.spec_from_file_location(f'{name}_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.fixture(scope='module')
def wordpiece_tokenizer(tmp_path_factory):
  """A small SentencePiece model for the configs that train one."""
  path = str(tmp_path_factory.mktemp('tok') / 'tokenizer.model')
  c = get_config('bert', 'size=tiny')
  texts = sources.iter_texts(c.data, limit=2000)
  tokenizer_lib.train_tokenizer(texts, path, vocab_size=VOCAB)
  return path


def test_every_config_file_is_covered():
  assert set(CONFIGS) >= {
    'bert',
    'roberta',
    'albert',
    'electra',
    'gpt',
    't5',
    'bart',
  }


@pytest.mark.parametrize(
  'name, model_overrides',
  [(name, {}) for name in CONFIGS]
  # Scanned, rematerialised layers: parameters stacked on a 'layers' axis.
  + [('t5', {'scan_layers': True, 'remat': 'full'})],
)
def test_tiny_preset_trains_and_round_trips_on_a_2x2x2_mesh(
  name, model_overrides, tmp_path, wordpiece_tokenizer
):
  c = get_config(name, 'size=tiny')
  c.model.update(model_overrides)
  if c.data.tokenizer_type != 'char':
    c.data.tokenizer = wordpiece_tokenizer
    c.model.vocab_size = VOCAB
  c.data.seq_len = min(c.data.seq_len, 32)
  c.model.max_len = max(c.model.max_len, 32)
  c.data.batch_size = 8
  c.data.shuffle_buffer = 16
  c.data.eval_batches = 1
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  c.train.num_steps = 2
  c.train.log_every = 1
  c.train.eval_every = 2
  c.train.progress_bar = False
  c.checkpoint.every = 2
  c.checkpoint.async_save = True

  workdir = str(tmp_path / name)
  state = train.train_and_evaluate(c, workdir)
  assert int(state.step) == 2

  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  losses = [r['loss'] for r in records if 'loss' in r]
  assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
  assert any('eval_loss' in r for r in records)

  loaded = pretrain_lm.load(workdir)
  assert loaded.step == 2 and loaded.config.model.family == c.model.family
  trained = jax.device_get(state.params)
  restored = jax.device_get(loaded.params)
  assert jax.tree.structure(trained) == jax.tree.structure(restored)
  for a, b in zip(
    jax.tree.leaves(trained), jax.tree.leaves(restored), strict=True
  ):
    np.testing.assert_array_equal(a, b)
