"""Embeddings, attention, feed-forward blocks, norms and position encodings.

Dimension names in variable suffixes and einsum strings: B batch, L query
length, S key length, D model width, E token-embedding width, H heads, K head
dim, F feed-forward width, V vocabulary, P predicted positions. Every
parameter carries logical axis names (mapped onto the mesh by
pretrain_lm.sharding); no mesh axis is named here.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from pretrain_lm.models import kernels
from pretrain_lm.models.config import ModelConfig

Array = jax.Array

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
  y = jnp.einsum(equation, x, w.astype(cfg.jnp_dtype))
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
    return jnp.einsum('BPE,VE->BPV', x_BPE, e_VE)


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

  The kernel is model.attention_impl's (pretrain_lm.models.kernels).
  `causal` tells self-attention that the mask is causal (no query sees a
  later key): cuDNN's kernel then skips the key blocks the mask hides.
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
      B = q_BLHK.shape[0]
      bias_BHLS = jnp.broadcast_to(rel_bias, (B, *rel_bias.shape[1:]))
    elif rel_table is not None:
      bias_BHLS = relative_bias(
        rel_table, q_pos_BL, k_pos_BS, cfg, bidirectional
      )

    if causal and mask is None:
      raise ValueError('causal is for a causal mask; none was given.')
    drop = nn.Dropout(cfg.attention_dropout_rate, name='attention_dropout')
    out_BLHK = kernels.attention(
      kernels.attention_impl(cfg, deterministic),
      q_BLHK,
      k_BSHK,
      v_BSHK,
      bias_BHLS=bias_BHLS,
      mask_B1LS=mask,
      scale=1.0 / math.sqrt(K) if cfg.attention_scale else 1.0,
      causal=causal,
      dropout=lambda probs: drop(probs, deterministic=deterministic),
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
