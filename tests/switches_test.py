"""The switches for big runs: gradient accumulation, bf16 activations,
LAMB/Adafactor, the sequence-length schedule, remat/scan in every family."""

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
  assert_same_step,
  assert_trees_equal,
  load_config,
  one_step,
  read_metrics,
  scratch_bytes,
  sgd_steps,
)

from pretrain_lm import objectives, sharding, train, validate
from pretrain_lm.convert import hf
from pretrain_lm.data import pipeline
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.training import optimizer as optimizer_lib
from pretrain_lm.training import step as step_lib

VOCAB = 512


def small(name, tokenizer_path, arg='size=tiny', **overrides):
  """A tiny preset, one layer: rows of 64, batches of 16, no dropout, on
  a (2, 2, 2) mesh."""
  c = load_config(name, arg)
  if c.data.tokenizer_type != 'char':
    c.data.tokenizer = tokenizer_path
    c.model.vocab_size = VOCAB + 128  # room for reserved ids (T5)
  c.data.seq_len = 64
  c.model.max_len = max(c.model.max_len, 128)
  c.data.batch_size = 16
  c.data.shuffle_buffer = 64
  c.data.eval_batches = 1
  c.model.dropout_rate = 0.0
  c.model.attention_dropout_rate = 0.0
  c.model.num_layers = 1  # compiles are what these tests spend time on
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  c.optimizer.warmup_steps = 1
  c.train.progress_bar = False
  c.checkpoint.async_save = False
  for dotted, value in overrides.items():  # e.g. data__batch_size=32
    section, field = dotted.split('__')
    c[section][field] = value
  return c


def make_trainer(c, workdir):
  """A Trainer on c.mesh, over the first devices it needs."""
  devices = jax.devices()[: c.mesh.data * c.mesh.fsdp * c.mesh.tensor]
  return train.Trainer(c, workdir, sharding.make_mesh(c.mesh, devices))


def test_grad_accum_equals_the_big_batch_clm(tokenizer_path, tmp_path):
  c = small('gpt', tokenizer_path, data__batch_size=32, data__seq_len=32)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  trainer = make_trainer(c, str(tmp_path))
  batch = next(
    pipeline.train_iterator(c, trainer.tokenizer, objectives.row_transform(c))
  )
  metrics = assert_same_step(trainer, batch)
  assert metrics['num_predictions'] == 32 * 32


def test_grad_accum_equals_the_big_batch_mlm(tokenizer_path, tmp_path):
  c = small('bert', tokenizer_path, data__batch_size=32, data__seq_len=32)
  trainer = make_trainer(c, str(tmp_path))
  batch = next(
    pipeline.train_iterator(c, trainer.tokenizer, objectives.row_transform(c))
  )
  steps = sgd_steps(trainer)
  assert_same_step(trainer, batch, steps)
  # Microbatches predicting very different numbers of tokens: row r is in
  # microbatch r % 4; the first predicts nothing, the second one token per
  # row, the others all their masked tokens.
  weights = batch['masked_weights'].copy()
  weights[0::4] = 0
  weights[1::4, 1:] = 0
  batch['masked_weights'] = weights
  counts = [weights[i::4].sum() for i in range(4)]
  assert counts[0] == 0 and 0 < counts[1] < counts[2] / 2, counts
  assert_same_step(trainer, batch, steps)


def test_grad_accum_is_checked_against_batch_and_mesh(tokenizer_path):
  c = small('bert', tokenizer_path, train__grad_accum_steps=3)
  with pytest.raises(ValueError, match='train.grad_accum_steps=3'):
    validate.check_config(c)
  # 16 rows / 8 = 2 per microbatch, over 4 batch shards (data x fsdp).
  c.train.grad_accum_steps = 8
  mesh = sharding.make_mesh(c.mesh)
  with pytest.raises(ValueError, match='2 rows per microbatch'):
    step_lib.check_grad_accum(c, mesh)


def test_the_trainer_takes_grad_accum_steps(
  tokenizer_path, tmp_path, monkeypatch
):
  c = small('bert', tokenizer_path, data__batch_size=32, data__seq_len=128)
  c.train.grad_accum_steps = 4
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  trainer = make_trainer(c, str(tmp_path))
  assert trainer.microbatches == 4  # of 8 rows
  # The count the traced step itself scans over.
  counts = []
  accumulate = step_lib.accumulate_gradients

  def spy(grad_fn, params, batch, rng, n):
    counts.append(n)
    return accumulate(grad_fn, params, batch, rng, n)

  monkeypatch.setattr(step_lib, 'accumulate_gradients', spy)
  state = trainer.initial_state()
  with trainer.context():
    batch = sharding.host_to_global(
      next(
        pipeline.train_iterator(
          c, trainer.tokenizer, objectives.row_transform(c)
        )
      ),
      trainer.mesh,
    )
    split = scratch_bytes(trainer.train_step, state, batch)
    whole = scratch_bytes(trainer.jit_step(1), state, batch)
  assert counts == [4]
  assert split < 0.6 * whole, (split, whole)


