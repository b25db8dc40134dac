"""Cross-view training (Clark et al., 2018): views, loss, alternation."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO, load_config, one_device, read_metrics, tiny_cfg
from flax import linen as nn

from pretrain_lm.finetune import config as config_lib
from pretrain_lm.finetune import losses, trainer
from pretrain_lm.finetune import model as model_lib
from pretrain_lm.finetune import optimizer as ft_optimizer
from pretrain_lm.models import encoder, transformer


def rows(seed=0, B=2, L=10, pad_from=7):
  ids = np.random.default_rng(seed).integers(5, 50, (B, L))
  mask = np.ones((B, L), np.int32)
  mask[1, pad_from:] = 0
  ids = np.where(mask > 0, ids, 0)
  return {'input_ids': jnp.asarray(ids, jnp.int32), 'input_mask': mask}


def init(model, batch):
  return nn.meta.unbox(
    model.init(jax.random.key(0), batch, deterministic=True)
  )['params']


# --- The restricted views.


@pytest.mark.parametrize('direction', ['forward', 'backward'])
def test_attention_mask_keeps_one_side_of_each_query(direction):
  segments = jnp.asarray([[1, 1, 1, 2, 2, 0]])
  got = np.asarray(
    transformer.attention_mask(segments, segments, False, direction=direction)
  )[0, 0]
  s = np.asarray(segments)[0]
  for q in range(6):
    for k in range(6):
      side = k <= q if direction == 'forward' else k >= q
      assert got[q, k] == (s[q] == s[k] and s[k] != 0 and side), (q, k)


@pytest.mark.parametrize('direction', ['forward', 'backward', 'both'])
def test_an_encoders_view_reads_only_its_side(direction):
  model = encoder.EncoderModel(tiny_cfg('encoder'))
  batch = rows(pad_from=10)
  params = init(model, batch)

  def hidden(b):
    out = model.apply(
      {'params': params}, b, deterministic=True, direction=direction
    )
    return np.asarray(out['hidden'])

  t = 5
  changed = dict(batch, input_ids=batch['input_ids'].at[:, t].set(3))
  moved = np.abs(hidden(changed) - hidden(batch)).max(axis=(0, 2)) > 1e-6
  if direction == 'forward':  # positions before t never see it
    assert not moved[:t].any() and moved[t:].all()
  elif direction == 'backward':
    assert not moved[t + 1 :].any() and moved[: t + 1].all()
  else:
    assert moved.all()


def test_future_and_past_views_never_read_the_token_itself():
  views = ('forward', 'backward', 'future', 'past')
  model = model_lib.FinetuneModel(
    tiny_cfg('encoder'), 'token', 3, cvt_views=views
  )
  batch = rows(pad_from=10)
  params = init(model, batch)
  unlabeled = dict(batch, cvt_weight=jnp.ones((2, 10)))

  def outputs(b):
    out = model.apply({'params': params}, b, deterministic=True)
    return {k: np.asarray(v) for k, v in out.items()}

  t = 4
  base = outputs(unlabeled)
  changed = outputs(
    dict(unlabeled, input_ids=batch['input_ids'].at[:, t].set(3))
  )
  moved = {
    k: np.abs(changed[k] - base[k]).max(axis=(0, 2)) > 1e-6 for k in base
  }
  # future: the forward state of t - 1; past: the backward state of t + 1.
  assert (
    not moved['cvt_future'][: t + 1].any()
    and moved['cvt_future'][t + 1 :].all()
  )
  assert not moved['cvt_past'][t:].any() and moved['cvt_past'][:t].all()
  assert moved['cvt_forward'][t] and moved['cvt_backward'][t]


def test_mask_view_hides_real_non_special_tokens_at_the_rate():
  B, L = 64, 100
  ids = np.random.default_rng(0).integers(5, 50, (B, L))
  ids[:, 0], ids[:, 1] = 1, 2  # [CLS] and [SEP] stand-ins, never masked
  mask = np.ones((B, L), np.int32)
  mask[:, 80:] = 0
  batch = {'input_ids': jnp.asarray(ids), 'input_mask': jnp.asarray(mask)}
  out = np.asarray(
    model_lib.mask_tokens(jax.random.key(0), batch, 0.3, 4, (1, 2))['input_ids']
  )
  hit = out != ids
  assert (out[hit] == 4).all()
  assert not hit[:, :2].any() and not hit[:, 80:].any()
  assert abs(hit[:, 2:80].mean() - 0.3) < 0.02


# --- The loss.


def cvt_model(head='classification', views=('forward', 'backward', 'mask')):
  return model_lib.FinetuneModel(
    tiny_cfg('encoder'),
    head,
    3,
    cvt_views=views,
    cvt_mask_id=4,
    cvt_keep_ids=(0,),
  )


@pytest.mark.parametrize('head', ['classification', 'token'])
def test_auxiliary_loss_sends_no_gradient_into_the_primary_head(head):
  views = ('forward', 'backward', 'mask')
  if head == 'token':
    views += ('future', 'past')
  model = cvt_model(head, views)
  batch = rows()
  params = init(model, batch)
  weight = jnp.ones(2) if head == 'classification' else batch['input_mask']
  unlabeled = dict(batch, cvt_weight=weight)

  def loss(p):
    out = model.apply(
      {'params': p},
      unlabeled,
      deterministic=False,
      rngs={'dropout': jax.random.key(1)},
    )
    return losses.loss_fn(head)(out, unlabeled)[0]

  grads = jax.grad(loss)(params)
  norm = lambda tree: float(
    sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))
  )
  primary = 'classifier' if head == 'classification' else 'token'
  for suffix in ('kernel', 'bias'):
    assert norm(grads[f'{primary}_{suffix}']) == 0.0
    for view in views:
      assert norm(grads[f'cvt_{view}_{suffix}']) > 0.0, view
  assert norm(grads['backbone']) > 0.0

  # The teacher is the primary head's own prediction without dropout.
  out = model.apply({'params': params}, unlabeled, deterministic=True)
  plain = model.apply({'params': params}, batch, deterministic=True)
  (primary_logits,) = plain.values()
  np.testing.assert_allclose(out['cvt_teacher'], primary_logits, rtol=1e-6)


def test_cvt_loss_is_the_weighted_sum_of_kl_divergences():
  rng = np.random.default_rng(0)
  teacher, a, b = (
    rng.normal(size=(4, 6, 3)).astype(np.float32) for _ in range(3)
  )
  weight = (rng.random((4, 6)) > 0.3).astype(np.float32)
  outputs = {'cvt_teacher': teacher, 'cvt_forward': a, 'cvt_past': b}
  loss, metrics = losses.cvt_loss(outputs, {'cvt_weight': weight})

  def kl(p_logits, q_logits):
    p = np.exp(p_logits) / np.exp(p_logits).sum(-1, keepdims=True)
    q = np.exp(q_logits) / np.exp(q_logits).sum(-1, keepdims=True)
    per = (p * (np.log(p) - np.log(q))).sum(-1)
    return (per * weight).sum() / weight.sum()

  np.testing.assert_allclose(
    metrics['cvt_forward_kl'], kl(teacher, a), rtol=1e-5
  )
  np.testing.assert_allclose(metrics['cvt_past_kl'], kl(teacher, b), rtol=1e-5)
  np.testing.assert_allclose(loss, kl(teacher, a) + kl(teacher, b), rtol=1e-5)
  assert metrics['num_predictions'] == weight.sum()


# --- What is refused.


def test_views_a_body_or_head_cannot_have_are_refused():
  with pytest.raises(ValueError, match="'future'.*token head"):
    cvt_model('classification', ('future',))
  with pytest.raises(ValueError, match="'forward'.*'decoder'.*'mask'"):
    model_lib.FinetuneModel(
      tiny_cfg('decoder'), 'classification', 2, cvt_views=('forward',)
    )
  with pytest.raises(ValueError, match='span'):
    model_lib.FinetuneModel(tiny_cfg('encoder'), 'span', 2, cvt_views=('mask',))
  assert model_lib.default_cvt_views('token', 'electra') == (
    'forward',
    'backward',
    'future',
    'past',
  )
  assert model_lib.default_cvt_views('classification', 'decoder') == ('mask',)


def test_config_checks_name_the_field(tmp_path):
  c = load_config('finetune/glue', 'task=sst2')
  c.cvt.unlabeled = 'train'
  with pytest.raises(ValueError, match='task.max_train_examples'):
    config_lib.check_cvt(c, 'classification')
  c.task.max_train_examples = 100
  config_lib.check_cvt(c, 'classification')
  with pytest.raises(ValueError, match="'regression' head"):
    config_lib.check_cvt(c, 'regression')
  c.cvt.views = 'forward,sideways'
  with pytest.raises(ValueError, match='sideways'):
    config_lib.check_cvt(c, 'classification')
  c.cvt.views = ''
  c.cvt.doc_format = 'paragraph'
  with pytest.raises(ValueError, match="cvt.doc_format='paragraph'"):
    config_lib.check_cvt(c, 'classification')
  c.cvt.doc_format = 'line'
  c.head.freeze_backbone = True
  with pytest.raises(ValueError, match='head.freeze_backbone'):
    config_lib.check_cvt(c, 'classification')


# --- The run.


@pytest.fixture(scope='module')
def bert(tiny_workdir):
  return tiny_workdir('bert')


def cvt_config(init, unlabeled='train', **overrides):
  c = load_config('finetune/glue', 'task=sst2')
  c.init.workdir = init
  c.task.seq_len = 32
  c.task.max_train_examples = 16
  c.task.max_eval_examples = 32
  c.cvt.unlabeled = unlabeled
  c.cvt.max_unlabeled_examples = 24
  c.data.batch_size = 8
  c.train.num_steps = 8
  c.train.log_every = 4
  c.train.eval_every = 8
  c.train.progress_bar = False
  c.optimizer.learning_rate = 2e-3
  c.checkpoint.async_save = False
  for key, value in overrides.items():
    section, field = key.split('__')
    c[section][field] = value
  return c


def test_steps_alternate_labelled_and_unlabelled_batches(bert, tmp_path):
  c = cvt_config(bert)
  run = trainer.Trainer(c, str(tmp_path / 'cvt'), one_device())
  plain_config = cvt_config(bert, unlabeled='')
  plain = trainer.Trainer(plain_config, str(tmp_path / 'plain'), one_device())
  assert run.steps_per_epoch == 2 * plain.steps_per_epoch == 4
  assert run.unlabeled.num_rows == 24
  # The unlabelled rows are the training examples after the labelled 16.
  sst2 = trainer.TASKS['glue'].read(c.task, 'train')
  assert run.unlabeled.examples == sst2[16:40]
  unlabeled_ids = {tuple(r) for r in run.unlabeled.features['input_ids']}
  labelled_ids = {tuple(r) for r in run.train_split.features['input_ids']}
  for step in range(8):
    batch = run.train_batch(step)
    if step % 2:  # unlabelled: inputs and weights, no label
      assert set(batch) == {
        'input_ids',
        'input_mask',
        'token_type_ids',
        'cvt_weight',
      }
      assert {tuple(r) for r in batch['input_ids']} <= unlabeled_ids
    else:  # labelled: exactly the batch the plain run takes at step // 2
      expected = plain.train_batch(step // 2)
      assert set(batch) == set(expected)
      for k in batch:
        np.testing.assert_array_equal(batch[k], expected[k])
      assert {tuple(r) for r in batch['input_ids']} <= labelled_ids
  # 24 unlabelled rows in batches of 8: the fourth unlabelled batch starts
  # a new shuffle, and every row was read once in the first three.
  seen = np.concatenate([run.train_batch(s)['input_ids'] for s in (1, 3, 5)])
  assert len({tuple(r) for r in seen}) == 24

  results = run.run()
  records = read_metrics(tmp_path / 'cvt')
  cvt = [r for r in records if 'cvt_loss' in r]
  gold = [r for r in records if 'loss' in r]
  assert len(cvt) == 2 and len(gold) == 2
  assert all(math.isfinite(r['cvt_loss']) and r['cvt_loss'] > 0 for r in cvt)
  for view in ('forward', 'backward', 'mask'):
    assert f'cvt_{view}_kl' in cvt[0] and f'cvt_{view}_agreement' in cvt[0]
  assert 0.0 <= results['final']['eval_accuracy'] <= 1.0
  # The fine-tuned workdir loads with its auxiliary heads and predicts.
  loaded = trainer.load(str(tmp_path / 'cvt'))
  assert {k for k in loaded.params if k.startswith('cvt_')} == {
    'cvt_forward_kernel',
    'cvt_forward_bias',
    'cvt_backward_kernel',
    'cvt_backward_bias',
    'cvt_mask_kernel',
    'cvt_mask_bias',
  }


def test_unlabelled_text_from_a_source_feeds_a_tagger(bert, tmp_path):
  data = tmp_path / 'conll'
  data.mkdir()
  fixtures = os.path.join(REPO, 'tests', 'data', 'conll')
  for name in ('train.txt', 'valid.txt'):
    with open(os.path.join(fixtures, name)) as f:
      (data / name).write_text(f.read())
  text = tmp_path / 'news.txt'
  text.write_text(
    'Germany beat France in Paris on Sunday .\n'
    'The European Commission said on Thursday it disagreed .\n'
    '\n'
    'Peter Blackburn reported from Brussels .\n'
    'Rain fell in London and Berlin .\n'
  )
  c = load_config('finetune/conll', f'data={data}')
  c.init.workdir = bert
  c.task.seq_len = 32
  c.cvt.unlabeled = str(text)
  c.data.batch_size = 4
  c.train.num_steps = 4
  c.train.log_every = 2
  c.train.eval_every = 4
  c.train.progress_bar = False
  c.checkpoint.async_save = False
  config_lib.check_config(c, str(tmp_path / 'run'))
  run = trainer.Trainer(c, str(tmp_path / 'run'), one_device())
  assert run.model.cvt_views == ('forward', 'backward', 'future', 'past')
  assert run.unlabeled.num_rows == 4  # the blank line is no document
  assert run.unlabeled.examples[3]['tokens'] == [
    'Rain',
    'fell',
    'in',
    'London',
    'and',
    'Berlin',
    '.',
  ]
  # The weight sits where a tag would be read: one per word.
  weight = run.unlabeled.features['cvt_weight']
  assert weight.sum(axis=1).tolist() == [8, 9, 6, 7]
  run.run()
  cvt = [r for r in read_metrics(tmp_path / 'run') if 'cvt_loss' in r]
  assert cvt and all(math.isfinite(r['cvt_loss']) for r in cvt)
  assert {'cvt_future_kl', 'cvt_past_kl'} <= set(cvt[0])


def test_a_step_leaves_what_its_loss_does_not_reach_untouched():
  params = {'head': jnp.ones(3), 'aux': jnp.ones(2)}
  tx = optax.adamw(0.1, weight_decay=0.5)
  skipping = ft_optimizer.skip_unreached(tx)
  state = skipping.init(params)
  grads = {'head': jnp.asarray([1.0, -2.0, 0.5]), 'aux': jnp.zeros(2)}
  updates, new_state = skipping.update(grads, state, params)
  # The reached param moves exactly as AdamW moves it ...
  plain, plain_state = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates['head'], plain['head'])
  np.testing.assert_array_equal(
    new_state[0].mu['head'], plain_state[0].mu['head']
  )
  # ... the other keeps its value (no decay) and its moments.
  assert np.asarray(plain['aux']).all()  # AdamW alone would decay it
  np.testing.assert_array_equal(updates['aux'], np.zeros(2))
  np.testing.assert_array_equal(new_state[0].mu['aux'], state[0].mu['aux'])
  np.testing.assert_array_equal(new_state[0].nu['aux'], state[0].nu['aux'])
  # A later step that reaches it does not see momentum from the first.
  grads2 = {'head': jnp.zeros(3), 'aux': jnp.asarray([1.0, 1.0])}
  _, state2 = skipping.update(grads2, new_state, params)
  np.testing.assert_array_equal(state2[0].mu['head'], new_state[0].mu['head'])
  np.testing.assert_allclose(state2[0].mu['aux'], 0.1 * np.ones(2), rtol=1e-6)
