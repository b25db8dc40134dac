"""The output heads of models/heads.py against their definitions."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from pretrain_lm.models import heads, layers
from pretrain_lm.models.config import ModelConfig

V = 50


class Mlm(nn.Module):
  """An MLM head on a tied token table."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BPD):
    embed = layers.Embed(V, self.cfg, name='token_embed')
    return heads.MlmHead(self.cfg, name='head')(x_BPD, embed)


def test_mlm_head_adds_its_vocab_bias_and_sums_its_gradient_over_rows():
  cfg = ModelConfig(vocab_size=V, emb_dim=8, num_heads=2, head_dim=4)
  x = jax.random.normal(jax.random.key(0), (3, 4, 8))
  w = jax.random.normal(jax.random.key(1), (3, 4, V))
  params = Mlm(cfg).init(jax.random.key(2), x)['params']
  bias = jax.random.normal(jax.random.key(3), (V,))

  def with_bias(b):
    head = dict(params['head'], output_bias=b)
    return dict(params, head=head)

  def logits(b):
    return Mlm(cfg).apply({'params': with_bias(b)}, x)

  plain = logits(jnp.zeros(V))
  np.testing.assert_allclose(logits(bias), plain + bias, rtol=1e-6, atol=1e-6)
  grad = jax.grad(lambda b: jnp.sum(jnp.sin(logits(b)) * w))(bias)
  want = jnp.sum(jnp.cos(plain + bias) * w, axis=(0, 1))
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)
