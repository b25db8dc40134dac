"""The vocabulary-wide top-1 and sampling helpers of models/heads.py
against jnp.argmax and the softmax they sample from."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pretrain_lm.models import heads


def tied(shape, seed=0):
  """Logits on a coarse grid, so that most rows tie for the maximum."""
  x = np.random.default_rng(seed).integers(-3, 3, shape).astype(np.float32)
  x[0, 0, :3] = -np.inf  # masked entries
  x[0, 1, -1] = 7.0  # the maximum at the last entry (a partial block)
  x[0, 2, -1] = x[0, 2, 1] = 7.0  # tied in the first and last blocks
  x[1, 0] = 1.0  # a row of equal logits
  return jnp.asarray(x)


def test_is_argmax_is_argmax_equals_the_label_ties_included():
  x = tied((3, 5, 40))
  argmax = np.asarray(jnp.argmax(x, -1))
  # Labels at the argmax, at a later tied maximum, and anywhere.
  later = np.array(
    [[np.flatnonzero(r == r.max())[-1] for r in row] for row in np.asarray(x)]
  )
  rand = np.random.default_rng(1).integers(0, 40, (3, 5))
  for labels in (argmax, later, rand):
    want = argmax == labels
    got = np.asarray(heads.is_argmax(x, jnp.asarray(labels)))
    np.testing.assert_array_equal(got, want)
  assert (later != argmax).any()  # the tie rule was exercised


@pytest.mark.parametrize('V', [6, 300])
def test_samples_follow_the_softmax(V):
  # A few likely entries spread over the blocks, the rest sharing 10%.
  likely = np.array([0, 2, 4, 5]) if V == 6 else np.array([5, 130, 260, 299])
  probs = np.full(V, 0.1 / (V - 4))
  probs[likely] = [0.1, 0.2, 0.25, 0.35]
  n = 40_000
  logits = jnp.tile(jnp.log(jnp.asarray(probs, jnp.float32)), (n, 1))
  draws = np.asarray(
    jax.jit(heads.sample_categorical)(jax.random.key(0), logits)
  )
  counts = np.bincount(draws, minlength=V)
  # Every entry within 5 standard errors of its probability.
  sigma = np.sqrt(n * probs * (1 - probs))
  assert np.all(np.abs(counts - n * probs) < 5 * sigma + 1)
  again = heads.sample_categorical(jax.random.key(0), logits[:64])
  np.testing.assert_array_equal(again, draws[:64])
  other = heads.sample_categorical(jax.random.key(1), logits[:64])
  assert (np.asarray(other) != draws[:64]).any()


def test_samples_never_pick_a_masked_entry():
  logits = jnp.full((2000, 300), -jnp.inf).at[:, 7].set(0.0).at[:, 290].set(0.0)
  draws = np.asarray(heads.sample_categorical(jax.random.key(2), logits))
  assert set(np.unique(draws)) == {7, 290}


def test_vocab_bias_is_added_and_its_gradient_summed_over_every_row():
  logits = jax.random.normal(jax.random.key(0), (3, 4, 50))
  bias = jax.random.normal(jax.random.key(1), (50,))
  w = jax.random.normal(jax.random.key(2), (3, 4, 50))

  def loss(add):
    return lambda logits, bias: jnp.sum(jnp.sin(add(logits, bias)) * w)

  ours = loss(heads.add_vocab_bias)
  ref = loss(lambda logits, bias: logits + bias)
  assert ours(logits, bias) == ref(logits, bias)
  got = jax.grad(ours, argnums=(0, 1))(logits, bias)
  want = jax.grad(ref, argnums=(0, 1))(logits, bias)
  for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
  # The bias's gradient is the product with ones (layers.broadcast_rows)
  # over all 3 x 4 rows, not a reduce, on the CPU.
  text = jax.jit(jax.grad(ours, argnums=1)).lower(logits, bias).as_text()
  assert '(tensor<12x50xf32>, tensor<f32>) -> tensor<50xf32>' not in text
  assert '(tensor<12xf32>, tensor<12x50xf32>) -> tensor<50xf32>' in text
