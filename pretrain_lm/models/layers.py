"""Embeddings, attention, feed-forward blocks, norms and position encodings.

Dimension names in variable suffixes and einsum strings: B batch, L query
length, S key length, D model width, E token-embedding width, H heads, K head
dim, F feed-forward width, V vocabulary, P predicted positions. Every
parameter carries logical axis names (mapped onto the mesh by
pretrain_lm.sharding); no mesh axis is named here.
"""

import contextlib
import functools
import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from pretrain_lm.models.config import ModelConfig

Array = jax.Array
# (full_shape, start): a block of a larger array (see random_words).
Window = tuple[tuple[int, ...], tuple[int, ...]]

# Activation-side logical axes constrained at block boundaries.
BLD = ('activation_batch', 'activation_length', 'activation_embed')
BLHK = ('activation_batch', 'activation_length', 'activation_heads', 'kv')
BLF = ('activation_batch', 'activation_length', 'activation_mlp')
BLV = ('activation_batch', 'activation_length', 'activation_vocab')


def gelu(x: Array) -> Array:
  """The exact GELU, x Phi(x), with Phi from erf: x (1 + erf(x / sqrt 2)) / 2.

  This is PyTorch's `gelu` and the formula of BERT's and the Hugging Face
  models' exact GELU. jax.nn.gelu(approximate=False) takes Phi from erfc
  instead; XLA evaluates erfc as erf plus an exp and two more rational
  approximations, selected per element, so on the CPU the erf form is the
  cheaper, forward and backward (experiments/benchmarks/README.md, Levers
  tried). Both are within 8e-7 of x Phi(x) in
  absolute terms, but 1 + erf cancels in the negative tail: the erf form's
  relative error is 5e-5 on [-3, -2], 2.5e-3 on [-4, -3] and grows below,
  where the erfc form stays within 4e-6.
  """
  return 0.5 * x * (1.0 + jax.lax.erf(x * np.sqrt(0.5).astype(x.dtype)))


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
  # BERT's GELU is the exact erf form, not the tanh approximation.
  'gelu': gelu,
  'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
  'relu': jax.nn.relu,
  'silu': jax.nn.silu,
  # Gated units (Shazeer, 2020): act(x W0) * (x W1). T5 v1.1's GeGLU uses
  # the tanh GELU.
  'geglu': lambda x: jax.nn.gelu(x, approximate=True),
  'swiglu': jax.nn.silu,
}


def kernel_init(std: float, axes: tuple[str | None, ...]):
  """BERT's initialiser: truncated normal with standard deviation `std`."""
  return nn.with_logical_partitioning(
    nn.initializers.truncated_normal(std), axes
  )


def zeros_init(axes: tuple[str | None, ...]):
  return nn.with_logical_partitioning(nn.initializers.zeros, axes)


def residual_std(cfg: ModelConfig, num_layers: int) -> float:
  """Init std of projections that write into the residual stream.

  GPT-2 scales them by 1/sqrt(2 * layers), two residual writes per layer, so
  the stream's variance does not grow with depth.
  """
  if cfg.scaled_residual_init:
    return cfg.initializer_range / math.sqrt(2 * num_layers)
  return cfg.initializer_range


def norm(cfg: ModelConfig, name: str) -> nn.Module:
  """LayerNorm (BERT, GPT-2, BART) or RMSNorm without bias (T5).

  Both compute their statistics in float32 and return cfg.dtype.
  """
  scale_init = nn.with_logical_partitioning(nn.initializers.ones, ('norm',))
  if cfg.norm_type == 'rmsnorm':
    return nn.RMSNorm(
      epsilon=cfg.layer_norm_eps,
      dtype=cfg.jnp_dtype,
      param_dtype=cfg.jnp_param_dtype,
      scale_init=scale_init,
      name=name,
    )
  return nn.LayerNorm(
    epsilon=cfg.layer_norm_eps,
    dtype=cfg.jnp_dtype,
    param_dtype=cfg.jnp_param_dtype,
    scale_init=scale_init,
    bias_init=zeros_init(('norm',)),
    name=name,
  )


