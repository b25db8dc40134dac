"""ELECTRA's joint loss: gradients stay where the paper puts them.

The generator is trained by its MLM loss only: its samples are drawn with
no gradient, so the discriminator's loss reaches the generator's layers
through nothing but the shared embeddings. And the loss is MLM + 50 x the
discriminator's mean binary cross-entropy, checked against numpy. And a
tiny discriminator learns to spot replaced tokens from that loss.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pretrain_lm.models import MODELS, ModelConfig
from pretrain_lm.objectives import electra

V, B, L = 64, 2, 16


def _batch():
  rng = np.random.default_rng(0)
  ids = rng.integers(5, V, (B, L)).astype(np.int32)
  positions = np.array([[1, 4, 7, 0], [2, 3, 9, 11]], np.int32)
  weights = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
  originals = np.take_along_axis(ids, positions, 1) * (weights > 0)
  masked = ids.copy()
  for b in range(B):
    masked[b, positions[b][weights[b] > 0]] = 4  # [MASK]
  return {
    'input_ids': masked,
    'input_mask': np.ones((B, L), np.int32),
    'masked_positions': positions,
    'masked_ids': originals.astype(np.int32),
    'masked_weights': weights,
  }


def _model():
  """A 2-layer, 32-wide ELECTRA with a half-width generator, no dropout."""
  return MODELS['electra'](
    ModelConfig(
      family='electra',
      vocab_size=V,
      num_layers=2,
      emb_dim=32,
      num_heads=4,
      head_dim=8,
      mlp_dim=64,
      max_len=L,
      type_vocab_size=0,
      generator_width=0.5,
      dropout_rate=0.0,
      attention_dropout_rate=0.0,
    )
  )


@pytest.fixture(scope='module')
def model_and_params():
  model = _model()
  params = model.init(jax.random.key(0), _batch(), deterministic=True)['params']
  return model, params


def _grads(model, params, term):
  """Gradient of one metric of the ELECTRA loss (a sampling forward)."""
  batch = _batch()

  def metric(p):
    outputs = model.apply(
      {'params': p},
      batch,
      deterministic=False,
      rngs={'dropout': jax.random.key(1)},
    )
    _, metrics = electra.loss(outputs, batch, disc_weight=50.0)
    return metrics[term]

  return jax.grad(metric)(params)


def _norm(tree):
  return float(
    sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)) ** 0.5
  )


def test_discriminator_loss_does_not_reach_the_generator(model_and_params):
  model, params = model_and_params
  g = _grads(model, params, 'disc_loss')
  # Exactly zero: the samples are stop_gradient'ed integers.
  assert _norm(g['generator']) == 0.0
  assert _norm(g['generator_head']) == 0.0
  assert _norm(g['discriminator']) > 0
  assert _norm(g['discriminator_head']) > 0
  # The shared token table learns from both (the paper's tied embeddings).
  assert _norm(g['token_embed']) > 0


def test_generator_loss_does_not_reach_the_discriminator(model_and_params):
  model, params = model_and_params
  g = _grads(model, params, 'mlm_loss')
  assert _norm(g['discriminator']) == 0.0
  assert _norm(g['discriminator_head']) == 0.0
  assert _norm(g['generator']) > 0


def test_loss_is_mlm_plus_50_times_discriminator_bce(model_and_params):
  model, params = model_and_params
  batch = _batch()
  outputs = model.apply(
    {'params': params},
    batch,
    deterministic=False,
    rngs={'dropout': jax.random.key(1)},
  )
  total, metrics = electra.loss(outputs, batch, disc_weight=50.0)

  logits = np.asarray(outputs['mlm_logits'], np.float64)
  w = batch['masked_weights']
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp, batch['masked_ids'][..., None], -1)[..., 0]
  mlm = -(picked * w).sum() / w.sum()
  z = np.asarray(outputs['disc_logits'], np.float64)
  y = np.asarray(outputs['disc_labels'], np.float64)
  bce = np.mean(np.logaddexp(0, z) - y * z)  # input_mask is all ones
  np.testing.assert_allclose(metrics['mlm_loss'], mlm, rtol=1e-5)
  np.testing.assert_allclose(metrics['disc_loss'], bce, rtol=1e-5)
  np.testing.assert_allclose(total, mlm + 50 * bce, rtol=1e-5)
  # Reported separately, as the paper's plots do.
  assert {'disc_loss', 'disc_accuracy', 'mlm_loss'} <= set(metrics)
  accuracy = np.mean((z > 0) == (y > 0))
  np.testing.assert_allclose(metrics['disc_accuracy'], accuracy, rtol=1e-6)


def _auc(scores, labels):
  """Probability that a replaced token scores above an original one."""
  pos, neg = scores[labels == 1], scores[labels == 0]
  return float(np.mean(pos[:, None] > neg[None, :]))


def test_discriminator_learns_to_spot_replacements():
  # Rows count up (5, 6, ..., wrapping within 32 ids), so a replaced token
  # is visible from its neighbours. The loss is the discriminator's alone:
  # the generator stays at its near-uniform init and its samples are
  # random ids. If the labels did not follow the tokens the discriminator
  # reads, or its gradient did not reach it, the AUC would stay at 0.5.
  # (Which slots may be labelled is pinned in families_test.)
  model = _model()
  rng = np.random.default_rng(0)
  Bt, P = 16, 4

  def batch():
    start = rng.integers(0, 32, (Bt, 1))
    ids = (5 + (start + np.arange(L)) % 32).astype(np.int32)
    positions = np.sort(
      np.argsort(rng.random((Bt, L)), axis=1)[:, :P], axis=1
    ).astype(np.int32)
    masked = ids.copy()
    np.put_along_axis(masked, positions, 4, axis=1)  # [MASK]
    return {
      'input_ids': masked,
      'input_mask': np.ones((Bt, L), np.int32),
      'masked_positions': positions,
      'masked_ids': np.take_along_axis(ids, positions, 1),
      'masked_weights': np.ones((Bt, P), np.float32),
    }

  params = model.init(jax.random.key(0), batch(), deterministic=True)
  params = params['params']
  tx = optax.adam(3e-3)

  def disc_loss(p, b, key):
    outputs = model.apply(
      {'params': p}, b, deterministic=False, rngs={'dropout': key}
    )
    return electra.loss(outputs, b)[1]['disc_loss']

  @jax.jit
  def step(p, opt, b, key):
    grads = jax.grad(disc_loss)(p, b, key)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt

  def auc(p):
    b = batch()
    out = model.apply(
      {'params': p}, b, deterministic=False, rngs={'dropout': jax.random.key(9)}
    )
    return _auc(np.asarray(out['disc_logits']), np.asarray(out['disc_labels']))

  before = auc(params)
  opt = tx.init(params)
  for i in range(300):
    params, opt = step(params, opt, batch(), jax.random.key(i))
  after = auc(params)
  assert abs(before - 0.5) < 0.2
  # Half the samples fall outside the rows' 32 ids, so the token alone
  # gives an AUC of about 0.75; above 0.8 the context is used too.
  assert after > 0.8, (before, after)
