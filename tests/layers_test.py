"""layers.Dropout against the definition of inverted Bernoulli dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pretrain_lm.models import layers


def drop(x, rate, seed=0, deterministic=False):
  return layers.Dropout(rate).apply(
    {}, x, deterministic, rngs={'dropout': jax.random.key(seed)}
  )


@pytest.mark.parametrize('rate', [0.1, 0.5, 0.9])
def test_drops_each_element_with_the_rate_and_rescales_the_rest(rate):
  x = jnp.ones((64, 4, 128, 129))  # an odd last axis: a half-used word
  y = np.asarray(drop(x, rate))
  n = y.size
  dropped = y == 0
  # Within 5 standard errors of Bernoulli(rate) over a million draws.
  assert abs(dropped.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / n)
  kept = y[~dropped]
  levels = 2**layers.DROPOUT_BITS
  np.testing.assert_allclose(
    kept, levels / round((1 - rate) * levels), rtol=1e-6
  )
  # Inverted dropout keeps the expectation.
  assert abs(y.mean() - 1) < 5 * np.sqrt(rate / (1 - rate) / n)


def test_elements_sharing_a_random_word_are_independent():
  """Both halves of each 32-bit word decide separately (and every word is
  used): neighbours are dropped together with probability rate^2."""
  rate = 0.5
  y = np.asarray(drop(jnp.ones((256, 4096)), rate)) == 0
  even, odd = y[:, 0::2], y[:, 1::2]
  both = (even & odd).mean()
  assert abs(both - rate**2) < 5 * np.sqrt(rate**2 * (1 - rate**2) / even.size)
  # Neither half is a copy or the complement of the other.
  assert 0.4 < (even == odd).mean() < 0.6
  # Rows differ: each row draws its own words.
  assert (y[0] != y[1]).any()


def test_masks_follow_the_rng_and_deterministic_is_the_identity():
  x = jax.random.normal(jax.random.key(5), (8, 16, 32))
  np.testing.assert_array_equal(drop(x, 0.3, seed=1), drop(x, 0.3, seed=1))
  assert (drop(x, 0.3, seed=1) != drop(x, 0.3, seed=2)).any()
  np.testing.assert_array_equal(drop(x, 0.3, deterministic=True), x)
  np.testing.assert_array_equal(drop(x, 0.0), x)


def test_gradient_flows_through_the_kept_elements_only():
  x = jax.random.normal(jax.random.key(5), (4, 64))
  grad = jax.grad(lambda x: jnp.sum(drop(x, 0.25)))(x)
  scaled = np.asarray(drop(jnp.ones_like(x), 0.25))  # 1 / keep or 0
  assert (scaled == 0).any() and (scaled != 0).any()
  np.testing.assert_array_equal(np.asarray(grad), scaled)


def test_keeps_the_input_dtype():
  x = jnp.ones((4, 8), jnp.bfloat16)
  assert drop(x, 0.1).dtype == jnp.bfloat16
