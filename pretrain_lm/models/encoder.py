"""The encoder family (BERT, RoBERTa): bidirectional Transformer + MLM head."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models import heads, layers
from pretrain_lm.models.config import ModelConfig

Array = jax.Array


class EncoderLayer(nn.Module):
  """Self-attention + feed-forward, post-LN (BERT) or pre-LN (GPT-2/T5)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: Array, mask_B1LS: Array, deterministic: bool):
    cfg = self.cfg
    dropout = nn.Dropout(cfg.dropout_rate)
    attention = layers.MultiHeadAttention(cfg, name='attention')
    mlp = layers.Mlp(cfg, name='mlp')
    attn_norm = layers.layer_norm(cfg, 'attention_norm')
    mlp_norm = layers.layer_norm(cfg, 'mlp_norm')

    if cfg.norm_position == 'post':
      y = attention(x_BLD, x_BLD, mask_B1LS, deterministic)
      x_BLD = attn_norm(x_BLD + dropout(y, deterministic=deterministic))
      y = mlp(x_BLD, deterministic)
      x_BLD = mlp_norm(x_BLD + dropout(y, deterministic=deterministic))
    else:
      h = attn_norm(x_BLD)
      y = attention(h, h, mask_B1LS, deterministic)
      x_BLD = x_BLD + dropout(y, deterministic=deterministic)
      y = mlp(mlp_norm(x_BLD), deterministic)
      x_BLD = x_BLD + dropout(y, deterministic=deterministic)
    return nn.with_logical_constraint(x_BLD, layers.BLD)


class Encoder(nn.Module):
  """Token + learned position + segment embeddings, then the layer stack."""

  cfg: ModelConfig
  token_embed: layers.Embed

  @nn.compact
  def __call__(
    self,
    input_ids_BL: Array,
    segment_ids_BL: Array,
    input_mask_BL: Array,
    deterministic: bool,
  ) -> Array:
    cfg = self.cfg
    L = input_ids_BL.shape[1]
    if cfg.max_len < L:
      raise ValueError(
        f'Sequence length {L} exceeds model.max_len={cfg.max_len} (the '
        'position table); lower data.seq_len or raise model.max_len.'
      )
    positions = layers.Embed(
      cfg.max_len, cfg, axes=('position', 'embed'), name='position_embed'
    )
    segments = layers.Embed(
      cfg.type_vocab_size,
      cfg,
      axes=('type_vocab', 'embed'),
      name='segment_embed',
    )
    x_BLD = self.token_embed(input_ids_BL) + positions(jnp.arange(L)[None])
    x_BLD = x_BLD + segments(segment_ids_BL)
    if cfg.norm_position == 'post':
      # BERT normalises the embedding sum; pre-LN stacks normalise at the end.
      x_BLD = layers.layer_norm(cfg, 'embed_norm')(x_BLD)
    x_BLD = nn.Dropout(cfg.dropout_rate)(x_BLD, deterministic=deterministic)
    x_BLD = nn.with_logical_constraint(x_BLD, layers.BLD)

    # Padding keys are masked for every query; padded queries are computed
    # and ignored by the loss.
    mask_B1LS = input_mask_BL[:, None, None, :].astype(bool)
    for i in range(cfg.num_layers):
      x_BLD = EncoderLayer(cfg, name=f'layer_{i}')(
        x_BLD, mask_B1LS, deterministic
      )
    if cfg.norm_position == 'pre':
      x_BLD = layers.layer_norm(cfg, 'final_norm')(x_BLD)
    return x_BLD


class EncoderModel(nn.Module):
  """Encoder body with the MLM head tied to its token embedding.

  Takes a feature dict from the objective's tf.data transform and returns a
  dict: `hidden` [B, L, D] always, `mlm_logits` [B, P, V] when the batch has
  `masked_positions`.
  """

  cfg: ModelConfig

  def setup(self):
    self.token_embed = layers.Embed(self.cfg.vocab_size, self.cfg)
    self.encoder = Encoder(self.cfg, self.token_embed)
    self.mlm_head = heads.MlmHead(self.cfg)

  def __call__(self, batch: dict[str, Array], *, deterministic: bool):
    input_ids = batch['input_ids']
    segment_ids = batch.get('segment_ids', jnp.zeros_like(input_ids))
    input_mask = batch.get('input_mask', input_ids != 0)
    hidden = self.encoder(input_ids, segment_ids, input_mask, deterministic)
    outputs = {'hidden': hidden}
    if 'masked_positions' in batch:
      outputs['mlm_logits'] = self.mlm_head(
        hidden, batch['masked_positions'], self.token_embed
      )
    return outputs

  @staticmethod
  def train_flops_per_token(
    cfg: ModelConfig, seq_len: int, predictions_per_row: int
  ) -> float:
    """Model FLOPs of one training step, per input token (PaLM, App. B).

    A matmul with N weights costs 2N FLOPs per token forward and 4N backward,
    so 6N in all. Counted: the attention and MLP projections of every layer
    (N = 4·D·H·K + 2·D·F), the score and value products of attention
    (2 matmuls of L·H·K per token, so 6·2·L·H·K), and the MLM head (D·D
    transform + D·V tied output), which runs only on the predicted fraction
    P/L of tokens. Embedding lookups, norms and softmax are not matmuls and,
    as in the MFU convention, are left out; dropout and remat recomputation
    are not model FLOPs either.
    """
    D, H, K, F = cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    per_layer = 6 * (4 * D * H * K + 2 * D * F) + 12 * seq_len * H * K
    head = 6 * (D * D + D * cfg.vocab_size) * predictions_per_row / seq_len
    return float(cfg.num_layers * per_layer + head)
