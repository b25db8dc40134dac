"""Tests for objective.cross_entropy: the fused token cross-entropy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pretrain_lm import configlib
from pretrain_lm.objectives import OBJECTIVES, loss_fn, xent

V = 37
SHAPES = [(), (6,), (2, 5), (2, 3, 4)]  # the leading shapes of the logits


def _inputs(lead, dtype, seed=0):
  """Logits (dtype) [*lead, V], labels int32 [*lead], weights f32 [*lead]."""
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(3 * rng.normal(size=(*lead, V)), dtype)
  labels = jnp.asarray(rng.integers(0, V, lead), jnp.int32)
  weights = jnp.asarray(rng.uniform(size=lead), jnp.float32)
  return logits, labels, weights


def _reference(logits, labels, weights):
  """float64 xent, correctness and d sum(w * xent) / d logits, in numpy."""
  x = np.asarray(logits.astype(jnp.float32), np.float64)
  labels, weights = np.asarray(labels), np.asarray(weights, np.float64)
  log_p = x - x.max(-1, keepdims=True)
  log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
  onehot = np.arange(V) == labels[..., None]
  xent_ref = -np.sum(np.where(onehot, log_p, 0.0), -1)
  correct = (np.argmax(x, -1) == labels).astype(np.float32)
  grad = (np.exp(log_p) - onehot) * weights[..., None]
  return xent_ref, correct, grad


def _fused_grad(logits, labels, weights):
  return jax.grad(
    lambda x: jnp.sum(xent.cross_entropy(x, labels)[0] * weights)
  )(logits)


@pytest.mark.parametrize('lead', SHAPES)
def test_fused_float32_equals_the_reference_values_and_gradient(lead):
  logits, labels, weights = _inputs(lead, jnp.float32)
  xent_ref, correct_ref, grad_ref = _reference(logits, labels, weights)
  values, correct = jax.jit(xent.cross_entropy)(logits, labels)
  assert values.dtype == correct.dtype == jnp.float32
  assert values.shape == correct.shape == lead
  np.testing.assert_allclose(values, xent_ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(correct, correct_ref)
  grad = jax.jit(_fused_grad)(logits, labels, weights)
  assert grad.dtype == jnp.float32
  np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('lead', SHAPES)
def test_fused_bfloat16_equals_the_reference_within_bfloat16_rounding(lead):
  logits, labels, weights = _inputs(lead, jnp.bfloat16, seed=1)
  # The reference sees the same (bf16-representable) values in float64.
  xent_ref, correct_ref, grad_ref = _reference(logits, labels, weights)
  values, correct = jax.jit(xent.cross_entropy)(logits, labels)
  assert values.dtype == jnp.float32  # float32 arithmetic inside
  np.testing.assert_allclose(values, xent_ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(correct, correct_ref)
  grad = jax.jit(_fused_grad)(logits, labels, weights)
  assert grad.dtype == jnp.bfloat16  # dlogits in the logits' dtype
  # bfloat16 keeps 8 significant bits: half an ulp is 2**-9 relative.
  np.testing.assert_allclose(
    np.asarray(grad, np.float64), grad_ref, rtol=2**-8, atol=1e-30
  )


def test_fused_equals_optax_values_and_gradients():
  logits, labels, weights = _inputs((4, 6), jnp.bfloat16, seed=2)

  def weighted(impl):
    def f(x):
      with xent.implementation(impl):
        values, correct = xent.token_xent(x, labels)
      return jnp.sum(values * weights), (values, correct)

    return jax.jit(jax.grad(f, has_aux=True))(logits)

  grad_optax, (values_optax, correct_optax) = weighted('optax')
  grad_fused, (values_fused, correct_fused) = weighted('fused')
  np.testing.assert_allclose(values_fused, values_optax, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(correct_fused, correct_optax)
  assert grad_fused.dtype == grad_optax.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(grad_fused, np.float32),
    np.asarray(grad_optax, np.float32),
    rtol=2**-7,
    atol=1e-30,
  )


def test_ties_count_as_jnp_argmax_does():
  # Two maxima per row: the first one is the prediction.
  logits = jnp.zeros((3, V), jnp.bfloat16).at[:, 4].set(2.0).at[:, 9].set(2.0)
  labels = jnp.asarray([4, 9, 0], jnp.int32)
  _, correct = xent.cross_entropy(logits, labels)
  expected = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  np.testing.assert_array_equal(correct, expected)
  np.testing.assert_array_equal(correct, [1.0, 0.0, 0.0])


def _vocab_residuals(impl, logits, labels):
  """(dtype, shape) of what the backward pass keeps that spans the vocab."""
  with xent.implementation(impl):
    return _residuals(logits, labels)


def _residuals(logits, labels):
  _, vjp = jax.vjp(lambda x: xent.token_xent(x, labels)[0], logits)
  leaves = jax.tree.leaves(vjp)
  return {
    (str(leaf.dtype), leaf.shape) for leaf in leaves if leaf.shape[-1:] == (V,)
  }, leaves


def test_fused_backward_keeps_only_the_logits_and_a_float32_lse_per_row():
  logits, labels, _ = _inputs((4, 6), jnp.bfloat16)
  vocab, leaves = _vocab_residuals('fused', logits, labels)
  assert vocab == {('bfloat16', (4, 6, V))}
  # The rest is per row: the float32 log-sum-exp and the labels.
  assert all(leaf.size <= 4 * 6 for leaf in leaves if leaf.shape[-1:] != (V,))
  assert any(
    leaf.dtype == jnp.float32 and leaf.shape == (4, 6) for leaf in leaves
  )
  # Against which optax's autodiff keeps a float32 copy of the vocab axis.
  vocab, _ = _vocab_residuals('optax', logits, labels)
  assert ('float32', (4, 6, V)) in vocab


def test_fused_gradient_needs_less_temporary_memory_for_bfloat16():
  rows, vocab = 64, 1024
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(rows, vocab)), jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, vocab, rows), jnp.int32)

  def temp_bytes(impl):
    def f(x):
      with xent.implementation(impl):
        return jnp.sum(xent.token_xent(x, labels)[0])

    compiled = jax.jit(jax.grad(f)).lower(logits).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes('fused') < temp_bytes('optax')


def test_an_unknown_implementation_names_the_field():
  with pytest.raises(ValueError, match=r'objective\.cross_entropy'):
    xent.implementation('pallas').__enter__()
  config = configlib.objective_section()
  config.cross_entropy = 'pallas'
  logits, labels, weights = _inputs((2, 5), jnp.float32)
  batch = {'target_ids': labels, 'target_weights': weights}
  with pytest.raises(ValueError, match=r'objective\.cross_entropy'):
    loss_fn(OBJECTIVES['clm'], config)({'logits': logits}, batch)


def _objective_case(name, dtype):
  """(outputs, batch) for objective `name`, with logits of `dtype`."""
  rng = np.random.default_rng(4)
  logits, labels, weights = _inputs((2, 5), dtype, seed=5)
  if name in ('mlm', 'electra'):
    outputs = {'mlm_logits': logits}
    batch = {'masked_ids': labels, 'masked_weights': weights}
    if name == 'mlm':  # BERT's sentence task stays optax's
      outputs['sentence_logits'] = jnp.asarray(rng.normal(size=(2, 2)), dtype)
      batch['sentence_labels'] = jnp.asarray([0, 1], jnp.int32)
      batch['sentence_weights'] = jnp.ones(2, jnp.float32)
    else:
      outputs['disc_logits'] = jnp.asarray(rng.normal(size=(2, 7)), dtype)
      outputs['disc_labels'] = jnp.asarray(rng.integers(0, 2, (2, 7)))
      batch['input_mask'] = jnp.ones((2, 7), jnp.int32)
    return outputs, batch
  outputs = {'logits': logits}
  batch = {'target_ids': labels, 'target_weights': weights}
  if name == 'bilm':
    backward, back_labels, back_weights = _inputs((2, 5), dtype, seed=6)
    outputs['backward_logits'] = backward
    batch['backward_target_ids'] = back_labels
    batch['backward_target_weights'] = back_weights
  return outputs, batch


def _logit_keys(outputs):
  return [
    k for k in outputs if k in ('mlm_logits', 'logits', 'backward_logits')
  ]


def _loss_and_grads(loss, outputs, batch):
  """The jitted loss, metrics and gradient wrt every vocabulary logits."""
  keys = _logit_keys(outputs)

  def f(vocab_logits):
    return loss(
      {**outputs, **dict(zip(keys, vocab_logits, strict=True))}, batch
    )

  grad_fn = jax.jit(jax.value_and_grad(f, has_aux=True))
  return grad_fn([outputs[k] for k in keys])


@pytest.mark.parametrize('name', ['mlm', 'clm', 'electra', 'bilm'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_loss_fn_fused_matches_optax(name, dtype):
  outputs, batch = _objective_case(name, dtype)
  config = configlib.objective_section()
  optax_loss = loss_fn(OBJECTIVES[name], config)
  config.cross_entropy = 'fused'
  fused_loss = loss_fn(OBJECTIVES[name], config)
  (loss_o, metrics_o), grads_o = _loss_and_grads(optax_loss, outputs, batch)
  (loss_f, metrics_f), grads_f = _loss_and_grads(fused_loss, outputs, batch)
  np.testing.assert_allclose(loss_f, loss_o, rtol=1e-6)
  assert metrics_f.keys() == metrics_o.keys()
  for key in metrics_o:
    np.testing.assert_allclose(metrics_f[key], metrics_o[key], rtol=1e-6)
  # Same gradients, up to the logits' rounding of two float32 values.
  rtol = 1e-5 if dtype == jnp.float32 else 2**-7
  for grad_f, grad_o in zip(grads_f, grads_o, strict=True):
    assert grad_f.dtype == grad_o.dtype == dtype
    np.testing.assert_allclose(
      np.asarray(grad_f, np.float32),
      np.asarray(grad_o, np.float32),
      rtol=rtol,
      atol=1e-9,
    )


def _float32_vocab_residuals(loss, outputs, batch):
  """How many float32 [..., V] arrays the loss's backward pass keeps."""
  keys = _logit_keys(outputs)

  def f(vocab_logits):
    return loss(
      {**outputs, **dict(zip(keys, vocab_logits, strict=True))}, batch
    )

  _, vjp, _ = jax.vjp(f, [outputs[k] for k in keys], has_aux=True)
  return sum(
    leaf.dtype == jnp.float32 and leaf.shape[-1:] == (V,)
    for leaf in jax.tree.leaves(vjp)
  )


