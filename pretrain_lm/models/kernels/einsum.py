"""Softmax attention written with jnp.einsum: the default on every backend.

It runs wherever XLA does, takes any mask and bias, and is the only kernel
with dropout on the attention probabilities (BERT's attention dropout).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


def attention(
  q_BLHK: Array,
  k_BSHK: Array,
  v_BSHK: Array,
  *,
  bias_BHLS: Array | None,
  mask_B1LS: Array | None,
  scale: float,
  dropout: Callable[[Array], Array] | None = None,
) -> Array:
  """softmax(q k^T * scale + bias, where mask) v, per head: [B, L, H, K].

  `dropout`, if given, is applied to the [B, H, L, S] probabilities (the
  caller's nn.Dropout, so that it draws from the caller's 'dropout' rng).
  """
  dtype = q_BLHK.dtype
  # Scale the query, not the logits: one fewer [B, H, L, S] pass.
  if scale != 1.0:
    q_BLHK = q_BLHK * jnp.asarray(scale, dtype)
  logits_BHLS = jnp.einsum('BLHK,BSHK->BHLS', q_BLHK, k_BSHK)
  # Softmax in float32: bf16 logits lose the small differences that matter.
  logits_BHLS = logits_BHLS.astype(jnp.float32)
  if bias_BHLS is not None:
    logits_BHLS = logits_BHLS + bias_BHLS
  if mask_B1LS is not None:
    big_neg = jnp.finfo(jnp.float32).min
    logits_BHLS = jnp.where(mask_B1LS, logits_BHLS, big_neg)
  probs_BHLS = jax.nn.softmax(logits_BHLS, axis=-1).astype(dtype)
  if dropout is not None:
    probs_BHLS = dropout(probs_BHLS)
  return jnp.einsum('BHLS,BSHK->BLHK', probs_BHLS, v_BSHK)
