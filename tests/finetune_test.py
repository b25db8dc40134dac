"""Fine-tuning: restore, heads, ULMFiT's options, distillation, resume, CLI."""

import glob
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import (
  COMPILE_FLAGS,
  REPO,
  assert_same_step,
  load_config,
  one_device,
  read_metrics,
  tiny_cfg,
)
from flax import linen as nn

import pretrain_lm
from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm.finetune import config as config_lib
from pretrain_lm.finetune import glue, losses, trainer
from pretrain_lm.finetune import model as model_lib
from pretrain_lm.finetune import optimizer as ft_optimizer
from pretrain_lm.models import MODELS
from pretrain_lm.training import loop

STEPS = 48  # 32 examples in batches of 8: 12 epochs of 4 steps


def ft_config(init: str, **overrides) -> ml_collections.ConfigDict:
  """configs/finetune/glue.py:task=sst2 shrunk for tests, plus overrides."""
  c = load_config('finetune/glue', 'task=sst2')
  c.init.workdir = init
  c.task.seq_len = 32
  c.task.max_train_examples = 32
  c.task.max_eval_examples = 64
  c.data.batch_size = 8
  c.train.eval_batch_size = 16
  c.train.num_steps = STEPS
  c.train.log_every = 8
  c.train.eval_every = 16
  c.train.progress_bar = False
  c.optimizer.learning_rate = 2e-3
  c.checkpoint.async_save = False
  # Batch split 4 ways, params over fsdp and tensor: the rule table applies.
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
  for key, value in overrides.items():
    section, field = key.split('__')
    c[section][field] = value
  return c


def leaves(tree) -> dict:
  flat = jax.tree_util.tree_leaves_with_path(tree)
  return {ft_optimizer.path_names(p): np.asarray(v) for p, v in flat}


@pytest.fixture(scope='module')
def bert(tiny_workdir):
  return tiny_workdir('bert')


@pytest.fixture(scope='module')
def straight(bert, tmp_path_factory):
  """An uninterrupted STEPS-step run: (workdir, final params, results)."""
  workdir = str(tmp_path_factory.mktemp('straight'))
  run = trainer.Trainer(ft_config(bert), workdir)
  results = run.run()
  return workdir, jax.device_get(run.state.params), results


# --- Restore and initialisation.


def test_body_restored_from_init_and_head_new(bert, tmp_path):
  run = trainer.Trainer(ft_config(bert), str(tmp_path), one_device())
  state = run.initial_state()
  assert int(state.step) == 0
  pretrained = leaves(pretrain_lm.load(bert).params)
  body = leaves(state.params['backbone'])
  # Every body param is the pretraining one, bitwise; the MLM head is not
  # part of the body.
  assert body and all(('mlm_head' not in k) for k in body)
  for k, v in body.items():
    np.testing.assert_array_equal(v, pretrained[k], err_msg=str(k))
  head = {k: v for k, v in leaves(state.params).items() if k[0] != 'backbone'}
  assert set(head) == {('classifier_kernel',), ('classifier_bias',)}
  assert head[('classifier_kernel',)].shape == (128, 2)
  assert 0.01 < head[('classifier_kernel',)].std() < 0.03  # fresh, std 0.02

  baseline = trainer.Trainer(
    ft_config(bert, init__random_init=True),
    str(tmp_path / 'random'),
    one_device(),
  ).initial_state()
  table = ('backbone', 'token_embed', 'embedding')
  assert not np.array_equal(
    leaves(baseline.params)[table], pretrained[('token_embed', 'embedding')]
  )
  # The fine-tuning workdir holds what loading it needs.
  for name in ('config.json', 'init_config.json', 'tokenizer.model'):
    assert os.path.exists(tmp_path / name)

  # Zhang et al.'s re-initialisation: the top layer and the pooler are the
  # from-scratch run's (the same seed), the rest the pretrained body's.
  renewed = trainer.Trainer(
    ft_config(bert, init__reinit_top_layers=1),
    str(tmp_path / 'reinit'),
    one_device(),
  ).initial_state()
  fresh = leaves(baseline.params)
  body = leaves(renewed.params['backbone'])
  top = 'layer_1' if any('layer_1' in k for k in body) else 'layers'
  kinds = set()
  for k, v in body.items():
    if top == 'layers' and 'layers' in k:  # a scanned stack: row 1 renewed
      np.testing.assert_array_equal(v[0], pretrained[k][0], err_msg=str(k))
      np.testing.assert_array_equal(v[1], fresh[('backbone', *k)][1])
      kinds.add('stack')
    elif top in k or 'pooler' in k:
      np.testing.assert_array_equal(v, fresh[('backbone', *k)], str(k))
      if v.std() > 0:  # drawn at random, not a constant (biases, norms)
        assert not np.array_equal(v, pretrained[k]), k
      kinds.add('renewed')
    else:
      np.testing.assert_array_equal(v, pretrained[k], err_msg=str(k))
      kinds.add('kept')
  assert kinds in ({'renewed', 'kept'}, {'stack', 'renewed', 'kept'}), kinds


