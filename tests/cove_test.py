"""CoVe (head.cove): an encoder-decoder's frozen encoder as features."""

import dataclasses
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
  COMPILE_FLAGS,
  REPO,
  load_config,
  one_device,
  read_metrics,
  tiny_cfg,
)
from flax import linen as nn

import pretrain_lm
from pretrain_lm import sharding
from pretrain_lm.finetune import model as model_lib
from pretrain_lm.finetune import optimizer as ft_optimizer
from pretrain_lm.finetune import trainer
from pretrain_lm.models import encoder_decoder as encoder_decoder_lib
from pretrain_lm.training import state as state_lib
from pretrain_lm.training import step as step_lib


def leaves(tree) -> dict:
  flat = jax.tree_util.tree_leaves_with_path(tree)
  return {ft_optimizer.path_names(p): np.asarray(v) for p, v in flat}


@pytest.fixture(scope='module')
def t5(tiny_workdir):
  return tiny_workdir('t5', 'size=tiny')


def test_features_are_the_token_rows_then_the_encoders_output(t5):
  m = pretrain_lm.load(t5)
  cfg, params = m.model.cfg, m.params
  states = m.embed(['a short text', 'another, longer piece of text'])
  ids, mask = states.ids, states.mask
  E, D = cfg.token_dim, cfg.emb_dim
  # A token head whose kernel is the identity hands back its input: the
  # features [B, L, E + D] themselves.
  model = model_lib.FinetuneModel(
    cfg, 'token', E + D, cove=True, freeze_backbone=True
  )
  body = {k: v for k, v in params.items() if not k.startswith('decoder')}
  body.pop('lm_head', None)
  head = {
    'token_kernel': jnp.eye(E + D, dtype=jnp.float32),
    'token_bias': jnp.zeros((E + D,), jnp.float32),
  }
  batch = {'input_ids': ids, 'input_mask': mask}
  x = np.asarray(
    model.apply(
      {'params': {'backbone': body, **head}}, batch, deterministic=True
    )['token_logits']
  )
  table = np.asarray(params['token_embed']['embedding'])
  np.testing.assert_array_equal(x[..., :E], table[ids])
  real = mask > 0
  # Pretrained.embed's encoder states, and a direct call of the encoder.
  np.testing.assert_allclose(
    x[..., E:][real], states.states[real], rtol=1e-5, atol=1e-5
  )
  encoded, _ = encoder_decoder_lib.EncoderDecoderModel(cfg).apply(
    {'params': params},
    {'encoder_input_ids': ids, 'encoder_input_mask': mask},
    deterministic=True,
    method=encoder_decoder_lib.EncoderDecoderModel.encode,
  )
  np.testing.assert_allclose(
    x[..., E:], np.asarray(encoded), rtol=1e-5, atol=1e-5
  )


def sst2_cove(init: str):
  """configs/finetune/glue.py:task=sst2,recipe=cove, shrunk for a test."""
  c = load_config('finetune/glue', 'task=sst2,recipe=cove')
  assert c.head.cove and c.head.cove_embeddings and c.head.freeze_backbone
  c.init.workdir = init
  c.task.seq_len = 32
  c.task.max_train_examples = 32
  c.task.max_eval_examples = 32
  c.data.batch_size = 8
  c.train.progress_bar = False
  c.checkpoint.async_save = False
  return c


def test_the_encoder_gets_no_gradient_and_the_decoder_is_not_held(t5, tmp_path):
  run = trainer.Trainer(sst2_cove(t5), str(tmp_path), one_device())
  state = run.initial_state()
  body = leaves(state.params['backbone'])
  # No decoder or LM head (T5's encoder_embeddings have no params).
  names = {k[0] for k in body}
  assert {'token_embed', 'encoder'} <= names, names
  assert names <= {'token_embed', 'encoder_embeddings', 'encoder'}, names
  pretrained = leaves(pretrain_lm.load(t5).params)
  for k, v in body.items():
    np.testing.assert_array_equal(v, pretrained[k], err_msg=str(k))
  # Plain SGD, no freezing transform: whatever moves had a gradient.
  tx = optax.sgd(1.0)
  with run.context():
    shardings = state_lib.shardings_of(
      state_lib.abstract_train_state(run.model, tx, run.batch_shapes, run.mesh)
    )
    sgd = state_lib.create_train_state(
      jax.random.key(0),
      run.batch_shapes,
      model=run.model,
      tx=tx,
      shardings=shardings,
    )
    sgd = sgd.replace(params=state.params)
    before = leaves(jax.device_get(sgd.params))
    step = step_lib.jit_train_step(
      run.model, tx, run.loss_fn, run.schedule, shardings, run.mesh
    )
    batch = sharding.host_to_global(run.train_batch(0), run.mesh)
    sgd, _ = step(sgd, batch)
  after = leaves(jax.device_get(sgd.params))
  for k, v in before.items():
    if k[0] == 'backbone':
      np.testing.assert_array_equal(after[k], v, err_msg=str(k))
  assert not np.array_equal(
    after[('classifier_kernel',)], before[('classifier_kernel',)]
  )


