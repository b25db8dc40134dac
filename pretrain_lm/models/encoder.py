"""The encoder family (BERT, RoBERTa, ALBERT): bidirectional + MLM head."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models import heads, layers, transformer
from pretrain_lm.models.config import ModelConfig

Array = jax.Array


def stack_inputs(
  batch: dict[str, Array], prefix: str = '', pad_id: int = 0
) -> dict:
  """Segment ids and positions of a stack's input, defaulted if absent.

  Packed rows carry `segment_ids` (1, 2, ... per document, 0 on padding)
  and `positions` (restarting per document); without them a row is one
  document, padded where input_mask is 0 (or, without one, where the id is
  model.pad_id).
  """
  ids = batch[f'{prefix}input_ids']
  segments = batch.get(f'{prefix}segment_ids')
  if segments is None:
    segments = batch.get(f'{prefix}input_mask', ids != pad_id)
    segments = segments.astype(jnp.int32)
  positions = batch.get(f'{prefix}positions')
  if positions is None:
    positions = transformer.default_positions(segments)
  return {'segment_ids_BL': segments, 'positions_BL': positions}


class EncoderModel(nn.Module):
  """Encoder body, optional pooler, and the MLM head tied to the tokens.

  Takes a feature dict from the objective's tf.data transform and returns a
  dict: `hidden` [B, L, D], `pooled` [B, D] with model.pooler,
  `mlm_logits` [B, P, V] when the batch has `masked_positions`, and
  `sentence_logits` [B, 2] (NSP/SOP) when it has `sentence_labels`. With
  `collect_states`, also `layer_states` [N + 1, B, L, D]: the embedding
  output and every layer's output (feature extraction, ELMo's scalar mix).

  A batch with `masked_positions` (pretraining, fill-mask, scoring) runs
  the last layer only where the heads read it: the P predicted positions,
  and [CLS] when the batch has `sentence_labels` (transformer.Stack). Its
  outputs then have no `hidden`, and `pooled` only with sentence labels.

  `direction` 'forward' / 'backward' lets each token attend only to itself
  and the tokens before / after it (cross-view training's restricted
  views, pretrain_lm.finetune.model).
  """

  cfg: ModelConfig
  collect_states: bool = False

  def setup(self):
    cfg = self.cfg
    self.token_embed = layers.Embed(cfg.padded_vocab, cfg, cfg.token_dim)
    self.embeddings = transformer.Embedder(cfg, self.token_embed)
    self.encoder = transformer.Stack(
      cfg,
      self.embeddings,
      cfg.num_layers,
      causal=False,
      collect_states=self.collect_states,
    )
    if cfg.pooler:
      self.pooler = heads.Pooler(cfg)
      # Its parameters exist only in runs whose batches ask for it.
      self.sentence_head = heads.SentenceHead(cfg)
    self.mlm_head = heads.MlmHead(cfg)

  def __call__(
    self,
    batch: dict[str, Array],
    *,
    deterministic: bool,
    direction: str = 'both',
  ):
    cfg = self.cfg
    predicted_BP = batch.get('masked_positions')
    sentence_task = cfg.pooler and 'sentence_labels' in batch
    read_BP = None  # the positions the heads read, if only those run
    if predicted_BP is not None and not self.collect_states:
      read_BP = predicted_BP
      if sentence_task:  # [CLS] first, where the pooler reads it
        cls_B1 = jnp.zeros_like(predicted_BP[:, :1])
        read_BP = jnp.concatenate([cls_B1, predicted_BP], axis=1)
    hidden = self.encoder(
      batch['input_ids'],
      type_ids_BL=batch.get('token_type_ids'),
      deterministic=deterministic,
      output_positions_BP=read_BP,
      direction=direction,
      **stack_inputs(batch, pad_id=cfg.pad_id),
    )
    outputs = {}
    if self.collect_states:
      hidden, outputs['layer_states'] = hidden
    if read_BP is None:
      outputs['hidden'] = hidden
    if cfg.pooler and (read_BP is None or sentence_task):
      outputs['pooled'] = self.pooler(hidden)  # reads hidden[:, 0]
      if sentence_task:
        outputs['sentence_logits'] = self.sentence_head(outputs['pooled'])
    elif cfg.pooler and self.is_initializing():
      self.pooler(hidden)  # its parameters, for fine-tuning to start from
    if predicted_BP is not None:
      if read_BP is None:
        predicted_BPD = transformer.rows_at(hidden, predicted_BP)
      else:
        predicted_BPD = hidden[:, 1:] if sentence_task else hidden
      outputs['mlm_logits'] = self.mlm_head(predicted_BPD, self.token_embed)
    return outputs

  @staticmethod
  def train_flops(cfg: ModelConfig, shapes: dict[str, tuple]) -> float:
    """Model FLOPs of one training step (see stack_flops_per_token).

    The MLM head (D x E transform + E x V output) runs only at the P
    predicted positions of each row, and so does the last layer (plus
    [CLS] with a sentence task). The output product counts vocab_size
    columns, not padded_vocab: only the useful work is credited.
    """
    B, L = shapes['input_ids']
    P = shapes['masked_positions'][1] if 'masked_positions' in shapes else 0
    sentence_task = cfg.pooler and 'sentence_labels' in shapes
    read = P + 1 if P and sentence_task else P
    body = transformer.stack_flops_per_row(cfg, cfg.num_layers, L, read)
    head = 6 * (cfg.emb_dim + cfg.vocab_size) * cfg.token_dim * P
    pooler = 0
    if cfg.pooler and (not P or sentence_task):
      pooler = 6 * cfg.emb_dim**2
    if sentence_task:
      pooler += 6 * cfg.emb_dim * 2
    return float(B * (body + head + pooler))
