"""The encoder-decoder family (T5, BART): a bidirectional encoder and a
causal decoder with cross-attention, sharing one token table.

Features: encoder_input_ids [B, S] and decoder_input_ids [B, L] (the
targets shifted right), each optionally with packed `*_segment_ids` and
`*_positions`; decoder segment k attends only to encoder segment k.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models import decoding, heads, layers, transformer
from pretrain_lm.models.config import ModelConfig
from pretrain_lm.models.decoder import decoder_inputs
from pretrain_lm.models.encoder import stack_inputs

Array = jax.Array


class EncoderDecoderModel(nn.Module):
  """Returns `encoded` [B, S, D], `hidden` [B, L, D], `logits` [B, L, V].

  With `decode`, the decoder keeps a self-attention key/value cache: call
  `decode_logits` with new decoder tokens at given positions (see
  pretrain_lm.models.decoder.DecoderModel). With `collect_states`, also
  `encoder_layer_states` [N + 1, B, S, D] and `layer_states` [N + 1, B, L,
  D] (each stack's embedding output and every layer's output).
  """

  cfg: ModelConfig
  decode: bool = False
  collect_states: bool = False

  def setup(self):
    cfg = self.cfg
    self.token_embed = layers.Embed(cfg.padded_vocab, cfg, cfg.token_dim)
    # Each stack has its own position table and embedding norm (BART).
    self.encoder_embeddings = transformer.Embedder(cfg, self.token_embed)
    self.decoder_embeddings = transformer.Embedder(cfg, self.token_embed)
    self.encoder = transformer.Stack(
      cfg,
      self.encoder_embeddings,
      cfg.num_layers,
      causal=False,
      collect_states=self.collect_states,
    )
    self.decoder = transformer.Stack(
      cfg,
      self.decoder_embeddings,
      cfg.decoder_layers,
      causal=True,
      cross_attention=True,
      decode=self.decode,
      collect_states=self.collect_states,
    )
    self.lm_head = heads.LmHead(cfg)

  def encode(self, batch: dict[str, Array], *, deterministic: bool):
    """The encoder's output [B, S, D] and its segment ids [B, S].

    With collect_states the output is a pair (output, layer states).
    """
    inputs = stack_inputs(batch, 'encoder_', self.cfg.pad_id)
    encoded = self.encoder(
      batch['encoder_input_ids'], deterministic=deterministic, **inputs
    )
    return encoded, inputs['segment_ids_BL']

  def decode_logits(
    self,
    batch: dict[str, Array],
    encoded_BSD: Array,
    encoder_segment_ids_BS: Array,
    *,
    deterministic: bool,
  ):
    """The decoder's hidden states and logits given the encoder's output.

    With collect_states the hidden states are a pair (output, layer states).
    """
    hidden = self.decoder(
      batch['decoder_input_ids'],
      deterministic=deterministic,
      encoded_BSD=encoded_BSD,
      encoder_segment_ids_BS=encoder_segment_ids_BS,
      **decoder_inputs(batch, 'decoder_'),
    )
    if self.cfg.logits_chunk and not deterministic and 'target_ids' in batch:
      return hidden, None  # training: __call__ computes the loss's terms
    final = hidden[0] if self.collect_states else hidden
    return hidden, self.lm_head(final, self.token_embed)

  def __call__(self, batch: dict[str, Array], *, deterministic: bool):
    encoded, segments = self.encode(batch, deterministic=deterministic)
    outputs = {}
    if self.collect_states:
      encoded, outputs['encoder_layer_states'] = encoded
    hidden, logits = self.decode_logits(
      batch, encoded, segments, deterministic=deterministic
    )
    if self.collect_states:
      hidden, outputs['layer_states'] = hidden
    outputs.update(encoded=encoded, hidden=hidden)
    if logits is None:  # model.logits_chunk: the loss's terms instead
      outputs.update(
        heads.chunked_target_xent(
          self, hidden, batch['target_ids'], self.cfg.logits_chunk
        )
      )
    else:
      outputs['logits'] = logits
    return outputs

  @staticmethod
  def train_flops(cfg: ModelConfig, shapes: dict[str, tuple]) -> float:
    """Model FLOPs of one step: both stacks and the decoder's logits.

    Each decoder layer's cross-attention projects keys and values at the
    S encoder positions, whatever the decoder's length L. The logits count
    model.vocab_size columns, not padded_vocab: only the useful work is
    credited.
    """
    B, S = shapes['encoder_input_ids']
    L = shapes['decoder_input_ids'][1]
    encoder = transformer.stack_flops_per_token(cfg, cfg.num_layers, S) * S
    encoder += transformer.kv_flops(cfg, cfg.decoder_layers) * S
    per_token = transformer.stack_flops_per_token(
      cfg, cfg.decoder_layers, L, cross_len=S, causal=True
    )
    per_token += 6 * cfg.token_dim * cfg.vocab_size
    if cfg.token_dim != cfg.emb_dim:
      per_token += 6 * cfg.emb_dim * cfg.token_dim
    return float(B * (encoder + L * per_token))


def start_decoding(
  cfg: ModelConfig, params, encoder_batch: dict[str, Array], length: int
):
  """Encodes once; returns the decoding cache for `length` target tokens.

  The cache holds the decoder's keys/values and the encoder output, so
  beam search repeats and reorders both together.
  """
  model = EncoderDecoderModel(cfg, decode=True)
  encoded, segments = model.apply(
    {'params': params},
    encoder_batch,
    deterministic=True,
    method=EncoderDecoderModel.encode,
  )
  B = encoded.shape[0]
  dummy = {'decoder_input_ids': jnp.zeros((B, length), jnp.int32)}
  shapes = jax.eval_shape(
    lambda: model.init(
      jax.random.key(0),
      dummy,
      encoded,
      segments,
      deterministic=True,
      method=EncoderDecoderModel.decode_logits,
    )
  )['cache']
  kv = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return {'decoder': kv, 'encoded': encoded, 'encoder_segment_ids': segments}


def step_fn(cfg: ModelConfig, params):
  """The decoding.StepFn of an encoder-decoder (cache from start_decoding)."""
  model = EncoderDecoderModel(cfg, decode=True)

  def step(ids_N, cache, index):
    batch = {
      'decoder_input_ids': ids_N[:, None],
      'decoder_positions': jnp.full((ids_N.shape[0], 1), index, jnp.int32),
    }
    (_, logits), mutated = model.apply(
      {'params': params, 'cache': cache['decoder']},
      batch,
      cache['encoded'],
      cache['encoder_segment_ids'],
      deterministic=True,
      method=EncoderDecoderModel.decode_logits,
      mutable=['cache'],
    )
    return logits[:, -1], dict(cache, decoder=mutated['cache'])

  return step


def generate(
  cfg: ModelConfig,
  params,
  encoder_batch: dict[str, Array],
  *,
  start_id: int,
  max_new_tokens: int,
  eos_id: int,
  beam_size: int = 0,
  alpha: float = 0.6,
  rng: Array | None = None,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
):
  """Beam search (beam_size > 0: ids [B, beam, T], scores) or sampling."""
  cache = start_decoding(cfg, params, encoder_batch, max_new_tokens)
  B = cache['encoded'].shape[0]
  first = jnp.full((B,), start_id, jnp.int32)
  if beam_size:
    return decoding.beam_search(
      step_fn(cfg, params),
      cache,
      first,
      0,
      num_steps=max_new_tokens,
      beam_size=beam_size,
      eos_id=eos_id,
      alpha=alpha,
    )
  return decoding.sample(
    step_fn(cfg, params),
    cache,
    first,
    0,
    num_steps=max_new_tokens,
    rng=jax.random.key(0) if rng is None else rng,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    eos_id=eos_id,
  )
