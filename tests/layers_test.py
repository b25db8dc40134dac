"""pretrain_lm.models.layers against reference definitions.

Dropout against inverted Bernoulli dropout and jax's threefry; relative
position bias by index against the table lookup; broadcast_rows and project
against the einsums they replace; GELU against the normal CDF; the cuDNN
attention path's mask handling.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import random as jex_random

from pretrain_lm.models import layers


def drop(x, rate, seed=0, deterministic=False, key=None):
  key = jax.random.key(seed) if key is None else key
  return layers.Dropout(rate).apply({}, x, deterministic, rngs={'dropout': key})


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


def test_elements_sharing_a_hash_are_independent():
  """The four draws of one threefry hash (two halves of each of its two
  words) decide separately: any two are dropped together with probability
  rate^2, and none is a copy or the complement of another."""
  rate = 0.5
  y = np.asarray(drop(jnp.ones((256, 4096)), rate)) == 0
  draws = [y[:, i::4] for i in range(4)]
  for i in range(4):
    for j in range(i + 1, 4):
      a, b = draws[i], draws[j]
      both = (a & b).mean()
      assert abs(both - rate**2) < 5 * np.sqrt(rate**2 * (1 - rate**2) / a.size)
      assert 0.4 < (a == b).mean() < 0.6
  # Rows differ: each row draws its own words.
  assert (y[0] != y[1]).any()


def test_threefry_hash_matches_jax():
  rng = np.random.default_rng(0)
  for _ in range(3):
    k1, k2 = (jnp.uint32(v) for v in rng.integers(0, 2**32, 2))
    x1, x2 = (
      jnp.asarray(rng.integers(0, 2**32, 4096), jnp.uint32) for _ in '12'
    )
    ours = layers.threefry2x32(k1, k2, x1, x2)
    theirs = jex_random.threefry2x32_p.bind(k1, k2, x1, x2)
    for a, b in zip(ours, theirs, strict=True):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('key', [jax.random.key(7), jax.random.PRNGKey(7)])
def test_random_words_hash_row_and_column(key):
  """Words 2c and 2c + 1 of row r (the flattened leading index) are the two
  outputs of one hash of the counter (r, c): every hash used once."""
  words = np.asarray(layers.random_words(key, (3, 5, 8)))
  k1, k2 = np.asarray(jax.random.key_data(key) if key.ndim == 0 else key)
  rows, cols = np.meshgrid(np.arange(15), np.arange(4), indexing='ij')
  expected = jex_random.threefry2x32_p.bind(
    jnp.uint32(k1),
    jnp.uint32(k2),
    jnp.asarray(rows, jnp.uint32),
    jnp.asarray(cols, jnp.uint32),
  )
  np.testing.assert_array_equal(
    words.reshape(15, 4, 2), np.stack(expected, axis=-1)
  )


def test_other_prng_implementations_draw_through_jax_random_bits():
  key = jax.random.key(3, impl='unsafe_rbg')
  np.testing.assert_array_equal(
    layers.random_words(key, (4, 6)), jax.random.bits(key, (4, 6), jnp.uint32)
  )
  y = np.asarray(drop(jnp.ones((64, 1024)), 0.25, key=key))
  assert abs((y == 0).mean() - 0.25) < 0.01


def test_mask_does_not_depend_on_the_sharding():
  devices = np.array(jax.devices()).reshape(4, 2)
  mesh = jax.sharding.Mesh(devices, ('data', 'model'))
  spec = jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec('data', None, 'model')
  )
  draw = lambda key: layers.keep_mask(key, (8, 16, 64), 0.9)[0]
  key = jax.random.key(11)
  sharded = jax.jit(draw, out_shardings=spec)(key)
  assert len(sharded.sharding.device_set) == 8
  np.testing.assert_array_equal(sharded, jax.jit(draw)(key))


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


@pytest.mark.parametrize('key', [jax.random.key(7), jax.random.PRNGKey(7)])
def test_a_block_of_the_mask_drawn_alone_is_that_block_of_the_whole(key):
  """keep_mask's window: the causal attention blocks draw the masks the
  whole [B, H, L, S] array would get, key columns up to any length."""
  full = (2, 3, 10, 37)  # an odd row: a half-used last word
  whole, p = layers.keep_mask(key, full, 0.7)
  for q0, q1, s1 in [(0, 4, 4), (4, 8, 9), (8, 10, 37), (3, 4, 1)]:
    block, p_block = layers.keep_mask(
      key, (2, 3, q1 - q0, s1), 0.7, (full, (0, 0, q0, 0))
    )
    assert p_block == p
    np.testing.assert_array_equal(block, whole[:, :, q0:q1, :s1])
  x = jax.random.normal(jax.random.key(1), full)
  starts = [(0, 0, 0, 0), (0, 0, 6, 0)]
  blocks = layers.Dropout(0.3).apply(
    {},
    [x[:, :, :6, :20], x[:, :, 6:, :]],
    full,
    starts,
    False,
    rngs={'dropout': jax.random.key(2)},
    method=layers.Dropout.blocks,
  )
  y = drop(x, 0.3, key=jax.random.key(2))
  np.testing.assert_array_equal(blocks[0], y[:, :, :6, :20])
  np.testing.assert_array_equal(blocks[1], y[:, :, 6:, :])


def test_blocks_must_lie_inside_the_array_from_its_first_column():
  key = jax.random.key(0)
  for shape, start in [((4, 8), (0, 2)), ((4, 8), (1, 0)), ((4, 9), (0, 0))]:
    with pytest.raises(ValueError, match=r'not inside an array of shape'):
      layers.keep_mask(key, shape, 0.9, ((4, 8), start))


def test_other_prng_implementations_draw_each_block_apart():
  # jax.random.bits cannot draw a block of a larger draw: each block draws
  # from the key folded with its position (other words, same distribution).
  key = jax.random.key(3, impl='unsafe_rbg')
  full = (2, 64, 64)
  a = layers.random_words(key, (2, 32, 64), (full, (0, 0, 0)))
  b = layers.random_words(key, (2, 32, 64), (full, (0, 32, 0)))
  assert (np.asarray(a) != np.asarray(b)).mean() > 0.99
  mask, _ = layers.keep_mask(key, (2, 32, 64), 0.75, (full, (0, 32, 0)))
  assert abs(np.asarray(mask).mean() - 0.75) < 0.03


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


def test_broadcast_rows_sums_its_gradient_as_a_product():
  x = jax.random.normal(jax.random.key(0), (1, 3, 5, 7))
  w = jax.random.normal(jax.random.key(1), (4, 3, 5, 7))

  def loss(broadcast):
    return lambda x: jnp.sum(jnp.sin(broadcast(x)) * w)

  ours = loss(lambda x: layers.broadcast_rows(x, 4))
  ref = loss(lambda x: jnp.broadcast_to(x, (4, 3, 5, 7)))
  assert ours(x) == ref(x)
  np.testing.assert_allclose(
    jax.grad(ours)(x), jax.grad(ref)(x), rtol=1e-6, atol=1e-6
  )

  # On the CPU the rows are summed by a dot with ones, not by a reduce over
  # axis 0 (the slow form there); on a GPU by the reduce.
  def lowered(platform):
    traced = jax.jit(jax.grad(ours)).trace(x)
    return traced.lower(lowering_platforms=(platform,)).as_text()

  row_sum = 'across dimensions = [0]'
  assert 'dot_general' in lowered('cpu') and row_sum not in lowered('cpu')
  assert 'dot_general' not in lowered('cuda') and row_sum in lowered('cuda')


PROJECTIONS = [
  ('BLD,DF->BLF', (2, 3, 4), (4, 5)),  # the MLP's first product
  ('BLD,DHK->BLHK', (2, 3, 4), (4, 2, 3)),  # query, key, value
  ('BLHK,HKD->BLD', (2, 3, 2, 3), (2, 3, 4)),  # attention's output
  ('BPE,VE->BPV', (2, 3, 4), (7, 4)),  # a tied vocabulary head
  ('BD,DC->BC', (2, 4), (4, 3)),  # a classifier
]


def dot_operand_ranks(text: str) -> list[tuple[int, int]]:
  """The operands' ranks of each dot_general in StableHLO text."""
  ranks = []
  for line in text.splitlines():
    if 'stablehlo.dot_general' in line:
      operands = line.rsplit(' : (', 1)[1].split(') -> ')[0]
      ranks.append(
        tuple(t.count('x') for t in operands.split(', ')),
      )
  return ranks


