"""XLNet's two-stream self-attention (Yang et al., 2019, section 2.3).

One encoder stack runs two streams through every layer with the same
weights. The content stream h is an ordinary encoder over the row's tokens,
masked by the factorisation order: a token sees the tokens before it in the
order and itself. The query stream g runs only at the P predicted positions;
it starts from the embedding of [MASK] at the target's position (XLNet's
learned w) and attends to the content stream of the tokens strictly before
the target in the order, never to the target's own token. MLM's head on the
final g predicts the targets.

The order comes from the objective (pretrain_lm.objectives.plm) as
`perm_rank`: the rank of each predicted token among the predicted ones, -1
for the rest, which come first and see each other bidirectionally. Without
`perm_rank` and `masked_positions` (fine-tuning, features) only the content
stream runs and it is exactly the bidirectional EncoderModel: the parameter
trees are the same, so a PLM checkpoint loads as an encoder too.

Not implemented: Transformer-XL's segment recurrence (memory), XLNet's
relative segment encodings and its content-dependent relative attention
(model.position='relative' gives T5's bucketed bias instead). Layers are
unrolled (or shared, ALBERT-style); model.scan_layers is not supported.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models import heads, layers, transformer
from pretrain_lm.models.config import ModelConfig
from pretrain_lm.models.encoder import stack_inputs

Array = jax.Array

# The tokenizer's [MASK] id (pretrain_lm.data.tokenizer): its embedding
# starts the query stream.
MASK_ID = 4


def two_stream_masks(
  segment_ids_BL: Array, perm_rank_BL: Array, targets_BP: Array
) -> tuple[Array, Array]:
  """The content mask [B, 1, L, L] and the query mask [B, 1, P, L].

  content[q, k]: same segment, real key, rank[k] <= rank[q]; query[p, k]:
  same segment as target p, real key, rank[k] < rank[target p]. Ranks are
  -1 off the targets, so non-targets see each other and no target.
  """
  same_BqLS = transformer.attention_mask(
    segment_ids_BL, segment_ids_BL, causal=False
  )
  rank_k = perm_rank_BL[:, None, None, :]
  content = same_BqLS & (rank_k <= perm_rank_BL[:, None, :, None])
  target_rank_BP = jnp.take_along_axis(perm_rank_BL, targets_BP, axis=1)
  target_segment_BP = jnp.take_along_axis(segment_ids_BL, targets_BP, axis=1)
  query = transformer.attention_mask(
    target_segment_BP, segment_ids_BL, causal=False
  ) & (rank_k < target_rank_BP[:, None, :, None])
  return content, query


class TwoStreamStack(nn.Module):
  """Embeddings, then num_layers layers each applied to h and to g."""

  cfg: ModelConfig
  embedder: transformer.Embedder

  @nn.compact
  def __call__(
    self,
    ids_BL: Array,
    *,
    segment_ids_BL: Array,
    positions_BL: Array,
    perm_rank_BL: Array,
    targets_BP: Array | None,
    type_ids_BL: Array | None,
    deterministic: bool,
  ) -> tuple[Array, Array | None]:
    """The final content stream h [B, L, D] and query stream g [B, P, D]."""
    cfg = self.cfg
    if cfg.scan_layers:
      raise ValueError(
        'model.scan_layers=True is not supported by the plm family (each '
        'layer runs two streams); set it False.'
      )
    h_BLD, g_BPD = self._embed(
      ids_BL, positions_BL, type_ids_BL, targets_BP, deterministic
    )
    if targets_BP is not None:
      content_mask, query_mask = two_stream_masks(
        segment_ids_BL, perm_rank_BL, targets_BP
      )
      target_positions_BP = jnp.take_along_axis(positions_BL, targets_BP, 1)
    else:
      content_mask = transformer.attention_mask(
        segment_ids_BL, segment_ids_BL, causal=False
      )

    ctx = {
      'mask': content_mask,
      'positions': positions_BL,
      'rel_table': None,
      'encoded': None,
      'cross_mask': None,
    }
    if cfg.position == 'relative':
      # One bucket table shared by the layers and by both streams.
      ctx['rel_table'] = self.param(
        'relative_bias',
        layers.kernel_init(cfg.initializer_range, (None, 'heads')),
        (cfg.relative_buckets, cfg.num_heads),
        cfg.jnp_param_dtype,
      )

    layer_cls = transformer.layer_class(cfg)
    kwargs = dict(
      cfg=cfg,
      num_layers=cfg.num_layers,
      causal=False,
      cross_attention=False,
      deterministic=deterministic,
    )
    if cfg.share_layers:  # ALBERT: one layer's weights, num_layers times
      shared = layer_cls(**kwargs, name='shared_layer')
    for i in range(cfg.num_layers):
      if cfg.share_layers:
        layer = shared
      else:
        layer = layer_cls(**kwargs, name=f'layer_{i}')
      if g_BPD is not None:
        # g reads the content stream this layer receives, h^(i-1), as in
        # the paper's two-stream update, so g runs before h is updated.
        query_ctx = {
          **ctx,
          'mask': query_mask,
          'positions': target_positions_BP,
          'kv': h_BLD,
          'kv_positions': positions_BL,
        }
        g_BPD, _ = layer(g_BPD, query_ctx)
      h_BLD, _ = layer(h_BLD, ctx)
    if cfg.norm_position == 'pre':
      final_norm = layers.norm(cfg, 'final_norm')
      h_BLD = final_norm(h_BLD)
      if g_BPD is not None:
        g_BPD = final_norm(g_BPD)
    return h_BLD, g_BPD

  def _embed(
    self,
    ids_BL: Array,
    positions_BL: Array,
    type_ids_BL: Array | None,
    targets_BP: Array | None,
    deterministic: bool,
  ) -> tuple[Array, Array | None]:
    """Both streams' inputs: h [B, L, D] and g [B, P, D] (None without
    targets), embedded in one call, g's [MASK]s after h's tokens: the same
    tables, position and type of each target, one projection."""
    cfg = self.cfg
    B, L = ids_BL.shape
    if cfg.position == 'learned' and cfg.max_len < L:
      raise ValueError(
        f'Sequence length {L} exceeds model.max_len={cfg.max_len} (the '
        'position table); lower data.seq_len or raise model.max_len.'
      )
    if type_ids_BL is None:
      type_ids_BL = jnp.zeros_like(ids_BL)
    ids, positions, types = ids_BL, positions_BL, type_ids_BL
    if targets_BP is not None:
      P = targets_BP.shape[1]
      target_positions_BP = jnp.take_along_axis(positions_BL, targets_BP, 1)
      ids = jnp.concatenate([ids, jnp.full((B, P), MASK_ID, ids.dtype)], 1)
      positions = jnp.concatenate([positions, target_positions_BP], 1)
      types = jnp.concatenate(
        [types, jnp.take_along_axis(types, targets_BP, 1)], 1
      )
    x = self.embedder(ids, positions, types, deterministic)
    x = transformer.to_model_dim(self, x, cfg)
    h_BLD = nn.with_logical_constraint(x[:, :L], layers.BLD)
    if targets_BP is None:
      return h_BLD, None
    return h_BLD, nn.with_logical_constraint(x[:, L:], layers.BLD)


class PlmModel(nn.Module):
  """The two-stream encoder, optional pooler, and MLM's head on g.

  Returns `hidden` [B, L, D] (the content stream) always, `pooled` [B, D]
  with model.pooler, and `mlm_logits` [B, P, V] at `masked_positions` when
  the batch has them (with `perm_rank`, the objective's order).
  """

  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    # The attribute names are EncoderModel's, so the parameters are too.
    self.token_embed = layers.Embed(cfg.padded_vocab, cfg, cfg.token_dim)
    self.embeddings = transformer.Embedder(cfg, self.token_embed)
    self.encoder = TwoStreamStack(cfg, self.embeddings)
    if cfg.pooler:
      self.pooler = heads.Pooler(cfg)
    self.mlm_head = heads.MlmHead(cfg)

  def __call__(self, batch: dict[str, Array], *, deterministic: bool):
    ids = batch['input_ids']
    targets = batch.get('masked_positions')
    perm_rank = batch.get('perm_rank')
    if perm_rank is None:
      perm_rank = jnp.full(ids.shape, -1, jnp.int32)
    hidden, query = self.encoder(
      ids,
      perm_rank_BL=perm_rank,
      targets_BP=targets,
      type_ids_BL=batch.get('token_type_ids'),
      deterministic=deterministic,
      **stack_inputs(batch, pad_id=self.cfg.pad_id),
    )
    outputs = {'hidden': hidden}
    if self.cfg.pooler:
      outputs['pooled'] = self.pooler(hidden)
    if query is not None:
      # g is already at the targets: slot p of g is target p.
      outputs['mlm_logits'] = self.mlm_head(query, self.token_embed)
    return outputs

  @staticmethod
  def train_flops(cfg: ModelConfig, shapes: dict[str, tuple]) -> float:
    """Model FLOPs of one training step (see stack_flops_per_token).

    The content stream costs an encoder over L tokens, but for its last
    layer when nothing reads the final h (no sentence task): that layer
    only feeds g its keys and values, and XLA drops the rest. Per layer the
    query stream adds, for each of the P targets, its query, output and
    MLP matmuls and the score and value products over L keys, and the
    layer projects the L keys and values of h again for g (the same
    projection as the content stream's, computed twice). The MLM head runs
    at the P targets; its output product counts vocab_size columns, not
    padded_vocab (only the useful work is credited).
    """
    B, L = shapes['input_ids']
    P = shapes['masked_positions'][1] if 'masked_positions' in shapes else 0
    D, E = cfg.emb_dim, cfg.token_dim
    content_layers = cfg.num_layers
    if P and 'sentence_labels' not in shapes:
      content_layers -= 1
    content = transformer.stack_flops_per_token(cfg, content_layers, L) * L
    query_per_layer = transformer.query_layer_flops(cfg, L, P)
    projection = 6 * E * D if E != D else 0
    # Without targets (fine-tuning, features) the query stream never runs.
    query = cfg.num_layers * query_per_layer + P * projection if P else 0
    head = 6 * (D + cfg.vocab_size) * E * P
    pooler = 6 * D**2 if cfg.pooler else 0
    return float(B * (content + query + head + pooler))
