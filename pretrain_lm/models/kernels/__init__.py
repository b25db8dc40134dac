"""Attention kernels behind one seam, chosen by model.attention_impl.

'einsum' (the default) is plain softmax attention with jnp.einsum
(kernels/einsum.py), on every backend. 'xla' and 'cudnn' are
jax.nn.dot_product_attention's kernels (kernels/cudnn.py). 'auto' picks
cuDNN on a GPU in half precision without attention dropout, else einsum.
"""

from collections.abc import Callable

import jax

from pretrain_lm.models.config import ModelConfig
from pretrain_lm.models.kernels import cudnn, einsum

Array = jax.Array


def attention_impl(cfg: ModelConfig, deterministic: bool) -> str:
  """The kernel model.attention_impl names: 'einsum', 'xla' or 'cudnn'."""
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


def attention(
  impl: str,
  q_BLHK: Array,
  k_BSHK: Array,
  v_BSHK: Array,
  *,
  bias_BHLS: Array | None,
  mask_B1LS: Array | None,
  scale: float,
  causal: bool,
  dropout: Callable[[Array], Array] | None,
) -> Array:
  """Multi-head attention by the kernel `impl` (see attention_impl).

  Queries [B, L, H, K] attend to keys and values [B, S, H, K]; the result
  is [B, L, H, K]. `bias_BHLS` is added to the float32 logits,
  `mask_B1LS` (True: may attend) hides keys, `causal` says that the mask
  is causal (cuDNN then skips the key blocks it hides) and `dropout`
  drops attention probabilities (the einsum kernel only).
  """
  if impl == 'einsum':
    return einsum.attention(
      q_BLHK,
      k_BSHK,
      v_BSHK,
      bias_BHLS=bias_BHLS,
      mask_B1LS=mask_B1LS,
      scale=scale,
      dropout=dropout,
    )
  return cudnn.attention(
    q_BLHK,
    k_BSHK,
    v_BSHK,
    bias_BHLS=bias_BHLS,
    mask_B1LS=mask_B1LS,
    scale=scale,
    causal=causal,
    implementation=impl,
  )
