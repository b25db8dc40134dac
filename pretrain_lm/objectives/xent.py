"""Token cross-entropy over the vocabulary, chosen by objective.cross_entropy.

'optax' (the default) casts the logits to float32 and lets autodiff
differentiate optax's softmax cross-entropy; for half-precision logits the
backward pass then keeps a float32 [..., V] array (the exponentials of the
log-sum-exp) besides them. 'fused' is `cross_entropy` below: one custom
VJP whose forward reads the logits once (float32 arithmetic inside the
fusion) and whose backward recomputes the softmax from the logits, keeping
only the logits in their own dtype and a float32 log-sum-exp per row.

`objectives.loss_fn` sets the choice around the objective's loss call
(`implementation`), so every objective that calls `token_xent` honours the
config field without it being passed down. The model-side chunked
cross-entropy (model.logits_chunk, models/heads.py) does not come here.
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import optax

from pretrain_lm import configlib

# Read while tracing the loss: the choice is a trace-time constant.
_IMPLEMENTATION = contextvars.ContextVar('cross_entropy', default='optax')


def _check(impl: str) -> str:
  if impl not in configlib.CROSS_ENTROPY:
    raise ValueError(
      f'objective.cross_entropy={impl!r}; expected one of '
      f'{configlib.CROSS_ENTROPY}.'
    )
  return impl


@contextlib.contextmanager
def implementation(impl: str):
  """Within the block, `token_xent` computes with `impl` ('optax'|'fused')."""
  token = _IMPLEMENTATION.set(_check(impl))
  try:
    yield
  finally:
    _IMPLEMENTATION.reset(token)


def token_xent(logits, labels):
  """Per-token cross-entropy and argmax correctness, both float32 [...].

  Args:
    logits: float [..., V], any float dtype.
    labels: int [...], the target ids.

  Returns:
    (xent, correct): -log softmax(logits)[label], and 1.0 where the argmax
    of the logits is the label (ties as jnp.argmax).
  """
  impl = _check(_IMPLEMENTATION.get())
  if impl == 'fused':
    return cross_entropy(logits, labels)
  # float32 softmax: bfloat16 log-sum-exp over a large vocab loses precision.
  logits = logits.astype(jnp.float32)
  xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  return xent, correct


def cross_entropy(logits, labels):
  """Fused softmax cross-entropy: (xent, correct), float32 [...].

  The gradient flows to `logits` only (in their dtype); `correct` has none.
  """
  # The float32 cast is exact and order-preserving, so the argmax (and its
  # ties) is the one over the cast logits.
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  return _xent(logits, labels), correct


def _forward(logits, labels):
  """Cross-entropy as optax computes it, and the log-sum-exp per row."""
  x = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(x, axis=-1)
  label_logit = jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
  return lse - label_logit, lse


@jax.custom_vjp
def _xent(logits, labels):
  return _forward(logits, labels)[0]


def _xent_fwd(logits, labels):
  xent, lse = _forward(logits, labels)
  # No float32 [..., V] residual: the backward recomputes exp from these.
  return xent, (logits, lse, labels)


def _xent_bwd(residuals, g):
  logits, lse, labels = residuals
  # d xent / d logits = softmax - onehot(label); one elementwise expression
  # over the logits, so XLA fuses it into a single pass that writes dlogits.
  vocab = jnp.arange(logits.shape[-1], dtype=labels.dtype)
  onehot = (labels[..., None] == vocab).astype(jnp.float32)
  softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
  dlogits = (softmax - onehot) * g[..., None]
  return dlogits.astype(logits.dtype), None  # labels: integers, no gradient


_xent.defvjp(_xent_fwd, _xent_bwd)
