"""jax.nn.dot_product_attention: XLA's kernel ('xla') or cuDNN's ('cudnn').

On cuDNN, a mask that is the only bias is handed to jax's kernel with its
gradient off, and a causal mask also as cuDNN's causal mask type.
"""

import contextlib
import functools
import inspect

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


# The private kernel's parameters, as `attention` passes them.
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
  arguments `attention` gives it (jax 0.10), else None: then the mask's
  gradient is computed, as jax.nn does."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415

    params = inspect.signature(fa._dot_product_attention.fun).parameters
  except (ImportError, AttributeError, TypeError, ValueError):
    return None
  return fa if list(params) == _CUDNN_PARAMS else None


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