def test_bf16_activations_float32_master_weights(tokenizer_path, tmp_path):
  c = small('bert', tokenizer_path, model__dtype='bfloat16')
  trainer = make_trainer(c, str(tmp_path))
  batch = sharding.host_to_global(
    next(
      pipeline.train_iterator(c, trainer.tokenizer, objectives.row_transform(c))
    ),
    trainer.mesh,
  )
  # Shapes and dtypes only (jax.eval_shape): nothing is compiled or run.
  with trainer.context():
    state = trainer.abstract_state()
    outputs, inter = jax.eval_shape(
      lambda p, b: trainer.model.apply(
        {'params': p}, b, deterministic=True, capture_intermediates=True
      ),
      state.params,
      batch,
    )
    loss, _ = jax.eval_shape(trainer.loss_fn, outputs, batch)
    new_state, metrics = jax.eval_shape(trainer._p_train_step, state, batch)
  # Master weights and optimizer state stay float32, before and after.
  for tree in (state, new_state):
    floats = [
      x.dtype
      for x in jax.tree.leaves((tree.params, tree.opt_state))
      if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert floats and set(floats) == {jnp.dtype(jnp.float32)}
  # Every layer's output and the logits are bf16; the loss is float32.
  layer_outputs = [
    v
    for path, v in jax.tree_util.tree_flatten_with_path(inter)[0]
    if 'layer_' in jax.tree_util.keystr(path)
  ]
  assert layer_outputs
  assert {v.dtype for v in layer_outputs} == {jnp.dtype(jnp.bfloat16)}
  assert outputs['mlm_logits'].dtype == jnp.bfloat16
  assert loss.dtype == jnp.float32 and metrics['loss'].dtype == jnp.float32

  # The param_dtype switch: bf16 weights when asked for.
  c.model.param_dtype = 'bfloat16'
  trainer = make_trainer(c, str(tmp_path / 'bf16_params'))
  with trainer.context():
    params = trainer.abstract_state().params
  kernel = params['encoder']['layer_0']['mlp']['wi_kernel']
  assert kernel.dtype == jnp.bfloat16


def test_optimizer_names_agree_with_validate():
  assert tuple(sorted(optimizer_lib.OPTIMIZERS)) == validate.OPTIMIZER_NAMES


def reference_tx(name, opt, schedule):
  """The optax optimizer, built directly from the paper's settings."""
  mask = {'bias': False, 'kernel': True, 'table': True, 'heads': True}
  clip = optax.clip_by_global_norm(opt.grad_clip_norm)
  if name == 'lamb':
    return optax.chain(
      clip,
      optax.lamb(
        schedule, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, mask=mask
      ),
    )
  return optax.chain(
    clip,
    optax.adafactor(
      schedule,
      decay_rate=0.8,
      clipping_threshold=1.0,
      multiply_by_parameter_scale=True,
      momentum=opt.adafactor_momentum or None,
      factored=True,
      min_dim_size_to_factor=128,
      weight_decay_rate=lambda t: 0.01 * schedule(t),
      weight_decay_mask=mask,
    ),
  )


@pytest.mark.parametrize(
  'name,momentum', [('lamb', 0.0), ('adafactor', 0.0), ('adafactor', 0.9)]
)
def test_optimizer_is_optax_with_the_papers_settings(name, momentum):
  # The config's fields reach optax as the papers set them: momentum too,
  # and a 3-D parameter factored over its two largest axes.
  c = load_config('bert', 'size=tiny')
  c.optimizer.name = name
  c.optimizer.adafactor_momentum = momentum
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 2
  tx, schedule = optimizer_lib.make_optimizer(c.optimizer, 100)
  want_tx = reference_tx(name, c.optimizer, schedule)
  rng = np.random.default_rng(0)
  params = {
    'kernel': rng.normal(size=(256, 128)).astype(np.float32),
    'table': rng.normal(size=(64, 32)).astype(np.float32),
    'bias': rng.normal(size=(128,)).astype(np.float32),
    # Factored over its two largest axes (160 and 128), not the first.
    'heads': rng.normal(size=(3, 128, 160)).astype(np.float32),
  }
  got_state, want_state = tx.init(params), want_tx.init(params)
  # The same state tree: checkpoints written with optax's restore.
  assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
  got_params = want_params = params
  for _ in range(4):
    grads = jax.tree.map(
      lambda p: rng.normal(size=p.shape).astype(np.float32), params
    )
    got, got_state = tx.update(grads, got_state, got_params)
    want, want_state = want_tx.update(grads, want_state, want_params)
    for k in params:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-8)
    got_params = optax.apply_updates(got_params, got)
    want_params = optax.apply_updates(want_params, want)
  for k in params:  # the updates did something (a few may round away)
    assert np.mean(want_params[k] != params[k]) > 0.99
  if name == 'adafactor':  # factored: a row and a column vector, no matrix
    v = got_state[1][0]
    shapes = {v.v_row['kernel'].shape, v.v_col['kernel'].shape}
    assert shapes == {(256,), (128,)} and v.v['kernel'].shape == (1,)
    assert v.v_row['heads'].shape == (3, 128)
    assert v.v_col['heads'].shape == (3, 160)
    assert v.v['table'].shape == (64, 32)  # 32 < 128: not factored


