"""Embeddings, attention, feed-forward blocks and norms shared by all families.

Dimension names in variable suffixes and einsum strings: B batch, L query
length, S key length, D model width, H heads, K head dim, F feed-forward
width, V vocabulary, P predicted positions. Every parameter carries logical
axis names (mapped onto the mesh by pretrain_lm.sharding); no mesh axis is
named here.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models.config import ModelConfig

Array = jax.Array

# Activation-side logical axes constrained at block boundaries.
BLD = ('activation_batch', 'activation_length', 'activation_embed')
BLHK = ('activation_batch', 'activation_length', 'activation_heads', 'kv')
BLF = ('activation_batch', 'activation_length', 'activation_mlp')

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
  # BERT's GELU is the exact erf form, not the tanh approximation.
  'gelu': lambda x: jax.nn.gelu(x, approximate=False),
  'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
  'relu': jax.nn.relu,
}


def kernel_init(cfg: ModelConfig, axes: tuple[str, ...]):
  """BERT's initialiser: truncated normal, std `initializer_range`."""
  return nn.with_logical_partitioning(
    nn.initializers.truncated_normal(cfg.initializer_range), axes
  )


def zeros_init(axes: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.zeros, axes)


def layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
  """LayerNorm computed in float32 for stability, output in cfg.dtype."""
  return nn.LayerNorm(
    epsilon=cfg.layer_norm_eps,
    dtype=cfg.jnp_dtype,
    param_dtype=cfg.jnp_param_dtype,
    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
    bias_init=zeros_init(('norm',)),
    name=name,
  )


class Embed(nn.Module):
  """A lookup table whose transpose can also produce output logits (tying)."""

  num_embeddings: int
  cfg: ModelConfig
  axes: tuple[str, str] = ('vocab', 'embed')

  def setup(self):
    self.embedding = self.param(
      'embedding',
      kernel_init(self.cfg, self.axes),
      (self.num_embeddings, self.cfg.emb_dim),
      self.cfg.jnp_param_dtype,
    )

  def __call__(self, ids: Array) -> Array:
    return jnp.take(self.embedding, ids, axis=0).astype(self.cfg.jnp_dtype)

  def attend(self, x_BPD: Array) -> Array:
    """Logits against every row of the table: x @ E^T."""
    e_VD = self.embedding.astype(self.cfg.jnp_dtype)
    return jnp.einsum('BPD,VD->BPV', x_BPD, e_VD)


class MultiHeadAttention(nn.Module):
  """Dot-product attention with biases, as in BERT and the original paper."""

  cfg: ModelConfig

  @nn.compact
  def __call__(
    self, x_BLD: Array, kv_BSD: Array, mask_B1LS: Array, deterministic: bool
  ) -> Array:
    cfg = self.cfg
    D, H, K = cfg.emb_dim, cfg.num_heads, cfg.head_dim
    dtype = cfg.jnp_dtype

    def project(name, inputs_BXD):
      w_DHK = self.param(
        f'{name}_kernel',
        kernel_init(cfg, ('embed', 'heads', 'kv')),
        (D, H, K),
        cfg.jnp_param_dtype,
      )
      b_HK = self.param(
        f'{name}_bias',
        zeros_init(('heads', 'kv')),
        (H, K),
        cfg.jnp_param_dtype,
      )
      y = jnp.einsum('BXD,DHK->BXHK', inputs_BXD, w_DHK.astype(dtype))
      return nn.with_logical_constraint(y + b_HK.astype(dtype), BLHK)

    q_BLHK = project('query', x_BLD)
    k_BSHK = project('key', kv_BSD)
    v_BSHK = project('value', kv_BSD)

    # Scale the query, not the logits: one fewer [B,H,L,S] pass.
    q_BLHK = q_BLHK / jnp.sqrt(K).astype(dtype)
    logits_BHLS = jnp.einsum('BLHK,BSHK->BHLS', q_BLHK, k_BSHK)
    # Softmax in float32: bf16 logits lose the small differences that matter.
    logits_BHLS = logits_BHLS.astype(jnp.float32)
    big_neg = jnp.finfo(jnp.float32).min
    logits_BHLS = jnp.where(mask_B1LS, logits_BHLS, big_neg)
    probs_BHLS = jax.nn.softmax(logits_BHLS, axis=-1).astype(dtype)
    probs_BHLS = nn.Dropout(cfg.attention_dropout_rate)(
      probs_BHLS, deterministic=deterministic
    )
    out_BLHK = jnp.einsum('BHLS,BSHK->BLHK', probs_BHLS, v_BSHK)
    out_BLHK = nn.with_logical_constraint(out_BLHK, BLHK)

    w_HKD = self.param(
      'out_kernel',
      kernel_init(cfg, ('heads', 'kv', 'embed')),
      (H, K, D),
      cfg.jnp_param_dtype,
    )
    b_D = self.param(
      'out_bias', zeros_init(('embed',)), (D,), cfg.jnp_param_dtype
    )
    y_BLD = jnp.einsum('BLHK,HKD->BLD', out_BLHK, w_HKD.astype(dtype))
    return nn.with_logical_constraint(y_BLD + b_D.astype(dtype), BLD)


class Mlp(nn.Module):
  """The position-wise feed-forward block: D -> F -> activation -> D."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: Array, deterministic: bool) -> Array:
    cfg = self.cfg
    D, F = cfg.emb_dim, cfg.mlp_dim
    dtype = cfg.jnp_dtype
    if cfg.activation not in ACTIVATIONS:
      raise ValueError(
        f'model.activation={cfg.activation!r}; valid: {sorted(ACTIVATIONS)}.'
      )
    wi_DF = self.param(
      'wi_kernel',
      kernel_init(cfg, ('embed', 'mlp')),
      (D, F),
      cfg.jnp_param_dtype,
    )
    bi_F = self.param(
      'wi_bias', zeros_init(('mlp',)), (F,), cfg.jnp_param_dtype
    )
    wo_FD = self.param(
      'wo_kernel',
      kernel_init(cfg, ('mlp', 'embed')),
      (F, D),
      cfg.jnp_param_dtype,
    )
    bo_D = self.param(
      'wo_bias', zeros_init(('embed',)), (D,), cfg.jnp_param_dtype
    )
    h_BLF = jnp.einsum('BLD,DF->BLF', x_BLD, wi_DF.astype(dtype))
    h_BLF = ACTIVATIONS[cfg.activation](h_BLF + bi_F.astype(dtype))
    h_BLF = nn.with_logical_constraint(h_BLF, BLF)
    y_BLD = jnp.einsum('BLF,FD->BLD', h_BLF, wo_FD.astype(dtype))
    return nn.with_logical_constraint(y_BLD + bo_D.astype(dtype), BLD)