def _rows_first(a: Array) -> Array:
  """a^T written out row-major, for a product that takes it as [in, out].

  The transpose sits behind an optimization barrier and a blocked reshape,
  so XLA neither folds it back into the product's dimension numbers nor
  leaves it as a layout change.
  """
  rows, cols = a.shape
  block = 8 if rows % 8 == 0 else 1
  blocked = jax.lax.optimization_barrier(
    a.T.reshape(cols, rows // block, block)
  )
  return blocked.reshape(cols, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul_f32_acc(x2: Array, w2: Array, w_in: int) -> Array:
  """x2 @ w2 (W contracted over its dim `w_in`) for low-precision operands:
  each of the three products takes them as they are, accumulates in
  float32 and rounds its result to their dtype.

  XLA:CPU runs a bfloat16 product as bfloat16 (YNNPACK's kernels) only
  when its result is float32 and its first operand is [rows, contracted].
  A bfloat16 result, or the weight gradient's x2^T dy contracted over the
  rows, it computes as a float32 product of upcast copies, several times
  slower than bfloat16 kernels where the CPU has them (AVX512-BF16, AMX).
  So the weight gradient multiplies a transposed copy (_rows_first)
  (experiments/benchmarks/README.md, Levers tried).
  """
  dims = (((1,), (w_in,)), ((), ()))
  y2 = jax.lax.dot_general(x2, w2, dims, preferred_element_type=jnp.float32)
  return y2.astype(x2.dtype)


def _matmul_f32_acc_fwd(x2, w2, w_in):
  return matmul_f32_acc(x2, w2, w_in), (x2, w2)


def _matmul_f32_acc_bwd(w_in, residuals, dy2):
  x2, w2 = residuals
  f32 = jnp.float32
  if w_in == 0:  # y = x W: dx = dy W^T, dW = x^T dy
    dims = (((1,), (1,)), ((), ()))
    dx2 = jax.lax.dot_general(dy2, w2, dims, preferred_element_type=f32)
    dw2 = jnp.dot(_rows_first(x2), dy2, preferred_element_type=f32)
  else:  # W as [out, in], y = x W^T: dx = dy W, dW = dy^T x
    dx2 = jnp.dot(dy2, w2, preferred_element_type=f32)
    dw2 = jnp.dot(_rows_first(dy2), x2, preferred_element_type=f32)
  return dx2.astype(x2.dtype), dw2.astype(w2.dtype)


matmul_f32_acc.defvjp(_matmul_f32_acc_fwd, _matmul_f32_acc_bwd)


def project(equation: str, x: Array, w: Array) -> Array:
  """einsum(equation, x, w) for a projection; on the CPU one 2-D product.

  `equation` maps x's leading dims and its contracted dims (in W's order)
  to the leading dims and W's other dims: 'BLD,DHK->BLHK', 'BLHK,HKD->BLD',
  or with W's output dims first, 'BPE,VE->BPV'. On the CPU x is viewed as
  [rows, in] and W as [in, out] (or [out, in]). The einsum's gradient for
  W contracts the batch and length dims together, and for that product
  XLA:CPU writes the output's gradient out a second time, transposed (a
  [tokens, F] copy per MLP, attention projection and vocabulary head); the
  flat views' gradient reads it as it is, which made the base-size train
  steps faster (experiments/benchmarks/README.md, Levers tried).
  bfloat16 and float16 operands go through
  matmul_f32_acc. Other backends keep the einsum: a TPU tiles an array's
  last two dims, so merging H and K there is a copy of its own. Any other
  equation is an einsum.
  """
  operands, out = equation.split('->')
  x_spec, w_spec = operands.split(',')
  lead = ''.join(c for c in x_spec if c in out)
  contracted = x_spec[len(lead) :]
  w_out = ''.join(c for c in w_spec if c not in contracted)
  w_out_first = w_spec == w_out + contracted
  projection = (
    x_spec == lead + contracted
    and contracted
    and not set(lead) & set(w_spec)
    and out == lead + w_out
    and (w_spec == contracted + w_out or w_out_first)
  )
  if not projection:
    return jnp.einsum(equation, x, w)

  def flat(x, w):
    lead_shape = x.shape[: len(lead)]
    k = math.prod(x.shape[len(lead) :])
    if w_out_first:  # W as [out, in]: contract its dim 1
      out_shape, w2, w_in = w.shape[: len(w_out)], w.reshape(-1, k), 1
    else:
      out_shape, w2, w_in = w.shape[len(contracted) :], w.reshape(k, -1), 0
    x2 = x.reshape(math.prod(lead_shape), k)
    if x2.dtype == w2.dtype and x2.dtype in (jnp.bfloat16, jnp.float16):
      y2 = matmul_f32_acc(x2, w2, w_in)
    else:
      y2 = jax.lax.dot_general(x2, w2, (((1,), (w_in,)), ((), ())))
    return y2.reshape(*lead_shape, *out_shape)

  return jax.lax.platform_dependent(
    x, w, cpu=flat, default=functools.partial(jnp.einsum, equation)
  )


def dense(
  module: nn.Module,
  name: str,
  x: Array,
  shape: tuple[int, ...],
  axes: tuple[str | None, ...],
  equation: str,
  *,
  use_bias: bool,
  std: float,
) -> Array:
  """einsum(x, W) (+ b) with W of `shape`; b spans W's output dims.

  Parameters are `{name}_kernel` and `{name}_bias` of `module` (call it from
  the module's compact method).
  """
  cfg = module.cfg
  w = module.param(
    f'{name}_kernel', kernel_init(std, axes), shape, cfg.jnp_param_dtype
  )
  y = project(equation, x, w.astype(cfg.jnp_dtype))
  if use_bias:
    # W's output dims (its last ones) are those the result keeps.
    w_spec, out_spec = equation.split(',')[1].split('->')
    out_dims = sum(c in out_spec for c in w_spec)
    b = module.param(
      f'{name}_bias',
      zeros_init(axes[-out_dims:]),
      shape[-out_dims:],
      cfg.jnp_param_dtype,
    )
    y = y + b.astype(cfg.jnp_dtype)
  return y


# Dropout draws 16 random bits per element, four from each threefry hash
# (two 32-bit words, two draws each); flax's nn.Dropout spends a whole hash
# on every element. On CPU, 16-bit draws from jax.random.bits (which XORs a
# hash's two words into one) made BERT's train steps faster, and keeping
# both words, with the hash written out below, faster again
# (experiments/benchmarks/README.md, Levers tried).
# 16 bits keep the rate exact to 2^-16; 8 bits were not clearly faster and
# would round a rate of 0.1 to 26/256.
DROPOUT_BITS = 16


def random_words(
  rng: Array, shape: tuple[int, ...], window: Window | None = None
) -> Array:
  """Uniform uint32 words of `shape`, two per threefry hash.

  Each hash's counter is (row, column) of the [rows, shape[-1] / 2] grid of
  hashes, so the draw is elementwise and shards as the array does, like
  jax's partitionable threefry. Keys of other PRNG implementations (e.g.
  unsafe_rbg), an odd last dim, or 2^32 rows or more draw through
  jax.random.bits instead.

  With `window` = (full_shape, start), the words are the block of
  random_words(rng, full_shape) at start (its last entry 0), drawn alone:
  an array computed in blocks gets the words it would get whole. The
  jax.random.bits fallback cannot draw a block alone; it draws the block's
  words from the key folded with the block's position instead (other
  words, the same distribution).
  """
  full, start = window or (shape, (0,) * len(shape))
  check_window(shape, full, start)
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  impl = str(jax.random.key_impl(rng)) if typed else 'threefry2x32'
  *lead, n = shape
  *full_lead, full_n = full
  strides = np.cumprod([1, *full_lead[::-1]])[::-1][1:]
  fallback = math.prod(full_lead) >= 2**32 or n % 2 or full_n % 2
  if impl != 'threefry2x32' or fallback:
    if tuple(full) != tuple(shape):
      offset = sum(
        int(s) * int(d) for s, d in zip(start[:-1], strides, strict=True)
      )
      rng = jax.random.fold_in(rng, offset % 2**32)
    return jax.random.bits(rng, shape, jnp.uint32)
  k1, k2 = jax.random.key_data(rng) if typed else rng
  grid = (*lead, n // 2)

  def index(d, s0):  # the dim-d index of each hash in the full array
    i = jax.lax.broadcasted_iota(jnp.uint32, grid, d)
    return i + jnp.uint32(s0) if s0 else i

  row = sum(
    (
      index(d, s0) * jnp.uint32(stride)
      for d, (s0, stride) in enumerate(zip(start[:-1], strides, strict=True))
    ),
    jnp.zeros(grid, jnp.uint32),
  )
  column = jax.lax.broadcasted_iota(jnp.uint32, grid, len(lead))
  words = threefry2x32(k1, k2, row, column)
  return jnp.stack(words, axis=-1).reshape(shape)


def check_window(shape, full, start) -> None:
  """A block of a [full] array at start: inside it, from column 0."""
  if (
    len(full) != len(shape)
    or len(start) != len(shape)
    or start[-1] != 0
    or any(
      s < 0 or s + n > f for s, n, f in zip(start, shape, full, strict=True)
    )
  ):
    raise ValueError(
      f'A block of shape {tuple(shape)} at {tuple(start)} is not inside '
      f'an array of shape {tuple(full)} from its first column.'
    )


THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k1: Array, k2: Array, x1: Array, x2: Array):
  """Threefry-2x32, 20 rounds (Salmon et al., 2011): jax's threefry2x32_p.

  Written out as elementwise ops so that XLA fuses the hash with the
  counters before it and the comparisons after it. jax lowers the
  primitive on CPU as a 5-step loop, whose every step writes both words of
  every element to memory.
  """
  ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
  x1, x2 = x1 + ks[0], x2 + ks[1]
  for i in range(5):
    for r in THREEFRY_ROTATIONS[i % 2]:
      x1 = x1 + x2
      x2 = x1 ^ ((x2 << jnp.uint32(r)) | (x2 >> jnp.uint32(32 - r)))
    x1 = x1 + ks[(i + 1) % 3]
    x2 = x2 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
  return x1, x2


def keep_mask(
  rng: Array,
  shape: tuple[int, ...],
  keep_prob: float,
  window: Window | None = None,
):
  """Bernoulli(keep_prob) mask of `shape`, and its exact keep probability.

  keep_prob is rounded to a multiple of 2^-DROPOUT_BITS; the second return
  value is the rounded one, for the caller's rescaling. With `window` =
  (full_shape, start), the mask is keep_mask(rng, full_shape)'s block at
  start (see random_words).
  """
  per_word = 32 // DROPOUT_BITS
  *lead, n = shape
  words_per_row = -(-n // (2 * per_word)) * 2
  words_window = None
  if window:
    full, start = window
    check_window(shape, full, start)
    full_words = -(-full[-1] // (2 * per_word)) * 2
    words_window = ((*full[:-1], full_words), start)
  words = random_words(rng, (*lead, words_per_row), words_window)
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * DROPOUT_BITS
  draws = (words[..., None] >> shifts) & jnp.uint32(2**DROPOUT_BITS - 1)
  draws = draws.reshape(*lead, -1)[..., :n]
  threshold = max(1, round(keep_prob * 2**DROPOUT_BITS))
  return draws < jnp.uint32(threshold), threshold / 2**DROPOUT_BITS


class Dropout(nn.Module):
  """Inverted dropout (Srivastava et al., 2014) drawing keep_mask's bits.

  The same contract as nn.Dropout: needs the 'dropout' rng unless
  deterministic; kept values are scaled by 1 / keep probability.
  """

  rate: float

  def __call__(self, x: Array, deterministic: bool) -> Array:
    return self.blocks([x], x.shape, [(0,) * x.ndim], deterministic)[0]

  def blocks(
    self,
    xs: list[Array],
    full_shape: tuple[int, ...],
    starts: list[tuple[int, ...]],
    deterministic: bool,
  ) -> list[Array]:
    """Dropout of blocks of one [full_shape] array, xs[i] at starts[i]
    (each from its first column): every block gets its part of the mask
    the whole array would get, from one draw of the rng, so computing an
    array in blocks changes none of its masks."""
    if deterministic or self.rate == 0:
      return list(xs)
    if self.rate == 1:
      return [jnp.zeros_like(x) for x in xs]
    rng = self.make_rng('dropout')
    out = []
    for x, start in zip(xs, starts, strict=True):
      whole = tuple(x.shape) == tuple(full_shape)
      window = None if whole else (tuple(full_shape), tuple(start))
      args = (rng, x.shape, 1 - self.rate) + ((window,) if window else ())
      keep, keep_prob = keep_mask(*args)
      out.append(jnp.where(keep, x / keep_prob, jnp.zeros_like(x)))
    return out


class Embed(nn.Module):
  """A lookup table whose transpose can also produce output logits (tying)."""

  num_embeddings: int
  cfg: ModelConfig
  features: int = 0  # 0: cfg.emb_dim
  axes: tuple[str, str] = ('vocab', 'embed')

  def setup(self):
    self.embedding = self.param(
      'embedding',
      kernel_init(self.cfg.initializer_range, self.axes),
      (self.num_embeddings, self.features or self.cfg.emb_dim),
      self.cfg.jnp_param_dtype,
    )

  def __call__(self, ids: Array) -> Array:
    return jnp.take(self.embedding, ids, axis=0).astype(self.cfg.jnp_dtype)

  def attend(self, x_BPE: Array) -> Array:
    """Logits against every row of the table: x @ E^T."""
    e_VE = self.embedding.astype(self.cfg.jnp_dtype)
    return project('BPE,VE->BPV', x_BPE, e_VE)


def sinusoidal(positions_BL: Array, dim: int, dtype) -> Array:
  """Vaswani et al.'s encoding: sin at even, cos at odd dims, [B, L, dim]."""
  inv_freq = 1.0 / (10_000.0 ** (np.arange(0, dim, 2) / dim))
  angle = positions_BL[..., None].astype(jnp.float32) * inv_freq
  pe = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1)
  return pe.reshape(*positions_BL.shape, -1)[..., :dim].astype(dtype)


def rotary(x_BLHK: Array, positions_BL: Array, base: float) -> Array:
  """Rotary position embedding (Su et al., 2021), rotate-half layout."""
  K = x_BLHK.shape[-1]
  inv_freq = 1.0 / (base ** (np.arange(0, K, 2) / K))
  angle = positions_BL[..., None].astype(jnp.float32) * inv_freq  # B L K/2
  sin = jnp.sin(angle)[:, :, None, :]
  cos = jnp.cos(angle)[:, :, None, :]
  x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BLHK.dtype)


def relative_bucket(
  relative_BLS: Array, *, bidirectional: bool, num_buckets: int, max_distance
) -> Array:
  """T5's bucket of each key-minus-query offset (Raffel et al., 2020).

  Half the buckets are exact offsets, the rest log-spaced up to
  max_distance; a bidirectional stack spends half of them on each side.
  """
  n = -relative_BLS
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket += (n < 0).astype(n.dtype) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  eps = np.finfo(np.float32).eps
  large = max_exact + (
    jnp.log(n.astype(jnp.float32) / max_exact + eps)
    / math.log(max_distance / max_exact)
    * (num_buckets - max_exact)
  ).astype(n.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(n < max_exact, n, large)


def relative_bias(
  table_NH: Array,
  q_pos_BL: Array,
  k_pos_BS: Array,
  cfg: ModelConfig,
  bidirectional: bool,
) -> Array:
  """The learned per-head bias of T5's relative attention: [B, H, L, S]."""
  buckets_BLS = relative_bucket(
    k_pos_BS[:, None, :] - q_pos_BL[:, :, None],
    bidirectional=bidirectional,
    num_buckets=cfg.relative_buckets,
    max_distance=cfg.relative_max_distance,
  )
  bias_BLSH = jnp.take(table_NH, buckets_BLS, axis=0)
  return jnp.transpose(bias_BLSH, (0, 3, 1, 2)).astype(jnp.float32)


def relative_bias_by_index(
  table_NH: Array, L: int, S: int, cfg: ModelConfig, bidirectional: bool
) -> Array:
  """`relative_bias` for queries and keys at their indices in the row:
  [1, H, L, S], one bias for every row of the batch (as T5X computes it).

  Where positions count up by one within a segment (as the pipelines pack
  them), a key's position minus a query's is its index minus the query's
  for every pair of one segment, so this is `relative_bias` wherever the
  mask lets a query see a key. It is computed once per stack, not per
  layer and row, and without a [B, L, S] gather: the table is read at the
  L + S - 1 offsets, and the square takes each entry's offset from those.
  (The [B, H, L, S] gather's gradient, a scatter-add into the 32-row
  table, took most of T5-base's step on a GPU: experiments/benchmarks/
  README.md, Levers tried.)
  """
  offsets = np.arange(-(L - 1), S)  # key index minus query index
  buckets = relative_bucket(
    jnp.asarray(offsets, jnp.int32),
    bidirectional=bidirectional,
    num_buckets=cfg.relative_buckets,
    max_distance=cfg.relative_max_distance,
  )
  bias_OH = jnp.take(table_NH, buckets, axis=0)
  offset_LS = np.arange(S)[None, :] - np.arange(L)[:, None] + (L - 1)
  bias_LSH = jnp.take(bias_OH, offset_LS, axis=0)
  return jnp.transpose(bias_LSH, (2, 0, 1))[None].astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def broadcast_rows(x_1X: Array, rows: int) -> Array:
  """x's one row repeated: [1, ...] -> [rows, ...]; on the CPU its gradient
  sums the rows as a product with a vector of ones.

  A batch-shared bias's gradient is that sum. As a reduce over the leading
  axis of [B, H, L, S], XLA:CPU takes over an order of magnitude longer
  than as the product, enough to make a shared bias slower than gathering
  a bias per row. XLA:GPU's reduce runs at about the memory bandwidth, so
  other backends keep it (experiments/benchmarks/README.md, Levers tried).
  """
  return jnp.broadcast_to(x_1X, (rows,) + x_1X.shape[1:])


def _broadcast_rows_fwd(x_1X, rows):
  return broadcast_rows(x_1X, rows), None


def _broadcast_rows_bwd(rows, _, g_BX):
  def as_product(g_BX):
    ones_B = jnp.ones((rows,), g_BX.dtype)
    return jnp.einsum(
      'B,B...->...', ones_B, g_BX, preferred_element_type=jnp.float32
    )

  def as_reduce(g_BX):
    return jnp.sum(g_BX, axis=0, dtype=jnp.float32)

  sum_X = jax.lax.platform_dependent(g_BX, cpu=as_product, default=as_reduce)
  return (sum_X[None].astype(g_BX.dtype),)


broadcast_rows.defvjp(_broadcast_rows_fwd, _broadcast_rows_bwd)


def attention_impl(cfg: ModelConfig, deterministic: bool) -> str:
  """The attention kernel to use: 'einsum', or jax.nn's 'xla' / 'cudnn'."""
  impl = cfg.attention_impl
  dropout = cfg.attention_dropout_rate > 0 and not deterministic
  if impl == 'auto':
    # cuDNN's fused kernel needs a GPU and half precision, and has no
    # attention-probability dropout.
    fused_ok = (
      jax.default_backend() == 'gpu'
      and cfg.dtype in ('bfloat16', 'float16')
      and not dropout
    )
    return 'cudnn' if fused_ok else 'einsum'
  if impl != 'einsum' and dropout:
    raise ValueError(
      f'model.attention_impl={impl!r} has no attention dropout; set '
      'model.attention_dropout_rate=0 or use attention_impl=einsum.'
    )
  return impl


def causal_blocks(L: int, S: int, chunk: int) -> list[tuple[int, int, int]]:
  """The (q0, q1, s1) blocks of the einsum kernel: query rows [q0, q1)
  against keys [0, s1).

  Without a chunk (or unless L == S > chunk) one block, the L x S square.
  With one, the blocks of a causal mask: rows of `chunk` queries, each
  against the keys up to its last query, whose later keys the mask hides
  anyway. Their softmax, masks and products cover (1 + 1/n)/2 of the
  square for n blocks (56% at 1024 / 128); the result is the same, pad
  queries that see no key at all aside (their output, uniform over the
  keys, goes nowhere: no real query attends to a pad).
  """
  if not chunk or L != S or chunk >= L:
    return [(0, L, S)]
  return [
    (q0, min(q0 + chunk, L), min(q0 + chunk, L)) for q0 in range(0, L, chunk)
  ]


@contextlib.contextmanager
def cudnn_off_gpu(version: int):
  """Lets jax lower cuDNN attention on a machine without cuDNN.

  jax asks the local cuDNN for its version and the local GPU for its
  compute capability before lowering the fused kernel; off a GPU there is
  neither, so both answers are given (`version`, and a capable GPU). XLA
  on the GPU machine builds the kernel with that machine's cuDNN. For
  exporting GPU programs from a CPU machine, and for tests.
  """
  from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415

  saved = fa.check_cudnn_version, fa.check_compute_capability
  fa.check_cudnn_version = lambda *a, **k: version
  fa.check_compute_capability = lambda *a, **k: True
  try:
    yield
  finally:
    fa.check_cudnn_version, fa.check_compute_capability = saved


def fused_attention(
  q_BLHK: Array,
  k_BSHK: Array,
  v_BSHK: Array,
  *,
  bias_BHLS: Array | None,
  mask_B1LS: Array | None,
  scale: float,
  causal: bool,
  implementation: str,
) -> Array:
  """jax.nn.dot_product_attention ('xla' or 'cudnn'), told when the mask
  is causal; on cuDNN, with no gradient computed for a mask.

  jax.nn's cuDNN attention hands cuDNN the boolean mask as an additive
  bias and, in jax 0.10, always asks for that bias's gradient: the
  backward pass then runs cuDNN's dbias kernel for a [B, 1, L, S] result
  that no parameter reads (experiments/benchmarks/README.md, Train step:
  GPU). When the mask is the only bias (all but T5's self-attention,
  whose relative bias is learned), this binds the kernel jax.nn wraps
  with the bias's gradient off: its custom VJP then returns none for it.
  A learned bias goes through jax.nn, gradient and all. With `causal`,
  cuDNN is also given its causal mask type, under which it skips the key
  blocks above the diagonal; the boolean mask still applies (packed
  segments, padding). jax.nn takes the bias in the compute dtype.
  """
  if bias_BHLS is not None:
    bias_BHLS = bias_BHLS.astype(q_BLHK.dtype)
  fa = _cudnn_kernel() if implementation == 'cudnn' else None
  if bias_BHLS is not None or mask_B1LS is None or fa is None:
    return jax.nn.dot_product_attention(
      q_BLHK,
      k_BSHK,
      v_BSHK,
      bias=bias_BHLS,
      mask=mask_B1LS,
      scale=scale,
      is_causal=causal,
      implementation=implementation,
    )
  bias = fa.combine_bias_and_mask(None, mask_B1LS, q_BLHK.dtype)
  unused = jnp.zeros((0,), q_BLHK.dtype)
  return fa._dot_product_attention(
    q_BLHK,
    k_BSHK,
    v_BSHK,
    bias,
    *(unused,) * 6,  # no sequence lengths, offsets or page tables
    scale,
    0,  # seed: no dropout
    0.0,
    (True, False),  # has_bias, has_dbias
    fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK,
    fa.AttentionLayout.BTNH.value,
    None,  # no sliding window
    fa.check_cudnn_version(),
    False,  # no softmax residual
  )


# The private kernel's parameters, as fused_attention passes them.
_CUDNN_PARAMS = [
  'query',
  'key',
  'value',
  'bias',
  'q_seqlen',
  'kv_seqlen',
  'q_offsets',
  'kv_offsets',
  'page_table_k',
  'page_table_v',
  'scale',
  'seed',
  'dropout_rate',
  'variadic_args',
  'mask_type',
  'layout',
  'sliding_window_length',
  'cudnn_version',
  'return_residual',
]


@functools.cache
def _cudnn_kernel():
  """jax's cuDNN attention module if its private kernel takes the
  arguments fused_attention gives it (jax 0.10), else None: then the
  mask's gradient is computed, as jax.nn does."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415

    params = inspect.signature(fa._dot_product_attention.fun).parameters
  except (ImportError, AttributeError, TypeError, ValueError):
    return None
  return fa if list(params) == _CUDNN_PARAMS else None


class MultiHeadAttention(nn.Module):
  """Multi-head dot-product attention for every family.

  Self-attention when kv is x, cross-attention otherwise. The caller gives
  the boolean mask (padding, causal, packed segments) and the positions
  (rotary, relative bias). With `decode`, self-attention keeps a key/value
  cache ([B, cache length, H, K] in the 'cache' collection): the first call
  (model.init with decode=True) sizes it; later calls write the new keys at
  their positions and attend to every cached key at or before each query.

  T5's relative bias comes as `rel_bias` (the stack's, computed once) or
  as `rel_table`, read here at the positions' offsets.

  `causal` tells self-attention that the mask is causal (no query sees a
  later key): the einsum kernel then skips the key blocks the mask hides
  (model.causal_chunk rows at a time, see causal_blocks), and cuDNN's
  kernel skips them its own way (see fused_attention).
  """

  cfg: ModelConfig
  out_std: float
  decode: bool = False

  @nn.compact
  def __call__(
    self,
    x_BLD: Array,
    kv_BSD: Array,
    *,
    mask: Array | None,
    deterministic: bool,
    q_pos_BL: Array | None = None,
    k_pos_BS: Array | None = None,
    rel_table: Array | None = None,
    rel_bias: Array | None = None,
    bidirectional: bool = True,
    causal: bool = False,
  ) -> Array:
    cfg = self.cfg
    D, H, K = cfg.emb_dim, cfg.num_heads, cfg.head_dim
    std = cfg.initializer_range

    def project_heads(name, inputs_BXD):
      y = dense(
        self,
        name,
        inputs_BXD,
        (D, H, K),
        ('embed', 'heads', 'kv'),
        'BXD,DHK->BXHK',
        use_bias=cfg.attention_bias,
        std=std,
      )
      return nn.with_logical_constraint(y, BLHK)

    q_BLHK = project_heads('query', x_BLD)
    k_BSHK = project_heads('key', kv_BSD)
    v_BSHK = project_heads('value', kv_BSD)
    if cfg.position == 'rotary' and q_pos_BL is not None:
      q_BLHK = rotary(q_BLHK, q_pos_BL, cfg.rotary_base)
      k_BSHK = rotary(k_BSHK, k_pos_BS, cfg.rotary_base)

    if self.decode:
      k_BSHK, v_BSHK, mask, k_pos_BS = self._update_cache(
        k_BSHK, v_BSHK, q_pos_BL, mask
      )

    bias_BHLS = None
    if rel_bias is not None:  # [1, H, L, S] from relative_bias_by_index
      bias_BHLS = broadcast_rows(rel_bias, q_BLHK.shape[0])
    elif rel_table is not None:
      bias_BHLS = relative_bias(
        rel_table, q_pos_BL, k_pos_BS, cfg, bidirectional
      )

    if causal and mask is None:
      raise ValueError('causal is for a causal mask; none was given.')
    impl = attention_impl(cfg, deterministic)
    scale = 1.0 / math.sqrt(K) if cfg.attention_scale else 1.0
    if impl == 'einsum':
      chunk = cfg.causal_chunk if causal else 0
      blocks = causal_blocks(q_BLHK.shape[1], k_BSHK.shape[1], chunk)
      out_BLHK = self._einsum_attention(
        q_BLHK, k_BSHK, v_BSHK, mask, bias_BHLS, deterministic, blocks
      )
    else:
      out_BLHK = fused_attention(
        q_BLHK,
        k_BSHK,
        v_BSHK,
        bias_BHLS=bias_BHLS,
        mask_B1LS=mask,
        scale=scale,
        causal=causal,
        implementation=impl,
      )
    out_BLHK = nn.with_logical_constraint(out_BLHK, BLHK)
    y_BLD = dense(
      self,
      'out',
      out_BLHK,
      (H, K, D),
      ('heads', 'kv', 'embed'),
      'BLHK,HKD->BLD',
      use_bias=cfg.attention_bias,
      std=self.out_std,
    )
    return nn.with_logical_constraint(y_BLD, BLD)

  def _einsum_attention(self, q, k, v, mask, bias, deterministic, blocks):
    """Softmax attention, query rows [q0, q1) against keys [0, s1) for each
    (q0, q1, s1) of `blocks`, which cover the L queries in order."""
    cfg, dtype = self.cfg, self.cfg.jnp_dtype
    B, L, H, _ = q.shape
    S = k.shape[1]
    # Scale the query, not the logits: one fewer [B,H,L,S] pass.
    if cfg.attention_scale:
      q = q / jnp.sqrt(cfg.head_dim).astype(dtype)

    def part(x, q0, q1, s1):  # x's [..., q0:q1, :s1] of [..., L, S]
      return None if x is None else x[..., q0:q1, :s1]

    probs = []
    for q0, q1, s1 in blocks:  # one block, (0, L, S): the slices are no-ops
      logits_BHLS = jnp.einsum('BLHK,BSHK->BHLS', q[:, q0:q1], k[:, :s1])
      # Softmax in float32: bf16 logits lose the small differences that
      # matter.
      logits_BHLS = logits_BHLS.astype(jnp.float32)
      if bias is not None:
        logits_BHLS = logits_BHLS + part(bias, q0, q1, s1)
      if mask is not None:
        big_neg = jnp.finfo(jnp.float32).min
        logits_BHLS = jnp.where(part(mask, q0, q1, s1), logits_BHLS, big_neg)
      probs.append(jax.nn.softmax(logits_BHLS, axis=-1).astype(dtype))
    probs = Dropout(cfg.attention_dropout_rate).blocks(
      probs, (B, H, L, S), [(0, 0, q0, 0) for q0, _, _ in blocks], deterministic
    )
    outs = [
      jnp.einsum('BHLS,BSHK->BLHK', p_BHLS, v[:, :s1])
      for p_BHLS, (_, _, s1) in zip(probs, blocks, strict=True)
    ]
    return jnp.concatenate(outs, axis=1)

  def _update_cache(self, k_BLHK, v_BLHK, q_pos_BL, mask):
    """Writes the new keys/values at their positions; returns the cache."""
    initialized = self.has_variable('cache', 'cached_key')
    cached_k = self.variable(
      'cache', 'cached_key', jnp.zeros, k_BLHK.shape, k_BLHK.dtype
    )
    cached_v = self.variable(
      'cache', 'cached_value', jnp.zeros, v_BLHK.shape, v_BLHK.dtype
    )
    if not initialized:  # model.init: the cache takes the input's length
      S = k_BLHK.shape[1]
      return k_BLHK, v_BLHK, mask, jnp.arange(S)[None]
    # All rows decode in lockstep: the new tokens start at one index.
    start = q_pos_BL[0, 0]
    k = jax.lax.dynamic_update_slice(cached_k.value, k_BLHK, (0, start, 0, 0))
    v = jax.lax.dynamic_update_slice(cached_v.value, v_BLHK, (0, start, 0, 0))
    cached_k.value, cached_v.value = k, v
    k_pos_1S = jnp.arange(k.shape[1])[None]
    # Causal over the cache: slots after a query are unwritten or future.
    causal_B1LS = k_pos_1S[:, None, None, :] <= q_pos_BL[:, None, :, None]
    if mask is not None:
      causal_B1LS = jnp.logical_and(causal_B1LS, mask)
    return k, v, causal_B1LS, k_pos_1S


class Mlp(nn.Module):
  """The position-wise feed-forward block: D -> F -> activation -> D.

  GLU activations (geglu, swiglu) use two input projections, wi_0 through
  the activation gating wi_1, as in T5 v1.1.
  """

  cfg: ModelConfig
  out_std: float

  @nn.compact
  def __call__(self, x_BLD: Array, deterministic: bool) -> Array:
    del deterministic  # no dropout inside the block (BERT, T5)
    cfg = self.cfg
    D, F = cfg.emb_dim, cfg.mlp_dim
    act = ACTIVATIONS[cfg.activation]

    def wi(name):
      return dense(
        self,
        name,
        x_BLD,
        (D, F),
        ('embed', 'mlp'),
        'BLD,DF->BLF',
        use_bias=cfg.mlp_bias,
        std=cfg.initializer_range,
      )

    h_BLF = act(wi('wi_0')) * wi('wi_1') if cfg.is_glu else act(wi('wi'))
    h_BLF = nn.with_logical_constraint(h_BLF, BLF)
    y_BLD = dense(
      self,
      'wo',
      h_BLF,
      (F, D),
      ('mlp', 'embed'),
      'BLF,FD->BLD',
      use_bias=cfg.mlp_bias,
      std=self.out_std,
    )
    return nn.with_logical_constraint(y_BLD, BLD)
