"""train.prng_impl: the PRNG of the train step's dropout masks.

A toy model whose parameters all pass through one dropout makes the step's
mask observable: with SGD at learning rate 1 and a loss that sums the
dropped-out parameters, the update is -mask / keep, element for element.
Each test compares that mask with one drawn from a key derived here, by
hand, from the state's key and step.
"""

import functools
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import one_device
from flax import linen as nn

from pretrain_lm.training import step as step_lib
from pretrain_lm.training.state import TrainState

RATE = 0.1
N = 1 << 16  # parameters, each dropped or kept
SEED, STEP = 7, 5
IMPLS = ('threefry', 'rbg', 'unsafe_rbg')
JAX_IMPLS = {'rbg': 'rbg', 'unsafe_rbg': 'unsafe_rbg'}


class Toy(nn.Module):
  """w_N, scaled by each row's x and dropped out: out_BN."""

  @nn.compact
  def __call__(self, batch, deterministic):
    w_N = self.param('w', nn.initializers.ones, (N,))
    return nn.Dropout(RATE)(batch['x'][:, None] * w_N, deterministic)


def toy_loss(out_BN, batch):
  loss = jnp.sum(out_BN) / batch['x'].shape[0]
  return loss, {'loss': loss}


def reference_key(impl: str, seed=SEED, step=STEP):
  """The dropout key, spelled out: the state's threefry key folded with the
  step (the step's derivation before train.prng_impl existed); for the
  RngBitGenerator impls, their uint32[4] key data as its random bits."""
  key = jax.random.fold_in(jax.random.key(seed, impl='threefry2x32'), step)
  if impl == 'threefry':
    return key
  data = jax.random.bits(key, (4,), jnp.uint32)
  return jax.random.wrap_key_data(data, impl=JAX_IMPLS[impl])


def reference_out(key, x_B):
  """The toy model's out_BN for rows `x_B`, dropped out by Flax's own
  Dropout drawing from `key`."""
  return Toy().apply(
    {'params': {'w': jnp.ones(N)}},
    {'x': jnp.asarray(x_B)},
    deterministic=False,
    rngs={'dropout': key},
  )


def reference_mask(key):
  """The mask the toy model draws from `key` for one row."""
  return np.asarray(reference_out(key, [1.0])[0] != 0)


def state_at(step=STEP, seed=SEED):
  tx = optax.sgd(1.0)
  params = {'w': jnp.ones(N)}
  return TrainState(
    step=jnp.int32(step),
    params=params,
    opt_state=tx.init(params),
    rng=jax.random.key_data(jax.random.key(seed)),
  ), tx


@functools.cache
def jitted_step(impl: str, accum: int = 1):
  _, tx = state_at()
  return jax.jit(
    functools.partial(
      step_lib.train_step,
      model=Toy(),
      tx=tx,
      loss_fn=toy_loss,
      schedule=lambda step: 1.0,
      grad_accum_steps=accum,
      prng_impl=impl,
    )
  )


def step_mask(impl: str, step=STEP, seed=SEED):
  """(the mask the train step drew, the new state)."""
  state, _ = state_at(step, seed)
  new_state, _ = jitted_step(impl)(state, {'x': jnp.ones((1,))})
  update_N = np.asarray(new_state.params['w']) - 1.0  # -mask / keep
  np.testing.assert_allclose(
    update_N[update_N != 0], -1 / (1 - RATE), rtol=1e-6
  )
  return update_N != 0, new_state


@pytest.mark.parametrize('impl', IMPLS)
def test_dropout_key_is_the_reference_derivation(impl):
  state, _ = state_at()
  key = step_lib.dropout_key(state.rng, state.step, impl)
  want = reference_key(impl)
  assert jax.random.key_impl(key) == jax.random.key_impl(want)
  np.testing.assert_array_equal(
    jax.random.key_data(key), jax.random.key_data(want)
  )


@pytest.mark.parametrize('impl', IMPLS)
def test_step_draws_the_reference_mask(impl):
  mask, _ = step_mask(impl)
  np.testing.assert_array_equal(mask, reference_mask(reference_key(impl)))