def test_adafactor_trains_with_sharded_state(tokenizer_path, tmp_path):
  # LAMB's state is Adam's moments, sharded like AdamW's (train_test).
  c = small('bert', tokenizer_path, optimizer__name='adafactor')
  trainer = make_trainer(c, str(tmp_path))
  state = trainer.initial_state()
  batch = next(
    pipeline.train_iterator(c, trainer.tokenizer, objectives.row_transform(c))
  )
  with trainer.context():
    for _ in range(2):
      state, metrics = trainer._p_train_step(
        state, sharding.host_to_global(batch, trainer.mesh)
      )
  assert math.isfinite(float(metrics['loss']))
  leaves = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  specs = {
    jax.tree_util.keystr(path): leaf.sharding.spec
    for path, leaf in leaves
    if 'token_embed' in jax.tree_util.keystr(path)
  }
  # Factored statistics of the (vocab, embed) table: small, replicated.
  assert len(specs) == 3 and all(set(s) <= {None} for s in specs.values())
  table = state.params['token_embed']['embedding']
  assert table.sharding.spec == jax.sharding.PartitionSpec('tensor', 'fsdp')


def test_seq_len_stages():
  c = load_config('bert', 'size=tiny')
  c.train.num_steps, c.data.seq_len = 1000, 512
  c.data.seq_len_schedule = '0.9:128'
  assert pipeline.seq_len_stages(c) == [(0, 900, 128), (900, 1000, 512)]
  c.data.seq_len_schedule = '0.5:64, 0.75:128'
  assert pipeline.seq_len_stages(c) == [
    (0, 500, 64),
    (500, 750, 128),
    (750, 1000, 512),
  ]
  c.data.seq_len_schedule = ''
  assert pipeline.seq_len_stages(c) == [(0, 1000, 512)]
  # Each stage reads on from the tokens the stages before it read.
  c.data.seq_len_schedule = '0.5:64, 0.75:128'
  assert [pipeline.stage_at(c, s)[3] for s in (0, 499, 500, 750, 999)] == [
    0,
    499,
    500 * 64 // 128,
    (500 * 64 + 250 * 128) // 512,
    (500 * 64 + 250 * 128) // 512 + 249,
  ]
  # A stream started at step 600 (data.allow_changed) counts from there.
  assert pipeline.stage_at(c, 750, 600)[3] == 150 * 128 // 512
  assert pipeline.stage_at(c, 650, 600)[3] == 50
  for bad in ('0.9:1024', '1.0:128', '0.9', 'x:128', '0.5:64,0.25:128'):
    c.data.seq_len_schedule = bad
    with pytest.raises(ValueError, match='data.seq_len_schedule'):
      validate.check_config(c)


def run_recording_shapes(config, workdir):
  """Trainer.run(), returning the input length of every step it took."""
  trainer = make_trainer(config, workdir)
  step_fn, lengths = trainer._p_train_step, []

  def recording(state, batch):
    lengths.append(batch['input_ids'].shape[1])
    return step_fn(state, batch)

  trainer._p_train_step = recording
  state = trainer.run()
  return lengths, jax.device_get(state.params)