@pytest.mark.parametrize('name', ['mlm', 'clm', 'electra', 'bilm'])
def test_loss_fn_fused_keeps_no_float32_logits_for_bfloat16(name):
  outputs, batch = _objective_case(name, jnp.bfloat16)
  config = configlib.objective_section()
  assert _float32_vocab_residuals(
    loss_fn(OBJECTIVES[name], config), outputs, batch
  )
  config.cross_entropy = 'fused'
  fused_loss = loss_fn(OBJECTIVES[name], config)
  assert not _float32_vocab_residuals(fused_loss, outputs, batch)


@pytest.mark.parametrize('name', ['mlm', 'clm', 'electra', 'bilm'])
def test_loss_fn_optax_is_the_objectives_own_loss_bit_for_bit(name):
  outputs, batch = _objective_case(name, jnp.bfloat16)
  config = configlib.objective_section()
  assert config.cross_entropy == 'optax'  # the default
  objective = OBJECTIVES[name]
  own = (
    objective.make_loss(config)
    if hasattr(objective, 'make_loss')
    else objective.loss
  )
  (loss_a, metrics_a), grads_a = _loss_and_grads(
    loss_fn(objective, config), outputs, batch
  )
  (loss_b, metrics_b), grads_b = _loss_and_grads(own, outputs, batch)
  np.testing.assert_array_equal(loss_a, loss_b)
  for key in metrics_b:
    np.testing.assert_array_equal(metrics_a[key], metrics_b[key])
  for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
    np.testing.assert_array_equal(grad_a, grad_b)


def test_the_fused_choice_holds_inside_the_loss_call_only():
  outputs, batch = _objective_case('clm', jnp.bfloat16)
  config = configlib.objective_section()
  config.cross_entropy = 'fused'
  loss = loss_fn(OBJECTIVES['clm'], config)
  jax.grad(lambda x: loss({'logits': x}, batch)[0])(outputs['logits'])
  # Outside it, token_xent is optax's again (a float32 copy of the logits
  # for the backward pass).
  vocab, _ = _residuals(outputs['logits'], batch['target_ids'])
  assert ('float32', outputs['logits'].shape) in vocab
