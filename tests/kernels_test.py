"""pretrain_lm.models.kernels: the seam picks the kernel the config names,
the kernels agree, and each keeps its own promises.

The einsum kernel against jax.nn's XLA kernel on causal, padded and biased
attention, outputs and gradients; its attention dropout's rate and scale;
the cuDNN path's mask handling, lowered here for a GPU, and on a GPU its
outputs and gradients against the einsum kernel's; every family's every
attention on the kernel the config names.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from pretrain_lm.models import kernels, layers
from pretrain_lm.models.config import ModelConfig
from pretrain_lm.models.kernels import cudnn, einsum

B, L, H, K = 2, 8, 2, 4


def qkv(seed=0, shape=(B, L, H, K)):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(k, shape) for k in keys)


def causal_case(length=L):
  # Two packed documents in row 0 (the first 3/8 of it, then the rest),
  # one in row 1: causal within each.
  segments = np.ones((B, length), int)
  segments[0, 3 * length // 8 :] = 2
  same = segments[:, :, None] == segments[:, None, :]
  mask = same & np.tril(np.ones((length, length), bool))
  return jnp.asarray(mask[:, None]), None, True, np.ones((B, length), bool)


def padded_case(length=L):
  # Row 1 is 3/8 tokens and the rest padding: no query sees a pad key, and
  # the pad queries (which see no key at all) are left out of the
  # comparison.
  real = np.ones((B, length), bool)
  real[1, 3 * length // 8 :] = False
  mask = real[:, None, :] & real[:, :, None]
  return jnp.asarray(mask[:, None]), None, False, real


def biased_case(length=L):
  # A learned per-head bias (T5's relative bias) on top of padding.
  mask, _, _, real = padded_case(length)
  bias = jax.random.normal(jax.random.key(9), (B, H, length, length))
  return mask, bias, False, real


CASES = {'causal': causal_case, 'padded': padded_case, 'biased': biased_case}


@pytest.mark.parametrize('case', CASES)
def test_einsum_and_xla_kernels_agree_on_outputs_and_gradients(case):
  mask, bias, causal, real = CASES[case]()
  cotangent = jax.random.normal(jax.random.key(5), (B, L, H, K))
  cotangent = cotangent * real[:, :, None, None]

  def loss(impl):
    def f(q, k, v, bias):
      out = kernels.attention(
        impl,
        q,
        k,
        v,
        bias_BHLS=bias,
        mask_B1LS=mask,
        scale=0.5,
        causal=causal,
        dropout=None,
      )
      return jnp.sum(out * cotangent), out

    return f

  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  args = (*qkv(), bias)
  want_grads, want = jax.grad(loss('einsum'), argnums, has_aux=True)(*args)
  got_grads, got = jax.grad(loss('xla'), argnums, has_aux=True)(*args)
  np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-6)
  for g, w in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  # The masks matter: without them the outputs differ.
  unmasked = kernels.attention(
    'einsum',
    *qkv(),
    bias_BHLS=bias,
    mask_B1LS=None,
    scale=0.5,
    causal=False,
    dropout=None,
  )
  assert not np.allclose(unmasked[real], want[real], atol=1e-3)


class Attend(nn.Module):
  """MultiHeadAttention's self-attention on x, the mask causal."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, deterministic):
    mask = jnp.tril(jnp.ones((L, L), bool))[None, None]
    return layers.MultiHeadAttention(self.cfg, 0.02)(
      x_BLD, x_BLD, mask=mask, deterministic=deterministic, causal=True
    )


@pytest.mark.parametrize(
  'impl, kernel', [('einsum', 'einsum'), ('xla', 'xla'), ('cudnn', 'cudnn')]
)
def test_the_seam_runs_the_kernel_the_config_names(impl, kernel, monkeypatch):
  calls = []
  einsum_attention = einsum.attention

  def spy_einsum(*args, **kw):
    calls.append('einsum')
    return einsum_attention(*args, **kw)

  def spy_fused(*args, causal, implementation, **kw):
    # Run the einsum kernel in its place: cuDNN does not run on a CPU.
    calls.append(implementation)
    assert causal
    return einsum_attention(*args, **kw)

  monkeypatch.setattr(einsum, 'attention', spy_einsum)
  monkeypatch.setattr(cudnn, 'attention', spy_fused)
  cfg = ModelConfig(
    emb_dim=8, num_heads=2, head_dim=4, attention_impl=impl, dtype='bfloat16'
  )
  x = jnp.ones((B, L, 8))
  params = Attend(cfg).init(jax.random.key(0), x, True)
  calls.clear()
  Attend(cfg).apply(params, x, True)
  assert calls == [kernel]