def test_seq_len_schedule_switches_and_resumes_exactly(
  tokenizer_path, tmp_path
):
  c = small('bert', tokenizer_path, data__seq_len_schedule='0.5:32')
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  c.train.num_steps = c.train.eval_every = 4
  c.train.log_every, c.checkpoint.every = 1, 3
  straight = str(tmp_path / 'straight')
  trainer = make_trainer(c, straight)
  # The second stage reads on from the first's 2 x 32-token batches: its
  # first batch is batch 1 of the 64-token stream, not batch 0.
  got = next(trainer._stage_data(2)[0])
  stream = pipeline.train_iterator(
    c, trainer.tokenizer, objectives.row_transform(c), start_batch=1
  )
  np.testing.assert_array_equal(got['input_ids'], next(stream)['input_ids'])
  lengths, want = run_recording_shapes(c, straight)
  assert lengths == [32, 32, 64, 64]
  # pretrain_lm.load builds its input from the longest stage.
  with open(os.path.join(straight, 'batch_spec.json')) as f:
    assert json.load(f)['input_ids'][0] == [64]

  # Resumed from the step-3 checkpoint, in the second stage (the same
  # as stopping there: the first 3 steps are the straight run's).
  resumed = str(tmp_path / 'resumed')
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, 'checkpoints', '4'))
  lengths, got = run_recording_shapes(c, resumed)
  assert lengths == [64]
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(a, b)

  losses = [m['loss'] for m in read_metrics(resumed) if 'loss' in m]
  # Steps 1-4 straight through, then step 4 again after the resume.
  assert len(losses) == 5 and losses[4] == losses[3], losses
  assert all(math.isfinite(x) for x in losses)


def abstract_batch(config, tokenizer):
  spec = hf.batch_spec(config, tokenizer)
  return {
    k: jax.ShapeDtypeStruct((config.data.batch_size, *s), np.dtype(d))
    for k, (s, d) in spec.items()
  }


# One config file per model family.
FAMILIES = ['bert', 'gpt', 't5', 'electra', 'bilm', 'xlnet']


@pytest.mark.parametrize('name', FAMILIES)
def test_remat_and_scan_lower_in_every_family(name, tmp_path):
  tokenizer = tokenizer_lib.train_tokenizer(
    ['The quick brown fox jumps over the lazy dog.\n'],
    str(tmp_path / 'chars.json'),
    vocab_size=64,
    model_type='char',
  )
  c = load_config(name, 'size=tiny')
  c.data.seq_len, c.data.batch_size = 32, 8
  # XLNet's two-stream layers are not scanned (models/plm.py says why).
  c.model.scan_layers = name != 'xlnet'
  mesh = sharding.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  # Traced and lowered for the mesh, not compiled (tests/aot_test.py
  # compiles the scanned base presets): every family's layers take every
  # policy, scanned or not. What remat does to the step's memory and
  # gradients is test_remat_keeps_less_memory_for_the_same_gradients'.
  policies = ['none', 'full'] + (['dots_no_batch'] if name == 'bert' else [])
  for remat in policies:
    c.model.remat = remat
    lowered = train.lower_train_step(c, mesh, abstract_batch(c, tokenizer))
    assert isinstance(lowered, jax.stages.Lowered)


def test_remat_keeps_less_memory_for_the_same_gradients(
  tokenizer_path, tmp_path
):
  # Four scanned BERT layers over 8 rows of 128 on one device: the layers'
  # activations are most of the step's scratch memory. Measured: full remat
  # (each layer's input kept) 0.38x the scratch of none, dots_no_batch
  # (the projections kept, attention's scores and probabilities not) 0.55x.
  scratch, steps_of = {}, {}
  for remat in ('none', 'full', 'dots_no_batch'):
    c = small('bert', tokenizer_path, data__seq_len=128, data__batch_size=8)
    c.model.update(num_layers=4, scan_layers=True, remat=remat)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
    trainer = make_trainer(c, str(tmp_path / remat))
    if remat == 'none':
      batch = next(
        pipeline.train_iterator(
          c, trainer.tokenizer, objectives.row_transform(c)
        )
      )
    steps, new_state = sgd_steps(trainer)
    with trainer.context():
      scratch[remat] = scratch_bytes(
        steps[1], new_state(), sharding.host_to_global(batch, trainer.mesh)
      )
    steps_of[remat] = one_step(trainer, steps, new_state, batch, 1)
  assert scratch['full'] < scratch['dots_no_batch'], scratch
  assert scratch['dots_no_batch'] < 0.8 * scratch['none'], scratch
  # The same loss and gradient (SGD with lr=1: params before - after),
  # up to the round-off of computing the forward pass twice.
  before, after, metrics = steps_of['none']
  pairs = zip(*map(jax.tree.leaves, (before, after)), strict=True)
  grads = [a - b for a, b in pairs]
  scale = max(np.abs(g).max() for g in grads)
  for remat in ('full', 'dots_no_batch'):
    before_r, after_r, metrics_r = steps_of[remat]
    assert_trees_equal(before_r, before)
    for key in ('loss', 'grad_norm'):
      np.testing.assert_allclose(
        metrics_r[key], metrics[key], rtol=1e-5, err_msg=(remat, key)
      )
    leaves = zip(*map(jax.tree.leaves, (before_r, after_r)), grads, strict=True)
    for a, b, g in leaves:
      np.testing.assert_allclose(a - b, g, rtol=0, atol=1e-5 * scale)
