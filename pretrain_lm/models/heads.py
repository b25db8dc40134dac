"""Output heads that sit on a Transformer body."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models import layers
from pretrain_lm.models.config import ModelConfig


def gather_positions(x_BLD: jax.Array, positions_BP: jax.Array) -> jax.Array:
  """The hidden states at `positions` of each row: [B, L, D] -> [B, P, D]."""
  return jnp.take_along_axis(x_BLD, positions_BP[..., None], axis=1)


class MlmHead(nn.Module):
  """BERT's masked-LM head: dense + activation + LayerNorm, then tied logits.

  It runs only on the P predicted positions, gathered first, so the [*, V]
  logits cost B*P*V rather than B*L*V (P is about 15% of L).
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(
    self, x_BLD: jax.Array, positions_BP: jax.Array, embed: layers.Embed
  ) -> jax.Array:
    cfg = self.cfg
    dtype = cfg.jnp_dtype
    x_BPD = nn.with_logical_constraint(
      gather_positions(x_BLD, positions_BP), layers.BLD
    )
    w_DD = self.param(
      'transform_kernel',
      # Only the input dim is sharded: the output dim on 'tensor', next to
      # the (vocab, embed)-sharded tied table, makes jax 0.10's XLA compute
      # wrong gradients on (data, fsdp, tensor) meshes (see
      # tests/train_test.py). The D x D kernel is small; Megatron leaves it
      # unsplit too.
      layers.kernel_init(cfg, ('embed', None)),
      (cfg.emb_dim, cfg.emb_dim),
      cfg.jnp_param_dtype,
    )
    b_D = self.param(
      'transform_bias',
      layers.zeros_init((None,)),
      (cfg.emb_dim,),
      cfg.jnp_param_dtype,
    )
    h_BPD = jnp.einsum('BPD,DE->BPE', x_BPD, w_DD.astype(dtype))
    h_BPD = layers.ACTIVATIONS[cfg.activation](h_BPD + b_D.astype(dtype))
    h_BPD = layers.layer_norm(cfg, 'transform_norm')(h_BPD)
    logits_BPV = embed.attend(h_BPD)
    bias_V = self.param(
      'output_bias',
      layers.zeros_init(('vocab',)),
      (cfg.vocab_size,),
      cfg.jnp_param_dtype,
    )
    logits_BPV = logits_BPV + bias_V.astype(dtype)
    return nn.with_logical_constraint(
      logits_BPV, ('activation_batch', 'activation_length', 'activation_vocab')
    )