def test_auto_is_einsum_off_a_gpu_and_fused_kernels_refuse_dropout():
  cfg = ModelConfig(attention_impl='auto', dtype='bfloat16')
  assert jax.default_backend() == 'cpu'
  assert kernels.attention_impl(cfg, deterministic=True) == 'einsum'
  cfg = dataclasses.replace(cfg, attention_impl='cudnn')
  with pytest.raises(ValueError, match='attention_dropout_rate'):
    kernels.attention_impl(cfg, deterministic=False)
  assert kernels.attention_impl(cfg, deterministic=True) == 'cudnn'
  no_dropout = dataclasses.replace(cfg, attention_dropout_rate=0.0)
  assert kernels.attention_impl(no_dropout, deterministic=False) == 'cudnn'


class DropProbs(nn.Module):
  """The einsum kernel with Flax dropout on its probabilities."""

  rate: float

  @nn.compact
  def __call__(self, q, k, v, deterministic):
    drop = nn.Dropout(self.rate)
    return kernels.attention(
      'einsum',
      q,
      k,
      v,
      bias_BHLS=None,
      mask_B1LS=None,
      scale=1.0,
      causal=False,
      dropout=lambda p: drop(p, deterministic=deterministic),
    )


@pytest.mark.parametrize('rate', [0.1, 0.5])
def test_attention_dropout_drops_probabilities_at_the_rate_and_rescales(rate):
  # Equal logits: every probability is 1/S. Value s is the s-th unit
  # vector, so the output holds each query's (dropped) probabilities.
  rows, queries, heads, s = 16, 64, 4, 64
  q = jnp.zeros((rows, queries, heads, s))
  v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (rows, s, heads, s))

  def run(deterministic, seed=0):
    rngs = {'dropout': jax.random.key(seed)}
    out = DropProbs(rate).apply({}, q, q, v, deterministic, rngs=rngs)
    return np.asarray(out)

  np.testing.assert_allclose(run(True), 1 / s, rtol=1e-6)
  y = run(False)
  dropped = y == 0
  n = y.size
  # Within 5 standard errors of Bernoulli(rate); the rest scaled up.
  assert abs(dropped.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / n)
  np.testing.assert_allclose(y[~dropped], 1 / s / (1 - rate), rtol=1e-6)
  np.testing.assert_array_equal(run(False, seed=0), y)
  assert (run(False, seed=1) != y).any()


def cudnn_calls(bias, causal):
  """The cuDNN attention custom calls (name, result count, mask type) in
  the gradient of the cuDNN kernel, lowered here for a GPU.

  This reads the lowered program on purpose: which kernel runs is the
  behaviour under test, and CI has no GPU to run it on
  (test_cudnn_and_einsum_kernels_agree_on_a_gpu checks its numbers on
  one). Lowering for 'cuda' is the one check of it a CPU can make.
  """
  B, L, H, K = 2, 8, 2, 8
  q = jnp.ones((B, L, H, K), jnp.bfloat16)
  mask = jnp.tril(jnp.ones((L, L), bool))[None, None].repeat(B, 0)

  def loss(q, k, v, bias):
    out = cudnn.attention(
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

  with cudnn.cudnn_off_gpu(90800):
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
  assert cudnn._cudnn_kernel() is not None  # the pinned jax's kernel
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


@pytest.mark.skipif(
  jax.default_backend() != 'gpu',
  reason='cuDNN needs a GPU: JAX_PLATFORMS=cuda pytest tests/kernels_test.py',
)
@pytest.mark.parametrize('case', CASES)
def test_cudnn_and_einsum_kernels_agree_on_a_gpu(case):
  # cuDNN's fused kernel takes half precision and head dims that are a
  # multiple of 8: bfloat16 rows of 128, heads of 64. The reference is the
  # einsum kernel in float32 on the same bfloat16 inputs.
  length = 128
  mask, bias, causal, real = CASES[case](length)
  cotangent = jax.random.normal(jax.random.key(5), (B, length, H, 64))
  cotangent = cotangent * real[:, :, None, None]
  q, k, v = (x.astype(jnp.bfloat16) for x in qkv(shape=(B, length, H, 64)))
  bias = None if bias is None else bias.astype(jnp.bfloat16)
  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

  def grads(impl, dtype):
    def loss(q, k, v, bias):
      out = kernels.attention(
        impl,
        q.astype(dtype),
        k.astype(dtype),
        v.astype(dtype),
        bias_BHLS=None if bias is None else bias.astype(dtype),
        mask_B1LS=mask,
        scale=0.125,
        causal=causal,
        dropout=None,
      ).astype(jnp.float32)
      return jnp.sum(out * cotangent), out

    return jax.jit(jax.grad(loss, argnums, has_aux=True))(q, k, v, bias)

  want_grads, want = grads('einsum', jnp.float32)
  got_grads, got = grads('cudnn', jnp.bfloat16)
  # bfloat16 keeps 8 bits: errors of a few units in the last place of the
  # largest value. Pad queries see no key and are left out, as are the
  # gradients at their rows.
  np.testing.assert_allclose(got[real], want[real], rtol=0, atol=2e-2)
  names = ['dq', 'dk', 'dv', 'dbias']
  for name, g, w in zip(names, got_grads, want_grads, strict=False):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    if name != 'dbias':
      g, w = g[real], w[real]
    else:  # [B, H, L, S]: the rows of real queries, the real keys
      keep = real[:, None, :, None] & real[:, None, None, :]
      keep = np.broadcast_to(keep, g.shape)
      g, w = g[keep], w[keep]
    scale = np.abs(w).max()
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-2 * scale, err_msg=name)


