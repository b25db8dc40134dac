"""The decoder family (GPT): a causal stack with next-token logits.

`DecoderModel(cfg, decode=True)` keeps a key/value cache for incremental
decoding; `generate` runs pretrain_lm.models.decoding on it.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models import decoding, heads, layers, transformer
from pretrain_lm.models.config import ModelConfig
from pretrain_lm.models.encoder import stack_inputs

Array = jax.Array


def decoder_inputs(batch: dict[str, Array], prefix: str = '') -> dict:
  """Segment ids and positions of a causal stack's input.

  Without packing information a row is one document: trailing [PAD]s are
  only ever attended to by later [PAD]s (causal), so no padding mask is
  needed, and positions count from 0 (or are given, when decoding).
  """
  if f'{prefix}segment_ids' in batch:
    return stack_inputs(batch, prefix)
  ids = batch[f'{prefix}input_ids']
  positions = batch.get(f'{prefix}positions')
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return {'segment_ids_BL': jnp.ones_like(ids), 'positions_BL': positions}


class DecoderModel(nn.Module):
  """Causal Transformer: `logits` [B, L, V] for the token after each one.

  In training (not deterministic) with model.logits_chunk and `target_ids`
  in the batch, the logits are replaced by their per-token cross-entropy
  against the targets (heads.chunked_target_xent), computed a chunk of
  positions at a time; evaluation and decoding always get the logits.

  With `decode`, a call takes new tokens `input_ids` [B, T] at `positions`
  [B, T] (the same start in every row), appends their keys and values to
  the 'cache' collection and returns their logits. A training batch may
  carry `prefix_mask` int32[B, L] (prefix LM, UL2): tokens marked 1 attend
  to each other bidirectionally within their document. With
  `collect_states`, also `layer_states` [N + 1, B, L, D] (the embedding
  output and every layer's output).
  """

  cfg: ModelConfig
  decode: bool = False
  collect_states: bool = False

  def setup(self):
    cfg = self.cfg
    self.token_embed = layers.Embed(cfg.padded_vocab, cfg, cfg.token_dim)
    self.embeddings = transformer.Embedder(cfg, self.token_embed)
    self.decoder = transformer.Stack(
      cfg,
      self.embeddings,
      cfg.num_layers,
      causal=True,
      decode=self.decode,
      collect_states=self.collect_states,
    )
    self.lm_head = heads.LmHead(cfg)

  def __call__(self, batch: dict[str, Array], *, deterministic: bool):
    ids = batch['input_ids']
    inputs = decoder_inputs(batch)
    hidden = self.decoder(
      ids,
      type_ids_BL=None,
      deterministic=deterministic,
      prefix_BL=batch.get('prefix_mask'),
      **inputs,
    )
    outputs = {}
    if self.collect_states:
      hidden, outputs['layer_states'] = hidden
    outputs['hidden'] = hidden
    if self.cfg.logits_chunk and not deterministic and 'target_ids' in batch:
      outputs.update(
        heads.chunked_target_xent(
          self, hidden, batch['target_ids'], self.cfg.logits_chunk
        )
      )
    else:
      outputs['logits'] = self.lm_head(hidden, self.token_embed)
    return outputs

  @staticmethod
  def train_flops(cfg: ModelConfig, shapes: dict[str, tuple]) -> float:
    """Model FLOPs of one step: the stack plus the D x V logits per token.

    A prefix LM's batch (prefix_mask) attends over the whole L x L square.
    V is model.vocab_size, not padded_vocab: only the useful columns of
    the output product are credited.
    """
    B, L = shapes['input_ids']
    per_token = transformer.stack_flops_per_token(
      cfg, cfg.num_layers, L, causal='prefix_mask' not in shapes
    )
    per_token += 6 * cfg.token_dim * cfg.vocab_size
    if cfg.token_dim != cfg.emb_dim:
      per_token += 6 * cfg.emb_dim * cfg.token_dim
    return float(B * L * per_token)


def init_cache(cfg: ModelConfig, batch_size: int, length: int):
  """An empty key/value cache for `length` positions (zeros)."""
  model = DecoderModel(cfg, decode=True)
  ids = jnp.zeros((batch_size, length), jnp.int32)
  variables = jax.eval_shape(
    lambda: model.init(
      jax.random.key(0), {'input_ids': ids}, deterministic=True
    )
  )
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables['cache'])


def step_fn(cfg: ModelConfig, params):
  """The decoding.StepFn of a decoder: one token per row, cache updated."""
  model = DecoderModel(cfg, decode=True)

  def step(ids_N, cache, index):
    positions = jnp.full((ids_N.shape[0], 1), index, jnp.int32)
    outputs, mutated = model.apply(
      {'params': params, 'cache': cache},
      {'input_ids': ids_N[:, None], 'positions': positions},
      deterministic=True,
      mutable=['cache'],
    )
    return outputs['logits'][:, -1], mutated['cache']

  return step


def prefill(cfg: ModelConfig, params, prompt_BT: Array, length: int):
  """Runs the prompt but its last token through a fresh cache of `length`.

  Returns the cache; decoding continues by feeding prompt_BT[:, -1] at
  index T - 1.
  """
  cache = init_cache(cfg, prompt_BT.shape[0], length)
  T = prompt_BT.shape[1]
  if T == 1:
    return cache
  model = DecoderModel(cfg, decode=True)
  positions = jnp.broadcast_to(jnp.arange(T - 1), (prompt_BT.shape[0], T - 1))
  _, mutated = model.apply(
    {'params': params, 'cache': cache},
    {'input_ids': prompt_BT[:, :-1], 'positions': positions},
    deterministic=True,
    mutable=['cache'],
  )
  return mutated['cache']


def generate(
  cfg: ModelConfig,
  params,
  prompt_BT: Array,
  *,
  max_new_tokens: int,
  rng: Array,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  eos_id: int | None = None,
) -> Array:
  """Samples max_new_tokens after the prompt: [B, max_new_tokens]."""
  T = prompt_BT.shape[1]
  length = T + max_new_tokens
  if cfg.position == 'learned' and length > cfg.max_len:
    raise ValueError(
      f'Prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds '
      f'model.max_len={cfg.max_len}.'
    )
  cache = prefill(cfg, params, prompt_BT, length)
  return decoding.sample(
    step_fn(cfg, params),
    cache,
    prompt_BT[:, -1],
    T - 1,
    num_steps=max_new_tokens,
    rng=rng,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    eos_id=eos_id,
  )
