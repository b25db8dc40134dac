"""ELECTRA (Clark et al., 2020): a small MLM generator and a discriminator.

Both bodies share the token, position and token-type embeddings (width E);
each projects E to its own width. The generator fills the masked positions
with samples from its MLM distribution (no gradient flows through the
samples) and the discriminator labels every token original or replaced.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models import heads, layers, transformer
from pretrain_lm.models.config import ModelConfig
from pretrain_lm.models.encoder import stack_inputs

Array = jax.Array


def generator_config(cfg: ModelConfig) -> ModelConfig:
  """The generator: generator_width times the width, heads and MLP."""
  w = cfg.generator_width
  heads_ = max(1, round(cfg.num_heads * w))
  emb = max(heads_, round(cfg.emb_dim * w))
  return dataclasses.replace(
    cfg,
    emb_dim=emb,
    num_heads=heads_,
    head_dim=emb // heads_,
    mlp_dim=max(1, round(cfg.mlp_dim * w)),
    embed_dim=cfg.token_dim,
  )


class DiscriminatorHead(nn.Module):
  """Dense + activation + a 1-unit dense: a replaced-token logit per token."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, hidden_BLD: Array) -> Array:
    cfg = self.cfg
    h = layers.dense(
      self,
      'disc_transform',
      hidden_BLD,
      (cfg.emb_dim, cfg.emb_dim),
      ('embed', None),
      'BLD,DE->BLE',
      use_bias=True,
      std=cfg.initializer_range,
    )
    h = layers.ACTIVATIONS['gelu'](h)
    logits = layers.dense(
      self,
      'disc_output',
      h,
      (cfg.emb_dim, 1),
      (None, None),
      'BLE,EO->BLO',
      use_bias=True,
      std=cfg.initializer_range,
    )
    return logits[..., 0].astype(jnp.float32)


class ElectraModel(nn.Module):
  """Returns `mlm_logits` [B, P, V] (generator), `disc_logits` [B, L],
  `disc_labels` [B, L] (1 where the token was replaced) and `hidden`, the
  discriminator's states (the model kept for fine-tuning)."""

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    gen = generator_config(cfg)
    self.token_embed = layers.Embed(cfg.padded_vocab, cfg, cfg.token_dim)
    self.embeddings = transformer.Embedder(cfg, self.token_embed)
    self.generator = transformer.Stack(
      gen, self.embeddings, cfg.num_layers, causal=False
    )
    self.generator_head = heads.MlmHead(gen)
    self.discriminator = transformer.Stack(
      cfg, self.embeddings, cfg.num_layers, causal=False
    )
    self.discriminator_head = DiscriminatorHead(cfg)

  def __call__(self, batch: dict[str, Array], *, deterministic: bool):
    inputs = dict(
      stack_inputs(batch, pad_id=self.cfg.pad_id),
      type_ids_BL=batch.get('token_type_ids'),
    )
    ids = jnp.asarray(batch['input_ids'])
    positions, weights = batch['masked_positions'], batch['masked_weights']
    # The generator's states only at the masked positions: its MLM head
    # is all that reads them (transformer.Stack's output positions).
    gen_BPD = self.generator(
      ids, deterministic=deterministic, output_positions_BP=positions, **inputs
    )
    mlm_logits = self.generator_head(gen_BPD, self.token_embed)

    logits = jax.lax.stop_gradient(mlm_logits.astype(jnp.float32))
    if deterministic:  # evaluation: the generator's most likely token
      sampled = jnp.argmax(logits, axis=-1)
    else:
      sampled = jax.random.categorical(self.make_rng('dropout'), logits)
    # The original text, then the samples at the masked positions; padding
    # slots scatter out of range and are dropped.
    B, L = ids.shape
    rows = jnp.arange(B)[:, None]
    slots = jnp.where(weights > 0, positions, L)
    original = ids.at[rows, slots].set(batch['masked_ids'], mode='drop')
    corrupted = original.at[rows, slots].set(
      sampled.astype(ids.dtype), mode='drop'
    )
    # A sample equal to the original token counts as original (ELECTRA).
    labels = (corrupted != original).astype(jnp.int32)

    hidden = self.discriminator(
      corrupted, deterministic=deterministic, **inputs
    )
    return {
      'hidden': hidden,
      'mlm_logits': mlm_logits,
      'disc_logits': self.discriminator_head(hidden),
      'disc_labels': labels,
    }

  @staticmethod
  def train_flops(cfg: ModelConfig, shapes: dict[str, tuple]) -> float:
    """Both bodies, the generator's MLM head at P positions, the disc head.

    The MLM head's output product counts vocab_size columns, not
    padded_vocab: only the useful work is credited.
    """
    B, L = shapes['input_ids']
    P = shapes['masked_positions'][1]
    gen = generator_config(cfg)
    per_row = transformer.stack_flops_per_row(gen, cfg.num_layers, L, P)
    per_row += L * (
      transformer.stack_flops_per_token(cfg, cfg.num_layers, L)
      + 6 * (cfg.emb_dim**2 + cfg.emb_dim)
    )
    per_row += 6 * (gen.emb_dim + cfg.vocab_size) * cfg.token_dim * P
    return float(B * per_row)