def test_sst2_through_the_cli_loss_falls_body_unchanged(t5, tmp_path):
  workdir = tmp_path / 'run'
  overrides = {
    'task.seq_len': 32,
    'task.max_train_examples': 32,
    'task.max_eval_examples': 32,
    'data.batch_size': 8,
    'train.num_steps': 24,
    'train.log_every': 8,
    'train.progress_bar': False,
    'optimizer.learning_rate': 3e-3,
    'mesh.data': 1,
  }
  cmd = [
    sys.executable,
    '-m',
    'pretrain_lm.finetune',
    '--config=configs/finetune/glue.py:task=sst2,recipe=cove',
    f'--init={t5}',
    f'--workdir={workdir}',
  ] + [f'--config.{k}={v}' for k, v in overrides.items()]
  env = dict(os.environ, XLA_FLAGS=COMPILE_FLAGS)  # one CPU device
  out = subprocess.run(
    cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'Dev accuracy: ' in out.stdout, out.stdout
  losses = [m['loss'] for m in read_metrics(str(workdir)) if 'loss' in m]
  assert len(losses) == 3 and all(map(math.isfinite, losses)), losses
  assert losses[-1] < losses[0], losses
  final = trainer.load(str(workdir), best=False)
  assert final.step == 24
  pretrained = leaves(pretrain_lm.load(t5).params)
  for k, v in leaves(final.params['backbone']).items():
    np.testing.assert_array_equal(v, pretrained[k], err_msg=str(k))


def test_conll_tagging_on_the_encoder_loss_falls(t5, tmp_path):
  data = tmp_path / 'data'
  data.mkdir()
  for name in ('train.txt', 'valid.txt'):
    with open(os.path.join(REPO, 'tests', 'data', 'conll', name)) as f:
      (data / name).write_text(f.read())
  c = load_config('finetune/conll', f'data={data},recipe=cove')
  c.init.workdir = t5
  c.task.seq_len = 64
  c.data.batch_size = 4  # the fixture has 5 training sentences
  c.train.num_steps = 20
  c.train.log_every = 5
  c.train.eval_every = 20
  c.train.progress_bar = False
  c.optimizer.learning_rate = 3e-3
  c.checkpoint.async_save = False
  results = trainer.finetune(c, str(tmp_path / 'run'), one_device())
  assert 0.0 <= results['final']['eval_f1'] <= 100.0
  losses = [r['loss'] for r in read_metrics(tmp_path / 'run') if 'loss' in r]
  assert len(losses) == 4 and all(map(math.isfinite, losses)), losses
  assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.parametrize('family', ['encoder', 'decoder', 'bilm'])
def test_other_families_are_refused_naming_field_and_family(family):
  with pytest.raises(ValueError, match=rf"head\.cove.*'{family}'"):
    model_lib.FinetuneModel(tiny_cfg(family), 'classification', 2, cove=True)


def test_the_scalar_mix_is_over_the_encoders_layers():
  cfg = dataclasses.replace(tiny_cfg('encoder_decoder'), num_decoder_layers=4)
  model = model_lib.FinetuneModel(cfg, 'token', 3, cove=True, scalar_mix=True)
  batch = {
    'input_ids': jnp.ones((2, 8), jnp.int32),
    'input_mask': jnp.ones((2, 8), jnp.int32),
  }
  params = nn.meta.unbox(
    jax.eval_shape(
      lambda: model.init(jax.random.key(0), batch, deterministic=True)
    )
  )['params']
  assert set(params['backbone']) == {
    'token_embed',
    'encoder_embeddings',
    'encoder',
  }
  # The embedding output and 2 encoder layers (the decoder has 4).
  assert params['scalar_mix']['weights'].shape == (3,)
  assert params['token_kernel'].shape == (32 + 32, 3)