@pytest.mark.parametrize('equation,x_shape,w_shape', PROJECTIONS)
def test_project_is_the_einsum_and_takes_2d_products_on_the_cpu(
  equation, x_shape, w_shape
):
  x = jax.random.normal(jax.random.key(0), x_shape)
  w = jax.random.normal(jax.random.key(1), w_shape)
  out = jnp.einsum(equation, x, w)
  cotangent = jax.random.normal(jax.random.key(2), out.shape)

  def loss(product):
    return lambda x, w: jnp.sum(jnp.sin(product(equation, x, w)) * cotangent)

  np.testing.assert_allclose(layers.project(equation, x, w), out, rtol=1e-6)
  grads = jax.grad(loss(layers.project), (0, 1))(x, w)
  expected = jax.grad(loss(jnp.einsum), (0, 1))(x, w)
  for got, want in zip(grads, expected, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  # On the CPU the product and both gradients are [rows, in] x [in, out]
  # matrix products; other backends get the einsum over the dims as given.
  def ranks(platform):
    traced = jax.jit(jax.grad(loss(layers.project), (0, 1))).trace(x, w)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    return dot_operand_ranks(text)

  assert len(ranks('cpu')) == 3 and set(ranks('cpu')) == {(2, 2)}
  einsum_ranks = {(len(x_shape), len(w_shape)), (len(out.shape), len(w_shape))}
  assert len(ranks('cuda')) == 3 and set(ranks('cuda')) >= einsum_ranks


def dot_signatures(text: str) -> list[tuple[str, str, str, str]]:
  """(lhs contracting dims, lhs type, rhs type, result type) of each
  dot_general in StableHLO text."""
  found = []
  for line in text.splitlines():
    if 'stablehlo.dot_general' in line:
      lhs_dims = line.split('contracting_dims = ')[1].split(' x ')[0]
      types = line.rsplit(' : (', 1)[1]
      operands, result = types.split(') -> ')
      lhs, rhs = operands.split(', ')
      found.append((lhs_dims, lhs, rhs, result.strip()))
  return found


@pytest.mark.parametrize('equation,x_shape,w_shape', PROJECTIONS)
def test_bfloat16_projections_accumulate_in_float32_on_the_cpu(
  equation, x_shape, w_shape
):
  bf16, f32 = jnp.bfloat16, jnp.float32
  x = jax.random.normal(jax.random.key(0), x_shape, bf16)
  w = jax.random.normal(jax.random.key(1), w_shape, bf16)
  out = jnp.einsum(equation, x.astype(f32), w.astype(f32))
  cotangent = jax.random.normal(jax.random.key(2), out.shape)

  def loss(product, dtype):
    def f(x, w):
      y = product(equation, x.astype(dtype), w.astype(dtype))
      return jnp.sum(jnp.sin(y.astype(f32)) * cotangent)

    return f

  # The reference: float32 products of the same bfloat16 values, each
  # result rounded to bfloat16 once, as the products here round theirs.
  y = layers.project(equation, x, w)
  assert y.dtype == bf16
  np.testing.assert_array_equal(y, out.astype(bf16))
  grads = jax.grad(loss(layers.project, bf16), (0, 1))(x, w)
  expected = jax.grad(loss(jnp.einsum, f32), (0, 1))(x, w)
  for got, want in zip(grads, expected, strict=True):
    assert got.dtype == bf16
    scale = np.max(np.abs(np.asarray(want, np.float32)))
    np.testing.assert_allclose(
      np.asarray(got, np.float32), want, rtol=2**-7, atol=2**-7 * scale
    )

  # All three products take bfloat16 operands, the first [rows,
  # contracted] (dim 1 contracted), and return float32: the form XLA:CPU
  # runs in bfloat16 rather than upcasting both operands.
  traced = jax.jit(jax.grad(loss(layers.project, bf16), (0, 1))).trace(x, w)
  signatures = dot_signatures(
    traced.lower(lowering_platforms=('cpu',)).as_text()
  )
  assert len(signatures) == 3
  for lhs_dims, lhs, rhs, result in signatures:
    assert lhs_dims == '[1]'
    assert lhs.endswith('xbf16>') and rhs.endswith('xbf16>')
    assert result.endswith('xf32>')
  # And XLA keeps W's gradient over the transposed copy: a plain x2.T
  # there is folded back into a product contracting x2's rows (dim 0).
  compiled = traced.lower().compile().as_text()
  assert re.findall(r'lhs_contracting_dims=\{(\d)\}', compiled) == ['1'] * 3


@pytest.mark.parametrize(
  'equation,x_shape,w_shape',
  [
    ('BLHK,BSHK->BHLS', (2, 3, 2, 4), (2, 5, 2, 4)),  # batched over B, H
    ('DB,DC->BC', (4, 2), (4, 3)),  # x's contracted dim first
  ],
)
def test_project_leaves_other_equations_to_einsum(equation, x_shape, w_shape):
  x = jax.random.normal(jax.random.key(0), x_shape)
  w = jax.random.normal(jax.random.key(1), w_shape)
  np.testing.assert_array_equal(
    layers.project(equation, x, w), jnp.einsum(equation, x, w)
  )
  text = jax.jit(functools.partial(layers.project, equation)).trace(x, w)
  ranks = dot_operand_ranks(text.lower(lowering_platforms=('cpu',)).as_text())
  assert ranks == [(len(x_shape), len(w_shape))]


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

  # Phi comes from erf, the cheaper of XLA's two (erfc adds an exp and a
  # second approximation per element); bfloat16 stays bfloat16.
  assert 'erfc' not in jax.jit(layers.gelu).lower(xs).as_text()
  y = layers.gelu(jnp.asarray(xs, jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(y, np.float64), value, rtol=1e-2, atol=1e-2
  )


def cudnn_calls(bias, causal):
  """The cuDNN attention custom calls (name, result count, mask type) in
  the gradient of fused_attention, lowered here for a GPU."""
  B, L, H, K = 2, 8, 2, 8
  q = jnp.ones((B, L, H, K), jnp.bfloat16)
  mask = jnp.tril(jnp.ones((L, L), bool))[None, None].repeat(B, 0)

  def loss(q, k, v, bias):
    out = layers.fused_attention(
      q,
      k,
      v,
      bias_BHLS=bias,
      mask_B1LS=mask,
      scale=0.3,
      causal=causal,
      implementation='cudnn',
    )
    return out.astype(jnp.float32).sum()

  with layers.cudnn_off_gpu(90800):
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if bias else (0, 1, 2)))
    args = (q, q, q, jnp.zeros((B, H, L, L), jnp.bfloat16) if bias else None)
    text = grad.trace(*args).lower(lowering_platforms=('cuda',)).as_text()
  calls = []
  for line in text.splitlines():
    if 'custom_call @__cudnn$fmha' in line:
      name = line.split('custom_call @')[1].split('(')[0]
      mask_type = line.split('mask_type\\22: \\22')[1].split('\\22')[0]
      calls.append((name, line.split('->')[-1].count('tensor<'), mask_type))
  return calls


@pytest.mark.parametrize('causal', [False, True])
def test_cudnn_computes_no_gradient_for_a_mask(causal):
  # jax.nn's cuDNN attention asks for the mask's gradient; a mask alone
  # needs none, so the backward returns dq, dk, dv and its workspace. A
  # learned bias (T5's) keeps its gradient: a fifth result.
  assert layers._cudnn_kernel() is not None  # the pinned jax's kernel
  mask_type = 'CAUSAL' if causal else 'NO_MASK'
  fwd, bwd = (
    '__cudnn$fmhaScaleBiasSoftmax',
    '__cudnn$fmhaScaleBiasSoftmaxBackward',
  )
  assert cudnn_calls(False, causal) == [
    (fwd, 3, mask_type),
    (bwd, 4, mask_type),
  ]
  assert cudnn_calls(True, causal) == [(fwd, 3, mask_type), (bwd, 5, mask_type)]