@pytest.mark.parametrize(
  'name, arg',
  [
    ('glue', 'task=mrpc,recipe=ulmfit'),
    ('glue', 'task=stsb,siamese'),
    ('glue', 'task=sst2,recipe=elmo'),
    ('squad', 'version=2'),
    ('conll', ''),
  ],
)
def test_configs_are_locked_with_bert_defaults(name, arg):
  c = load_config(f'finetune/{name}', arg)
  assert c.task.name == name
  assert c.optimizer.weight_decay == 0.01 and c.optimizer.warmup_fraction == 0.1
  with pytest.raises(AttributeError):
    c.train.num_step = 5  # a typo is an error, not a new field
  if name == 'glue':
    assert c.task.glue_task == arg.split(',')[0].split('=')[1]
    assert (c.data.batch_size, c.train.num_epochs) == (32, 3)
    assert c.optimizer.learning_rate in (2e-5, 1e-3)


def test_fields_pretraining_names_otherwise_say_what_to_set(tmp_path):
  # Fine-tuning spells them as pretraining does: data.batch_size,
  # train.num_steps, optimizer.decay. The other spelling fails, naming the
  # field, on the command line and in a config file.
  for old, new in config_lib.RENAMED.items():
    c = config_lib.base_config()  # unlocked, as a config file builds it
    section, field = old.split('.')
    c[section][field] = 1
    with pytest.raises(ValueError, match=f'{old} is called {new}'):
      config_lib.check_config(c, str(tmp_path))
  out = subprocess.run(
    [
      sys.executable,
      '-m',
      'pretrain_lm.finetune',
      '--config=configs/finetune/glue.py:task=sst2',
      f'--workdir={tmp_path / "ft"}',
      '--config.train.batch_size=8',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode != 0
  assert 'train.batch_size is called data.batch_size' in out.stderr, out
  assert 'Traceback' not in out.stderr, out.stderr


def test_missing_init_is_a_clear_error(tmp_path):
  c = ft_config(str(tmp_path / 'nowhere'))
  with pytest.raises(FileNotFoundError, match='--init=.*not a pretrain_lm'):
    config_lib.check_config(c, str(tmp_path / 'ft'))
  c.init.workdir = ''
  with pytest.raises(ValueError, match='--init'):
    config_lib.check_config(c, str(tmp_path / 'ft'))


def test_reinit_top_layers_beyond_the_body_is_a_clear_error(bert, tmp_path):
  # The Trainer checks the count against the body's config it reads from
  # --init, before it loads the tokenizer or any weights.
  with pytest.raises(ValueError, match='reinit_top_layers=3.*has 2 layers'):
    trainer.Trainer(ft_config(bert, init__reinit_top_layers=3), str(tmp_path))
  trainer.check_reinit_top_layers(2, tiny_cfg('encoder'))
  albert = tiny_cfg('encoder', share_layers=True)
  with pytest.raises(ValueError, match='reinit_top_layers=1.*shares'):
    trainer.check_reinit_top_layers(1, albert)


# --- A run: loss, evaluation, results, resume, sharding.


def test_loss_falls_and_dev_metric_is_the_tasks(straight):
  workdir, params, results = straight
  metrics = read_metrics(workdir)
  losses = [m['loss'] for m in metrics if 'loss' in m]
  # Means over 2 epochs of the 32 rows: memorising them drives the loss
  # from ln 2 towards 0.
  assert len(losses) == STEPS // 8
  assert losses[0] > 0.6 and losses[-1] < 0.3, losses
  evals = [m for m in metrics if 'eval_accuracy' in m]
  assert [m['step'] for m in evals] == [16, 32, 48]

  # The logged metric is glue.evaluate() of the final params' predictions.
  final = trainer.load(workdir, best=False)
  assert final.step == STEPS
  for a, b in zip(
    jax.tree.leaves(final.params), jax.tree.leaves(params), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  c = final.config
  examples = glue.read(c.task, 'dev')[: c.task.max_eval_examples]
  rows = glue.featurize(
    examples, final.tokenizer, c.task, seq_len=32, family='encoder'
  )
  scores = glue.evaluate(examples, rows, final.predict(rows), c.task)
  assert results['final']['eval_accuracy'] == scores['accuracy']
  assert evals[-1]['eval_accuracy'] == scores['accuracy']
  best = max(evals, key=lambda m: m['eval_accuracy'])
  assert results['best']['eval_accuracy'] == best['eval_accuracy']
  assert trainer.load(workdir).step == results['best']['step']


def test_resume_is_exact_on_a_2x2x2_mesh(bert, straight, tmp_path):
  _, params, _ = straight
  workdir = str(tmp_path)
  first = trainer.Trainer(
    ft_config(bert, train__exit_interval=STEPS // 2 + 2), workdir
  )
  # The body is split over fsdp and the heads over tensor.
  spec = first.shardings.params['backbone']['encoder']['layer_0']['attention'][
    'query_kernel'
  ].spec
  assert tuple(spec) == ('fsdp', 'tensor', None)
  first.run()
  assert int(first.state.step) == STEPS // 2 + 2  # mid-epoch
  second = trainer.Trainer(ft_config(bert), workdir)
  second.run()
  resumed = leaves(jax.device_get(second.state.params))
  for k, v in leaves(params).items():
    np.testing.assert_array_equal(resumed[k], v, err_msg=str(k))


def run_cli(bert, workdir, overrides, background=False):
  """`python -m pretrain_lm.finetune` on SST-2, shrunk, on one device."""
  flags = {
    'task.seq_len': 32,
    'task.max_train_examples': 32,
    'task.max_eval_examples': 16,
    'data.batch_size': 8,
    'train.progress_bar': False,
    'mesh.data': 1,
    **overrides,
  }
  cmd = [
    sys.executable,
    '-m',
    'pretrain_lm.finetune',
    '--config=configs/finetune/glue.py:task=sst2',
    f'--init={bert}',
    f'--workdir={workdir}',
  ] + [f'--config.{k}={v}' for k, v in flags.items()]
  env = dict(os.environ, XLA_FLAGS=COMPILE_FLAGS, JAX_PLATFORMS='cpu')
  if background:
    return subprocess.Popen(
      cmd,
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
  return subprocess.run(
    cmd,
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    timeout=600,
  )


def test_cli_sigterm_saves_exits_75_and_resumes(bert, tmp_path):
  # As pretraining's main: a signal saves the step, exits "resume me".
  workdir = str(tmp_path / 'run')
  cache = str(tmp_path / 'jax_cache')
  overrides = {
    'train.num_steps': 100_000,
    'train.log_every': 1,
    'train.eval_every': 100_000,
    'checkpoint.every': 100_000,
    'checkpoint.keep_best': False,
    'train.compilation_cache_dir': cache,
  }
  proc = run_cli(bert, workdir, overrides, background=True)
  metrics = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.time() + 300
  while time.time() < deadline and not (
    os.path.exists(metrics) and os.path.getsize(metrics) > 0
  ):
    time.sleep(0.1)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == loop.EXIT_RESUME == 75, out
  assert 'saving a checkpoint' in out and 'Exiting with code 75' in out
  steps = os.listdir(os.path.join(workdir, 'checkpoints'))
  assert len(steps) == 1 and int(steps[0]) > 0, steps
  saved = int(steps[0])
  assert f'Stopping at step {saved}' in out, out

  # The same command resumes; train.exit_interval stops it with 0.
  rerun = run_cli(
    bert, workdir, {**overrides, 'train.exit_interval': saved + 1}
  )
  assert rerun.returncode == 0, rerun.stdout
  assert f'Resumed from {workdir}/checkpoints at step {saved}' in rerun.stdout
  assert f'Stopping at step {saved + 1}' in rerun.stdout, rerun.stdout


def test_cli_stops_on_nonfinite_steps_with_65(bert, tmp_path):
  # A learning rate of 1e30: finite loss and gradients, an update whose
  # norm overflows, so every step is skipped (pretraining's nonfinite_test).
  out = run_cli(
    bert,
    str(tmp_path / 'run'),
    {
      'train.num_steps': 20,
      'optimizer.learning_rate': 1e30,
      'optimizer.warmup_fraction': 0.0,
      'train.max_consecutive_skips': 2,
    },
  )
  assert out.returncode == loop.EXIT_NONFINITE != loop.EXIT_RESUME, out.stdout
  assert 'Stopping at step 2: the last 2 steps had' in out.stdout, out.stdout
  assert 'rerun to resume' not in out.stdout
  assert 'Traceback' not in out.stdout, out.stdout


def test_corrupt_latest_checkpoint_fails_or_falls_back(bert, tmp_path):
  # As pretraining resumes: a latest checkpoint that does not verify stops
  # the run, or with checkpoint.on_corrupt=previous is moved aside.
  workdir = str(tmp_path)
  run = dict(
    train__num_steps=4,
    checkpoint__every=2,
    checkpoint__keep=2,
    checkpoint__keep_best=False,
  )
  trainer.Trainer(ft_config(bert, **run), workdir, one_device()).run()
  directory = os.path.join(workdir, 'checkpoints')
  assert sorted(os.listdir(directory)) == ['2', '4']
  pattern = os.path.join(directory, '4', 'state', '**', 'd', '*')
  path = max(glob.glob(pattern, recursive=True), key=os.path.getsize)
  data = bytearray(pathlib.Path(path).read_bytes())
  data[len(data) // 2] ^= 0x10
  pathlib.Path(path).write_bytes(data)
  again = trainer.Trainer(ft_config(bert, **run), workdir, one_device())
  with pytest.raises(checkpoint_lib.CorruptCheckpointError, match='step 4'):
    again.initial_state()
  previous = dict(run, checkpoint__on_corrupt='previous')
  again = trainer.Trainer(ft_config(bert, **previous), workdir, one_device())
  assert int(again.initial_state().step) == 2
  assert 'corrupt-4' in os.listdir(directory)


def test_elmo_recipe_keeps_the_body_frozen(bert, tmp_path):
  c = ft_config(bert, train__num_steps=3)
  c.head.scalar_mix = c.head.mix_layer_norm = c.head.freeze_backbone = True
  run = trainer.Trainer(c, str(tmp_path), one_device())
  before = leaves(jax.device_get(run.initial_state().params))
  run.run()
  after = leaves(jax.device_get(run.state.params))
  for k, v in before.items():
    if k[0] == 'backbone':
      np.testing.assert_array_equal(after[k], v, err_msg=str(k))
  assert not np.array_equal(
    after[('scalar_mix', 'weights')], before[('scalar_mix', 'weights')]
  )
  assert not np.array_equal(
    after[('classifier_kernel',)], before[('classifier_kernel',)]
  )


def test_cli_distils_and_prints_dev_accuracy(bert, straight, tmp_path):
  teacher, _, _ = straight
  workdir, cache = tmp_path / 'run', tmp_path / 'jax_cache'
  overrides = {
    'task.seq_len': 32,
    'task.max_train_examples': 32,
    'task.max_eval_examples': 32,
    'data.batch_size': 8,
    'train.num_steps': 4,
    'train.progress_bar': False,
    'mesh.data': 1,
    'distill.teacher': teacher,
    'distill.alpha': 0.5,
    'distill.temperature': 2.0,
    'train.compilation_cache_dir': cache,
  }
  cmd = [
    sys.executable,
    '-m',
    'pretrain_lm.finetune',
    '--config=configs/finetune/glue.py:task=sst2',
    f'--init={bert}',
    f'--workdir={workdir}',
  ] + [f'--config.{k}={v}' for k, v in overrides.items()]
  # One CPU device: a single-device compile is the quickest. Every compile
  # goes to the cache, however short.
  env = dict(
    os.environ,
    XLA_FLAGS=COMPILE_FLAGS,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
  )
  out = subprocess.run(
    cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'Dev accuracy: ' in out.stdout, out.stdout
  logged = read_metrics(str(workdir))
  assert all(
    math.isfinite(m['distill_loss']) for m in logged if 'distill_loss' in m
  )
  assert any('distill_loss' in m for m in logged)
  assert any(cache.iterdir()), 'fine-tuning stored no compiled step'


# --- Heads on each family (random weights; no workdir needed).


def row_batch(lengths, L=10, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, 50, (len(lengths), L)).astype(np.int32)
  mask = (np.arange(L)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  return {
    'input_ids': ids * mask,
    'input_mask': mask,
    'token_type_ids': np.zeros_like(ids),
  }


def apply(model, batch, params=None):
  if params is None:
    params = nn.meta.unbox(
      model.init(jax.random.key(0), batch, deterministic=True)
    )
  return params, model.apply(params, batch, deterministic=True)


@pytest.mark.parametrize('family', ['decoder', 'encoder_decoder'])
def test_causal_families_classify_the_last_real_token(family):
  model = model_lib.FinetuneModel(
    tiny_cfg(family), head='classification', num_labels=3
  )
  batch = row_batch([4, 7])
  params, out = apply(model, batch)
  assert out['logits'].shape == (2, 3)
  # Reference: the body's state at the last real token, through the dense.
  body = {'params': params['params']['backbone']}
  inputs = model_lib.backbone_inputs(batch, family)
  body_model = MODELS[family](tiny_cfg(family))
  hidden = body_model.apply(body, inputs, deterministic=True)['hidden']
  last = hidden[jnp.arange(2), jnp.array([3, 6])]
  p = params['params']
  want = last @ p['classifier_kernel'] + p['classifier_bias']
  np.testing.assert_allclose(out['logits'], want, rtol=1e-5, atol=1e-6)
  if family == 'decoder':  # causal: what follows the row changes nothing
    ids = np.where(batch['input_mask'] > 0, batch['input_ids'], 9)
    other = dict(batch, input_ids=ids)
    _, out2 = apply(model, other, params)
    np.testing.assert_allclose(out2['logits'], out['logits'], atol=1e-6)


def test_span_and_token_heads():
  batch = row_batch([5, 10])
  span = model_lib.FinetuneModel(tiny_cfg('encoder'), 'span', 2)
  _, out = apply(span, batch)
  assert out['start_logits'].shape == (2, 10)
  assert np.all(np.asarray(out['start_logits'])[0, 5:] == -1e9)
  assert np.all(np.asarray(out['end_logits'])[0, :5] > -1e3)
  token = model_lib.FinetuneModel(tiny_cfg('encoder'), 'token', 5)
  _, out = apply(token, batch)
  assert out['token_logits'].shape == (2, 10, 5)


def test_text_to_text_scores_each_label_word_by_its_likelihood():
  cfg = tiny_cfg('encoder_decoder', position='relative', type_vocab_size=0)
  words = ((2, 7, 3), (2, 8, 9, 3))  # [CLS] word [SEP], 1- and 2-piece
  model = model_lib.FinetuneModel(
    cfg, 'classification', 2, label_sequences=words
  )
  batch = row_batch([4, 9])
  params, out = apply(model, batch)
  assert out['logits'].shape == (2, 2)
  # Reference: the plain encoder-decoder, teacher-forced on each word.
  body = MODELS['encoder_decoder'](cfg)
  for c, word in enumerate(words):
    T = len(word) - 1
    logits = body.apply(
      {'params': params['params']['backbone']},
      {
        'encoder_input_ids': batch['input_ids'],
        'encoder_input_mask': batch['input_mask'],
        'decoder_input_ids': np.tile(np.array(word[:-1]), (2, 1)),
      },
      deterministic=True,
    )['logits']
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), -1)
    want = sum(logp[:, t, word[t + 1]] for t in range(T))
    np.testing.assert_allclose(out['logits'][:, c], want, rtol=1e-5)
  # Training maximises the gold word's likelihood (T5), not a class softmax.
  fn = losses.loss_fn('classification', text_to_text=True)
  loss, _ = fn(out, {'label': np.array([1, 0])})
  want = -(out['logits'][0, 1] + out['logits'][1, 0]) / 2
  assert float(loss) == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize('head', ['classification', 'regression'])
def test_sentence_bert_heads(head):
  cfg = tiny_cfg('encoder')
  model = model_lib.FinetuneModel(cfg, head, 3, siamese=True)
  a, b = row_batch([4, 9], seed=1), row_batch([7, 2], seed=2)
  batch = dict(a, **{'b_' + k: v for k, v in b.items()})
  params, out = apply(model, batch)
  # u and v: each sentence alone through the same body, mean-pooled.
  body = MODELS['encoder'](cfg)
  p = params['params']

  def embed(rows):
    h = np.asarray(
      body.apply({'params': p['backbone']}, rows, deterministic=True)['hidden']
    )
    m = rows['input_mask'][..., None]
    return (h * m).sum(1) / m.sum(1)

  u, v = embed(a), embed(b)
  if head == 'regression':
    cos = (
      (u * v).sum(-1) / np.linalg.norm(u, axis=-1) / np.linalg.norm(v, axis=-1)
    )
    np.testing.assert_allclose(out['logits'], cos, rtol=1e-5)
  else:
    x = np.concatenate([u, v, np.abs(u - v)], -1)
    want = x @ p['classifier_kernel'] + p['classifier_bias']
    np.testing.assert_allclose(out['logits'], want, rtol=1e-4, atol=1e-5)


def test_scalar_mix_is_elmo_equation_1():
  cfg = tiny_cfg('encoder')
  model = model_lib.FinetuneModel(
    cfg, 'token', 3, scalar_mix=True, mix_layer_norm=True
  )
  batch = row_batch([6, 10])
  params, _ = apply(model, batch)
  p = jax.tree.map(np.asarray, params['params'])
  p['scalar_mix']['weights'] = np.array([0.3, -1.0, 2.0], np.float32)
  p['scalar_mix']['gamma'] = np.float32(1.7)
  _, out = apply(model, batch, {'params': p})

  body = MODELS['encoder'](cfg, collect_states=True)
  states = np.asarray(
    body.apply({'params': p['backbone']}, batch, deterministic=True)[
      'layer_states'
    ],
    np.float64,
  )
  s = (
    np.exp(p['scalar_mix']['weights'])
    / np.exp(p['scalar_mix']['weights']).sum()
  )
  mixed = np.zeros(states.shape[1:])
  for j in range(3):
    for b, n in enumerate([6, 10]):  # each row's real tokens
      real = states[j, b, :n]
      norm = (states[j, b] - real.mean()) / np.sqrt(real.var() + 1e-12)
      mixed[b] += s[j] * norm
  mixed *= 1.7
  want = mixed @ p['token_kernel'] + p['token_bias']
  got = np.asarray(out['token_logits'])
  np.testing.assert_allclose(got[0, :6], want[0, :6], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)


# --- ULMFiT's optimizer options, on toy param trees.


def toy_params(scanned=False):
  """An encoder's param paths with 2 layers: embeddings, layers, head."""
  ones = lambda *s: jnp.ones(s, jnp.float32)
  if scanned:
    encoder = {'layers': {'mlp': {'wi_kernel': ones(2, 3, 4)}}}
  else:
    encoder = {f'layer_{i}': {'mlp': {'wi_kernel': ones(3, 4)}} for i in (0, 1)}
  return {
    'backbone': {
      'token_embed': {'embedding': ones(5, 3)},
      'encoder': encoder,
      'pooler': {'pooler_kernel': ones(3, 3)},
    },
    'classifier_kernel': ones(3, 2),
  }


@pytest.mark.parametrize('scanned', [False, True])
def test_discriminative_lr_scales_layer_l_by_decay_to_the_L_minus_l(scanned):
  cfg = tiny_cfg('encoder')
  decay = 0.5
  tx = optax.chain(optax.sgd(1.0), ft_optimizer.discriminative_lr(cfg, decay))
  params = toy_params(scanned)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  mag = leaves(jax.tree.map(jnp.abs, updates))
  assert np.all(mag[('backbone', 'token_embed', 'embedding')] == decay**2)
  if scanned:
    w = mag[('backbone', 'encoder', 'layers', 'mlp', 'wi_kernel')]
    assert np.all(w[0] == decay) and np.all(w[1] == 1.0)
  else:
    layer = lambda i: mag[
      ('backbone', 'encoder', f'layer_{i}', 'mlp', 'wi_kernel')
    ]
    assert np.all(layer(0) == decay) and np.all(layer(1) == 1.0)
  assert np.all(mag[('backbone', 'pooler', 'pooler_kernel')] == 1.0)
  assert np.all(mag[('classifier_kernel',)] == 1.0)


@pytest.mark.parametrize('scanned', [False, True])
def test_reinit_top_layers_takes_the_top_layers_and_pooler_fresh(scanned):
  cfg = tiny_cfg('encoder')
  restored = toy_params(scanned)['backbone']
  fresh = jax.tree.map(jnp.zeros_like, restored)
  assert trainer.reinit_top_layers(restored, fresh, cfg, 0) is restored
  for count, kept_layers in ((1, [True, False]), (2, [False, False])):
    got = leaves(trainer.reinit_top_layers(restored, fresh, cfg, count))
    assert np.all(got[('token_embed', 'embedding')] == 1)
    assert np.all(got[('pooler', 'pooler_kernel')] == 0)
    for i, kept in enumerate(kept_layers):
      if scanned:
        w = got[('encoder', 'layers', 'mlp', 'wi_kernel')][i]
      else:
        w = got[('encoder', f'layer_{i}', 'mlp', 'wi_kernel')]
      assert np.all(w == (1 if kept else 0)), (count, i)


def test_layer_depths_of_an_encoder_decoder():
  cfg = tiny_cfg('encoder_decoder', num_decoder_layers=3)
  depth = lambda *names: ft_optimizer.layer_depth(('backbone', *names), cfg)
  assert depth('token_embed', 'embedding') == 0
  assert depth('encoder', 'layer_1', 'mlp', 'wo_kernel') == 2
  assert depth('decoder', 'layer_0', 'mlp', 'wo_kernel') == 3
  assert depth('decoder', 'layer_2', 'mlp', 'wo_kernel') == 5
  assert ft_optimizer.layer_depth(('classifier_kernel',), cfg) == 6


def test_slanted_triangular_is_the_papers_formula():
  T, cut_frac, ratio, peak = 1000, 0.1, 32.0, 0.01
  schedule = ft_optimizer.slanted_triangular(peak, T, cut_frac, ratio)
  cut = math.floor(T * cut_frac)
  for t in range(T):
    # Howard & Ruder (2018), eq. 3.
    p = t / cut if t < cut else 1 - (t - cut) / (cut * (1 / cut_frac - 1))
    want = peak * (1 + p * (ratio - 1)) / ratio
    assert float(schedule(t)) == pytest.approx(want, rel=1e-6), t
  assert float(schedule(cut)) == pytest.approx(peak)
  assert float(schedule(0)) == pytest.approx(peak / ratio)


def test_gradual_unfreezing_leaves_frozen_layers_unchanged():
  cfg = tiny_cfg('encoder')
  opt = load_config('finetune/glue', 'task=sst2').optimizer
  opt.learning_rate, opt.weight_decay = 0.1, 0.1  # decay moves params too
  tx, _ = ft_optimizer.make_optimizer(opt, 100, cfg, unfreeze_every=2)
  params = toy_params()
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  names = {
    'embed': ('backbone', 'token_embed', 'embedding'),
    'layer_0': ('backbone', 'encoder', 'layer_0', 'mlp', 'wi_kernel'),
    'layer_1': ('backbone', 'encoder', 'layer_1', 'mlp', 'wi_kernel'),
    'head': ('classifier_kernel',),
  }
  # Steps 0-1: the head (and pooler) train; 2-3: + the top layer; 4-5: +
  # layer 0; from 6: everything.
  trained = {
    2: {'head'},
    4: {'head', 'layer_1'},
    6: {'head', 'layer_1', 'layer_0'},
  }
  trained[8] = set(names)
  previous = leaves(params)
  for step in range(8):
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    if (step + 1) % 2 == 0:
      now = leaves(params)
      for name, path in names.items():
        changed = not np.array_equal(now[path], previous[path])
        assert changed == (name in trained[step + 1]), (step, name)
      previous = now


# --- Distillation.


def test_distillation_loss_is_the_hand_computation():
  student = np.array([[1.0, -0.5, 0.2], [0.3, 0.3, 2.0]], np.float32)
  teacher = np.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5]], np.float32)
  labels = np.array([2, 0], np.int32)
  T, alpha = 2.0, 0.3

  def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  p_t, p_s = softmax(teacher / T), softmax(student / T)
  kl = (p_t * (np.log(p_t) - np.log(p_s))).sum(-1).mean()
  gold = -np.log(softmax(student)[np.arange(2), labels]).mean()
  want = (1 - alpha) * gold + alpha * T**2 * kl

  fn = losses.loss_fn(
    'classification', distill=True, alpha=alpha, temperature=T
  )
  batch = {'label': labels, 'teacher_logits': teacher}
  loss, metrics = fn({'logits': jnp.asarray(student)}, batch)
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert float(metrics['gold_loss']) == pytest.approx(gold, rel=1e-5)

  # At alpha = 1 the gold labels do not reach the gradient.
  soft = losses.loss_fn(
    'classification', distill=True, alpha=1.0, temperature=T
  )
  grad = lambda y: jax.grad(lambda s: soft({'logits': s}, y)[0])(
    jnp.asarray(student)
  )
  other = dict(batch, label=np.array([0, 1], np.int32))
  np.testing.assert_array_equal(grad(batch), grad(other))
  mixed = jax.grad(lambda s: fn({'logits': s}, batch)[0])(student)
  mixed_other = jax.grad(lambda s: fn({'logits': s}, other)[0])(student)
  assert not np.allclose(mixed, mixed_other)


# --- Span extraction and token classification, end to end.


@pytest.mark.parametrize('task', ['squad', 'conll'])
def test_span_and_token_tasks_train_and_report_official_metrics(
  task, bert, tmp_path
):
  data = tmp_path / 'data'
  data.mkdir()
  fixtures = os.path.join(REPO, 'tests', 'data', task)
  if task == 'squad':
    # The dev fixture doubles as training data: the loss must fall on it.
    with open(os.path.join(fixtures, 'dev-v1.1.json')) as f:
      content = f.read()
    for split in ('train', 'dev'):
      (data / f'{split}-v1.1.json').write_text(content)
    metric, other = 'eval_f1', 'eval_exact_match'
  else:
    for name in ('train.txt', 'valid.txt'):
      with open(os.path.join(fixtures, name)) as f:
        (data / name).write_text(f.read())
    metric, other = 'eval_f1', 'eval_precision'
  c = load_config(f'finetune/{task}', f'data={data}')
  c.init.workdir = bert
  c.task.seq_len = 64
  if task == 'squad':
    c.task.max_query_len = 16
    c.task.doc_stride = 24
  c.data.batch_size = 4  # the CoNLL fixture has 5 training sentences
  c.train.num_steps = 30
  c.train.log_every = 5
  c.train.eval_every = 30
  c.train.progress_bar = False
  c.optimizer.learning_rate = 2e-3
  c.checkpoint.async_save = False
  results = trainer.finetune(c, str(tmp_path / 'run'), one_device())
  assert results['metric'] == metric[len('eval_') :]
  final = results['final']
  assert 0.0 <= final[metric] <= 100.0 and 0.0 <= final[other] <= 100.0
  losses_ = [r['loss'] for r in read_metrics(tmp_path / 'run') if 'loss' in r]
  assert len(losses_) == 6 and all(math.isfinite(x) for x in losses_)
  assert losses_[-1] < losses_[0] - 0.2, losses_


def test_microbatches_make_the_whole_batchs_token_step(tiny_workdir, tmp_path):
  # The token head averages over labelled tokens, whose count differs from
  # row to row: weighted by each microbatch's num_predictions, 4
  # microbatches of one row make the 4-row batch's loss and gradient (the
  # mean of the 4 rows' means would not).
  data = tmp_path / 'data'
  data.mkdir()
  for name in ('train.txt', 'valid.txt'):
    with open(os.path.join(REPO, 'tests', 'data', 'conll', name)) as f:
      (data / name).write_text(f.read())
  c = load_config('finetune/conll', f'data={data}')
  # No dropout anywhere: each microbatch draws its own masks.
  c.init.workdir = tiny_workdir(
    'bert', model__dropout_rate=0.0, model__attention_dropout_rate=0.0
  )
  c.head.dropout = 0.0
  c.task.seq_len = 64
  c.data.batch_size = 4
  c.train.grad_accum_steps = 4
  c.train.progress_bar = False
  run = trainer.Trainer(c, str(tmp_path / 'run'), one_device())
  assert run.microbatches == 4
  batch = run.train_batch(0)
  labelled = np.sum(batch['token_labels'] >= 0, axis=1)
  assert len(set(labelled.tolist())) > 1, labelled
  metrics = assert_same_step(run, batch)
  assert metrics['num_predictions'] == labelled.sum()

  c.train.grad_accum_steps = 3
  with pytest.raises(ValueError, match='train.grad_accum_steps=3'):
    config_lib.check_config(c)