def test_threefry_is_the_default_and_bit_for_bit_the_old_step():
  """The default path draws from fold_in(wrap_key_data(state.rng), step)
  itself, with the state's key data as the step reads it."""
  state, tx = state_at()
  old_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), STEP)
  step = jax.jit(
    functools.partial(
      step_lib.train_step,
      model=Toy(),
      tx=tx,
      loss_fn=toy_loss,
      schedule=lambda step: 1.0,
    )
  )
  new_state, _ = step(state, {'x': jnp.ones((1,))})
  mask = np.asarray(new_state.params['w']) != 1.0
  np.testing.assert_array_equal(mask, reference_mask(old_key))


@pytest.mark.parametrize('impl', ('rbg', 'unsafe_rbg'))
def test_rbg_masks_are_a_function_of_seed_and_step(impl):
  """The same (seed, step) draws the same mask, as a resume there does;
  another step or seed, and threefry, draw other masks. The fraction kept
  is 1 - rate to within 6 standard deviations."""
  mask, _ = step_mask(impl)
  again, _ = step_mask(impl)
  np.testing.assert_array_equal(mask, again)
  for other in (
    step_mask(impl, step=STEP + 1)[0],
    step_mask(impl, seed=SEED + 1)[0],
    step_mask('threefry')[0],
  ):
    # Independent masks disagree on 2 * rate * keep of the elements.
    assert abs(np.mean(mask != other) - 2 * RATE * (1 - RATE)) < 0.01
  sd = np.sqrt(RATE * (1 - RATE) / N)
  assert abs(np.mean(mask) - (1 - RATE)) < 6 * sd


def test_state_key_keeps_its_shape_under_every_impl():
  """state.rng stays threefry's uint32[2], untouched by the step, so the
  state (and a checkpoint of it) has one structure under every impl."""
  states = [step_mask(impl)[1] for impl in IMPLS]
  start, _ = state_at()
  shapes = [
    jax.tree.map(lambda x: (x.shape, x.dtype), jax.device_get(s))
    for s in states
  ]
  assert shapes[0] == shapes[1] == shapes[2]
  for s in states:
    assert s.rng.shape == (2,) and s.rng.dtype == jnp.uint32
    np.testing.assert_array_equal(s.rng, start.rng)


def test_grad_accumulation_folds_the_rbg_key_per_microbatch():
  """Two microbatches under unsafe_rbg: microbatch i (rows r with
  r % 2 == i) draws from fold_in(key, i); the update is the mean of their
  gradients."""
  state, _ = state_at()
  x_B = jnp.array([1.0, 2.0, 3.0, 4.0])
  new_state, metrics = jitted_step('unsafe_rbg', accum=2)(state, {'x': x_B})
  key = reference_key('unsafe_rbg')
  # d loss_i / d w_N = the microbatch's out_BN summed over its rows / rows.
  grad_N = (
    sum(
      np.asarray(reference_out(jax.random.fold_in(key, i), x_B[i::2])).mean(0)
      for i in range(2)
    )
    / 2
  )
  np.testing.assert_allclose(
    np.asarray(new_state.params['w']), 1.0 - grad_N, rtol=1e-6
  )
  assert np.isfinite(metrics['loss'])


@pytest.mark.parametrize('impl', IMPLS)
def test_a_trainers_step_follows_its_config(impl):
  """jit_job_step, which both trainers' steps come from, hands the job's
  train.prng_impl to the step."""
  from pretrain_lm import sharding

  state, tx = state_at()
  mesh = one_device()
  job = types.SimpleNamespace(
    model=Toy(),
    tx=tx,
    loss_fn=toy_loss,
    schedule=lambda step: 1.0,
    shardings=sharding.replicated(mesh),
    mesh=mesh,
    config=ml_collections.ConfigDict({'train': {'prng_impl': impl}}),
  )
  new_state, _ = step_lib.jit_job_step(job, 1)(state, {'x': jnp.ones((1,))})
  mask = np.asarray(new_state.params['w']) != 1.0
  np.testing.assert_array_equal(mask, reference_mask(reference_key(impl)))


def test_unknown_impl_names_the_field():
  state, _ = state_at()
  with pytest.raises(ValueError, match=r"train.prng_impl='philox'"):
    step_lib.dropout_key(state.rng, state.step, 'philox')
  with pytest.raises(ValueError, match=r"expected one of \('threefry'"):
    step_lib.jit_train_step(
      Toy(), None, toy_loss, None, None, one_device(), prng_impl='rbg2'
    )
