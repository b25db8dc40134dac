"""pretrain_lm.models.layers against reference definitions.

Relative position bias by index against the table lookup; GELU against
the normal CDF.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pretrain_lm.models import layers


@pytest.mark.parametrize('bidirectional', [True, False])
def test_relative_bias_by_index_is_the_positions_bias_within_segments(
  bidirectional,
):
  from pretrain_lm.models.config import ModelConfig  # noqa: PLC0415

  # Rows of 200 (past max_distance=40, into the log-spaced buckets): packed
  # segments whose positions restart at 0, and a pad tail at position 0.
  cfg = ModelConfig(
    vocab_size=8, num_heads=3, relative_buckets=12, relative_max_distance=40
  )
  L = 200
  lengths = [[150, 30, 20], [7, 193, 0], [200, 0, 0]]
  segments = np.zeros((3, L), np.int32)
  positions = np.zeros((3, L), np.int32)
  for b, row in enumerate(lengths):
    start = 0
    for s, n in enumerate(row):
      segments[b, start : start + n] = s + 1
      positions[b, start : start + n] = np.arange(n)
      start += n
  table = jax.random.normal(jax.random.key(0), (12, 3))
  by_positions = layers.relative_bias(
    table, positions, positions, cfg, bidirectional
  )
  by_index = layers.relative_bias_by_index(table, L, L, cfg, bidirectional)
  assert by_index.shape == (1, 3, L, L)
  same = (segments[:, None, :] == segments[:, :, None]) & (segments > 0)[
    :, None
  ]
  same = np.broadcast_to(same[:, None], by_positions.shape)
  got = np.broadcast_to(np.asarray(by_index), by_positions.shape)
  np.testing.assert_array_equal(got[same], np.asarray(by_positions)[same])
  # Across segments the offsets differ: the mask hides those pairs.
  assert not np.array_equal(got[~same], np.asarray(by_positions)[~same])
  # Its gradient reaches the table as the positions' bias's does (up to
  # float32 sums of some 30,000 terms of either order).
  cot = jax.random.normal(jax.random.key(1), by_positions.shape) * same

  def grad(f):
    return jax.grad(lambda t: jnp.sum(f(t) * cot))(table)

  np.testing.assert_allclose(
    grad(lambda t: layers.relative_bias_by_index(t, L, L, cfg, bidirectional)),
    grad(
      lambda t: layers.relative_bias(
        t, positions, positions, cfg, bidirectional
      )
    ),
    rtol=1e-5,
    atol=1e-3,
  )


def test_gelu_is_x_times_the_normal_cdf_to_float32_rounding():
  xs = np.linspace(-12, 12, 24001, dtype=np.float32)
  x64 = xs.astype(np.float64)
  cdf = np.array([0.5 * (1 + math.erf(x / math.sqrt(2))) for x in x64])
  pdf = np.exp(-(x64**2) / 2) / math.sqrt(2 * math.pi)
  # Within 3 float32 ulps of the output's scale, value and slope.
  tol = 3 * np.finfo(np.float32).eps * np.maximum(np.abs(x64), 1)
  value = np.asarray(layers.gelu(jnp.asarray(xs)), np.float64)
  slope = np.asarray(jax.vmap(jax.grad(layers.gelu))(jnp.asarray(xs)))
  assert np.all(np.abs(value - x64 * cdf) <= tol)
  assert np.all(np.abs(slope - (cdf + x64 * pdf)) <= tol)
  assert layers.ACTIVATIONS['gelu'] is layers.gelu

  # bfloat16 stays bfloat16.
  y = layers.gelu(jnp.asarray(xs, jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(y, np.float64), value, rtol=1e-2, atol=1e-2
  )
