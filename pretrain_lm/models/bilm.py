"""The bilm family: ELMo's bidirectional LM (Peters et al., 2018).

Two causal Transformer stacks instead of ELMo's LSTMs: `forward` reads the
row left to right and predicts each next token, `backward` reads it right
to left and predicts each previous token. As in ELMo, the token embedding
(here with the position embedding) and the output softmax are shared by
both directions; the layers are not.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models import heads, layers, transformer
from pretrain_lm.models.config import ModelConfig
from pretrain_lm.models.encoder import stack_inputs

Array = jax.Array


class BiLMModel(nn.Module):
  """Forward and backward causal stacks over shared embeddings and softmax.

  Returns a dict: `logits` [B, L, V] for the token after each one,
  `backward_logits` [B, L, V] for the token before it, `hidden` [B, L, 2D]
  the forward and backward final states side by side, and `layer_states`
  [N + 1, B, L, 2D]: the embedding output in both halves (ELMo's token
  layer), then each layer's forward and backward outputs, for ELMo's
  learned mix of layers downstream.
  """

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.token_embed = layers.Embed(cfg.padded_vocab, cfg, cfg.token_dim)
    self.embeddings = transformer.Embedder(cfg, self.token_embed)
    stack = dict(
      cfg=cfg,
      embedder=self.embeddings,
      num_layers=cfg.num_layers,
      causal=True,
      collect_states=True,
    )
    self.forward = transformer.Stack(**stack)
    self.backward = transformer.Stack(**stack)
    self.lm_head = heads.LmHead(cfg)

  def __call__(self, batch: dict[str, Array], *, deterministic: bool):
    ids_BL = batch['input_ids']
    inputs = stack_inputs(batch, pad_id=self.cfg.pad_id)
    fwd_BLD, fwd_NBLD = self.forward(
      ids_BL, deterministic=deterministic, **inputs
    )
    # Reversing a packed row keeps each document contiguous, so the same
    # segment mask applies; positions count from each document's end, as
    # the backward direction reads it.
    segments_BL = inputs['segment_ids_BL'][:, ::-1]
    bwd_BLD, bwd_NBLD = self.backward(
      ids_BL[:, ::-1],
      segment_ids_BL=segments_BL,
      positions_BL=transformer.default_positions(segments_BL),
      deterministic=deterministic,
    )
    bwd_BLD, bwd_NBLD = bwd_BLD[:, ::-1], bwd_NBLD[:, :, ::-1]
    # ELMo's layer 0 is one context-free token representation, the same
    # for both directions, so the forward one is used in both halves.
    bwd_NBLD = bwd_NBLD.at[0].set(fwd_NBLD[0])
    return {
      'hidden': jnp.concatenate([fwd_BLD, bwd_BLD], axis=-1),
      'layer_states': jnp.concatenate([fwd_NBLD, bwd_NBLD], axis=-1),
      'logits': self.lm_head(fwd_BLD, self.token_embed),
      'backward_logits': self.lm_head(bwd_BLD, self.token_embed),
    }

  @staticmethod
  def train_flops(cfg: ModelConfig, shapes: dict[str, tuple]) -> float:
    """Model FLOPs of one step: two stacks and two D x V logits per token.

    V is model.vocab_size, not padded_vocab: only the useful columns of
    the output product are credited.
    """
    B, L = shapes['input_ids']
    per_token = transformer.stack_flops_per_token(
      cfg, cfg.num_layers, L, causal=True
    )
    per_token += 6 * cfg.token_dim * cfg.vocab_size
    if cfg.token_dim != cfg.emb_dim:
      per_token += 6 * cfg.emb_dim * cfg.token_dim
    return float(2 * B * L * per_token)
