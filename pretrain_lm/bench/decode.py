"""Decoding speed: KV-cached generation against recomputing every prefix.

For each batch size, a randomly initialised decoder of the config's shape
generates `length - 1` tokens greedily after a one-token prompt, with the
key/value cache (models.decoder.generate, one jitted while_loop). The
alternative without a cache runs the whole forward pass over the `length`
tokens for each new token; its cost per token is one such forward, timed
on its own. Weights do not change the speed, so no checkpoint is needed.
"""

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import linen as nn

from pretrain_lm.bench import timing
from pretrain_lm.models import decoder
from pretrain_lm.models.config import ModelConfig


def init_params(cfg: ModelConfig, length: int):
  """Random decoder parameters (the training initialisation)."""
  model = decoder.DecoderModel(cfg)
  ids = jnp.zeros((1, length), jnp.int32)
  init = jax.jit(
    lambda key: model.init(key, {'input_ids': ids}, deterministic=True)
  )
  return nn.meta.unbox(init(jax.random.key(0)))['params']


def bench_decode(
  config: ml_collections.ConfigDict,
  *,
  batch_sizes: tuple[int, ...],
  length: int,
  repeats: int,
) -> dict[str, Any]:
  """Cached and full-recompute decoding speed per batch size."""
  if config.model.family != 'decoder':
    raise ValueError(
      f'--what=decode times a decoder; model.family is '
      f'{config.model.family!r} (use e.g. configs/gpt.py).'
    )
  cfg = ModelConfig.from_config(config.model)
  if cfg.position == 'learned' and length > cfg.max_len:
    raise ValueError(
      f'--decode_length={length} exceeds model.max_len={cfg.max_len}.'
    )
  params = init_params(cfg, length)
  model = decoder.DecoderModel(cfg)

  @jax.jit
  def generate(params, prompt_B1):
    return decoder.generate(
      cfg,
      params,
      prompt_B1,
      max_new_tokens=length - 1,
      rng=jax.random.key(0),
      temperature=0.0,
    )

  @jax.jit
  def next_token_logits(params, ids_BL):
    outputs = model.apply(
      {'params': params}, {'input_ids': ids_BL}, deterministic=True
    )
    return outputs['logits'][:, -1]

  out = {'length': length}
  for B in batch_sizes:
    prompt = jnp.ones((B, 1), jnp.int32)
    ids = jnp.ones((B, length), jnp.int32)
    # Compiled ahead, so that every timed run is a real one.
    start = time.perf_counter()
    generate_c = generate.lower(params, prompt).compile()
    forward_c = next_token_logits.lower(params, ids).compile()
    compile_s = time.perf_counter() - start
    cached_s = statistics.median(
      timing.call_seconds(generate_c, params, prompt, repeats=repeats, warmup=0)
    )
    full_s = statistics.median(
      timing.call_seconds(forward_c, params, ids, repeats=repeats, warmup=0)
    )
    per_token_s = cached_s / (length - 1)
    out[f'batch{B}'] = {
      'cached_tokens_per_s': B * (length - 1) / cached_s,
      'cached_s_per_step': per_token_s,
      'full_forward_s': full_s,
      'full_recompute_tokens_per_s': B / full_s,
      'cache_speedup': full_s / per_token_s,
      'compile_s': compile_s,
    }
  return out