def family_batch(family: str, B: int = 2, L: int = 16, P: int = 4):
  """A packed batch (two documents in row 0) for any family."""
  segments = np.ones((B, L), np.int32)
  segments[0, L // 2 :] = 2
  ids = np.arange(5, 5 + B * L, dtype=np.int32).reshape(B, L) % 60 + 5
  inputs = {'input_ids': ids, 'segment_ids': segments}
  if family == 'encoder_decoder':
    return {
      'encoder_input_ids': ids,
      'encoder_segment_ids': segments,
      'decoder_input_ids': ids,
      'decoder_segment_ids': segments,
    }
  if family in ('encoder', 'electra', 'plm'):
    inputs['masked_positions'] = np.tile(np.arange(P, dtype=np.int32), (B, 1))
    inputs['masked_weights'] = np.ones((B, P), np.float32)
    inputs['masked_ids'] = ids[:, :P]
  if family == 'plm':
    rank = np.full((B, L), -1, np.int32)
    rank[:, :P] = np.arange(P)
    inputs['perm_rank'] = rank
  return inputs


FAMILY_VARIANTS = {
  'encoder': {},
  'decoder': {'norm_position': 'pre'},
  'encoder_decoder': {'position': 'relative', 'norm_type': 'rmsnorm'},
  'electra': {},
  'bilm': {},
  'plm': {},
}


@pytest.mark.parametrize('family', FAMILY_VARIANTS)
def test_every_attention_of_every_family_runs_on_the_named_kernel(
  family, monkeypatch
):
  # attention_impl=cudnn reaches each family's every attention (self,
  # cross, XLNet's two streams, ELECTRA's generator, both biLM directions)
  # with the segment mask, the causal flag where the mask is causal, and
  # T5's relative bias; no attention falls back to the einsum kernel.
  from pretrain_lm.models import MODELS  # noqa: PLC0415
  from pretrain_lm.models.config import size_preset  # noqa: PLC0415

  calls = []
  einsum_attention = einsum.attention

  def spy_einsum(*args, **kw):
    calls.append(('einsum', None, None))
    return einsum_attention(*args, **kw)

  def spy_fused(*args, causal, implementation, **kw):
    calls.append((implementation, causal, kw['bias_BHLS'] is not None))
    assert kw['mask_B1LS'] is not None  # packed segments, always masked
    return einsum_attention(*args, **kw)

  monkeypatch.setattr(einsum, 'attention', spy_einsum)
  monkeypatch.setattr(cudnn, 'attention', spy_fused)
  cfg = ModelConfig(
    family=family,
    vocab_size=64,
    max_len=32,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    attention_impl='cudnn',
    dtype='bfloat16',
    **{**size_preset('tiny'), **FAMILY_VARIANTS[family]},
  )
  model = MODELS[family](cfg)
  batch = family_batch(family)
  params = model.init(jax.random.key(0), batch, deterministic=True)
  calls.clear()
  model.apply(params, batch, deterministic=True)
  layers_run = {
    'encoder': 2,
    'decoder': 2,
    'encoder_decoder': 6,  # encoder 2, decoder self 2, cross 2
    'electra': 4,  # generator 2, discriminator 2
    'bilm': 4,  # forward 2, backward 2
    'plm': 4,  # content and query streams, 2 layers each
  }[family]
  assert len(calls) == layers_run, calls
  assert {impl for impl, _, _ in calls} == {'cudnn'}
  causal = [c for _, c, _ in calls]
  biased = [b for _, _, b in calls]
  if family in ('decoder', 'bilm'):
    assert all(causal)
  elif family == 'encoder_decoder':
    # Self-attention in both stacks carries T5's relative bias; the
    # decoder's is causal; cross-attention has neither.
    assert sorted(zip(causal, biased, strict=True)) == sorted(
      [(False, True)] * 2 + [(True, True)] * 2 + [(False, False)] * 2
    )
  else:
    assert not any(causal) and not any(biased)
