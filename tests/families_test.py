"""Decoder and encoder-decoder families, variants, attention and decoding.

Parameter counts are checked against the reference implementations; masks
against their definitions (causality by exact zero gradients, packed
documents by perturbation); cached decoding against the full forward pass.
"""

import dataclasses
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from pretrain_lm.models import (
  MODELS,
  ModelConfig,
  decoder,
  encoder_decoder,
  layers,
)
from pretrain_lm.models.config import size_preset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 64  # vocabulary of the small test models


def config_file(name: str, arg: str):
  path = os.path.join(REPO, 'configs', f'{name}.py')
  spec = importlib.util.spec_from_file_location(f'{name}_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def example_batch(family: str, B: int = 2, L: int = 16, P: int = 4):
  ids = jnp.ones((B, L), jnp.int32)
  if family == 'encoder_decoder':
    return {'encoder_input_ids': ids, 'decoder_input_ids': ids}
  if family == 'decoder':
    return {'input_ids': ids}
  return {
    'input_ids': ids,
    'masked_positions': jnp.zeros((B, P), jnp.int32),
    'masked_ids': jnp.zeros((B, P), jnp.int32),
    'masked_weights': jnp.ones((B, P)),
  }


def count(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
  'name, arg, reference, exact',
  [
    # Hugging Face model classes, counted with num_parameters().
    ('bert', 'size=base', 109_482_240, True),  # BertModel (with pooler)
    ('bert', 'size=large', 335_141_888, True),
    ('gpt', 'size=small', 124_439_808, True),  # GPT2Model, tied head
    ('t5', 'size=small', 60_506_624, True),  # t5-small
    ('t5', 'size=base', 222_903_552, True),  # t5-base
    ('t5', 'size=base,v1_1', 247_577_856, True),  # google/t5-v1_1-base
    # facebook/bart-base: its position tables have 2 extra rows (fairseq's
    # offset) that ours, indexed from 0, do not need.
    ('bart', 'size=base', 139_420_416, False),
    ('albert', 'size=base', 11_683_584, True),  # albert-base-v2 AlbertModel
    ('electra', 'size=small', 13_483_008, True),  # ElectraModel (the disc.)
  ],
)
def test_parameter_counts_match_reference_implementations(
  name, arg, reference, exact
):
  c = config_file(name, arg)
  cfg = ModelConfig.from_config(c.model)
  model = MODELS[cfg.family](cfg)
  variables = jax.eval_shape(
    lambda: model.init(
      jax.random.key(0), example_batch(cfg.family), deterministic=True
    )
  )
  params = nn.meta.unbox(variables)['params']
  # The reference classes count the body (and pooler), not the
  # pretraining heads: BERT's MLM head, ELECTRA's generator and its head.
  heads = ('mlm_head', 'generator', 'generator_head', 'discriminator_head')
  body = count({k: v for k, v in params.items() if k not in heads})
  if exact:
    assert body == reference
  assert body == pytest.approx(reference, rel=0.01)


def tiny(family='decoder', **kw) -> ModelConfig:
  base = dict(
    family=family,
    vocab_size=V,
    max_len=32,
    type_vocab_size=0,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    **size_preset('tiny'),
  )
  return ModelConfig(**{**base, **kw})


VARIANTS = {
  'gpt2': dict(norm_position='pre', embed_norm=False),
  'bert_post_ln': dict(),
  't5': dict(
    norm_type='rmsnorm',
    norm_position='pre',
    embed_norm=False,
    position='relative',
    attention_bias=False,
    mlp_bias=False,
    activation='relu',
  ),
  'rotary_swiglu': dict(position='rotary', activation='swiglu'),
  'sinusoidal_geglu_untied': dict(
    position='sinusoidal',
    embed_scale=True,
    activation='geglu',
    tie_embeddings=False,
  ),
  'scan_remat': dict(scan_layers=True, remat='full', position='relative'),
  'shared_factorised': dict(share_layers=True, embed_dim=48),
  'jax_nn_attention': dict(attention_impl='xla', position='relative'),
}


def init(cfg: ModelConfig, batch, seed=0):
  model = MODELS[cfg.family](cfg)
  variables = model.init(jax.random.key(seed), batch, deterministic=True)
  return model, nn.meta.unbox(variables)['params']


def random_ids(shape, seed=0):
  # Ids >= 5 (no special tokens), each position a distinct token where the
  # row is short enough: the gradient to a token's embedding row is then
  # the gradient to that position's input.
  rng = np.random.default_rng(seed)
  rows = [rng.permutation(np.arange(5, V))[: shape[1]] for _ in range(shape[0])]
  return np.stack(rows).astype(np.int32)


@pytest.mark.parametrize(
  'family, variant',
  [('decoder', v) for v in sorted(VARIANTS)]
  + [('encoder_decoder', v) for v in ('bert_post_ln', 't5', 'scan_remat')],
)
def test_causality_exact_zero_gradient_from_the_future(family, variant):
  kw = VARIANTS[variant]
  cfg = tiny(family, **kw)
  L, t = 12, 5
  # Both rows alike, so that no row's future token is another row's past.
  ids = np.repeat(random_ids((1, L)), 2, axis=0)
  batch = (
    {'input_ids': ids}
    if family == 'decoder'
    else {
      # Source tokens unlike any target token: their table rows do get
      # gradients, from every target position.
      'encoder_input_ids': np.tile(
        np.setdiff1d(np.arange(5, V), ids)[:L], (2, 1)
      ),
      'decoder_input_ids': ids,
    }
  )
  model, params = init(cfg, batch)
  # A vocabulary entry no input uses: its tied logit reaches the table only
  # through the hidden state.
  unused = 0

  def logit_at_t(p):
    out = model.apply({'params': p}, batch, deterministic=True)
    return out['logits'][:, t, unused].sum()

  grads = jax.grad(logit_at_t)(params)
  table = grads['token_embed']['embedding']
  past, future = ids[:, : t + 1], ids[:, t + 1 :]
  assert np.all(np.asarray(table)[future.ravel()] == 0.0)
  assert np.any(np.asarray(table)[past.ravel()] != 0.0)
  if cfg.position == 'learned':
    key = 'embeddings' if family == 'decoder' else 'decoder_embeddings'
    rows = np.asarray(grads[key]['position_embed']['embedding'])
    assert np.all(rows[t + 1 :] == 0.0) and np.any(rows[: t + 1] != 0.0)


def packed(L=16):
  """Two rows; row 0 packs documents of 6 and 7 tokens, then 3 pads."""
  segments = np.array([[1] * 6 + [2] * 7 + [0] * 3, [1] * 16], np.int32)
  positions = np.array(
    [list(range(6)) + list(range(7)) + [0] * 3, list(range(16))], np.int32
  )
  ids = np.where(segments > 0, random_ids((2, L)), 0).astype(np.int32)
  return ids, segments, positions


def family_batch(family, ids, segments, positions):
  if family == 'encoder_decoder':
    return {
      'encoder_input_ids': ids,
      'encoder_segment_ids': segments,
      'encoder_positions': positions,
      'decoder_input_ids': ids,
      'decoder_segment_ids': segments,
      'decoder_positions': positions,
    }
  batch = {'input_ids': ids, 'segment_ids': segments, 'positions': positions}
  if family == 'encoder':
    batch['masked_positions'] = np.tile(np.arange(16), (2, 1))
  return batch


@pytest.mark.parametrize('variant', ['gpt2', 't5', 'rotary_swiglu'])
@pytest.mark.parametrize('family', ['encoder', 'decoder', 'encoder_decoder'])
def test_packed_documents_do_not_see_each_other(family, variant):
  cfg = tiny(family, **VARIANTS[variant])
  ids, segments, positions = packed()
  model, params = init(cfg, family_batch(family, ids, segments, positions))
  other = ids.copy()
  other[0, 6:13] = random_ids((1, 7), 7)[0]  # rewrite document 2 only
  key = 'mlm_logits' if family == 'encoder' else 'logits'

  def run(x):
    out = model.apply(
      {'params': params},
      family_batch(family, x, segments, positions),
      deterministic=True,
    )
    return np.asarray(out[key])

  a, b = run(ids), run(other)
  np.testing.assert_allclose(a[0, :6], b[0, :6], rtol=0, atol=1e-6)
  np.testing.assert_array_equal(a[1], b[1])
  assert not np.allclose(a[0, 6:13], b[0, 6:13], atol=1e-3)
  if family == 'encoder_decoder':
    # The encoder side alone: decoder document 1 reads encoder document 1.
    enc_only = family_batch(family, other, segments, positions)
    enc_only['decoder_input_ids'] = ids
    c = np.asarray(
      model.apply({'params': params}, enc_only, deterministic=True)['logits']
    )
    np.testing.assert_allclose(a[0, :6], c[0, :6], rtol=0, atol=1e-6)
    assert not np.allclose(a[0, 6:13], c[0, 6:13], atol=1e-3)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_cached_decoding_equals_full_forward_decoder(variant):
  cfg = tiny('decoder', **VARIANTS[variant])
  ids = random_ids((2, 16))
  _, params = init(cfg, {'input_ids': ids})
  full = MODELS['decoder'](cfg).apply(
    {'params': params}, {'input_ids': ids}, deterministic=True
  )['logits']
  # Prefill 6 tokens at once (multi-token cache writes), then one by one.
  cache = decoder.prefill(cfg, params, ids[:, :6], 16)
  step = jax.jit(decoder.step_fn(cfg, params))
  got = []
  for t in range(5, 16):
    logits, cache = step(jnp.asarray(ids[:, t]), cache, t)
    got.append(logits)
  np.testing.assert_allclose(
    np.stack(got, 1), full[:, 5:], rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize('variant', ['t5', 'bert_post_ln', 'scan_remat'])
def test_cached_decoding_equals_full_forward_encoder_decoder(variant):
  cfg = tiny('encoder_decoder', **VARIANTS[variant])
  src = random_ids((2, 14), 1)
  src[1, 10:] = 0  # a padded source row
  tgt = random_ids((2, 9), 2)
  batch = {'encoder_input_ids': src, 'decoder_input_ids': tgt}
  model, params = init(cfg, batch)
  full = model.apply({'params': params}, batch, deterministic=True)['logits']
  cache = encoder_decoder.start_decoding(
    cfg, params, {'encoder_input_ids': src}, 9
  )
  step = jax.jit(encoder_decoder.step_fn(cfg, params))
  got = []
  for t in range(9):
    logits, cache = step(jnp.asarray(tgt[:, t]), cache, t)
    got.append(logits)
  np.testing.assert_allclose(np.stack(got, 1), full, rtol=1e-5, atol=1e-5)


def test_generation_runs_for_both_families():
  cfg = tiny('decoder', **VARIANTS['gpt2'])
  _, params = init(cfg, {'input_ids': random_ids((2, 8))})
  out = decoder.generate(
    cfg,
    params,
    jnp.asarray(random_ids((2, 4))),
    max_new_tokens=6,
    rng=jax.random.key(1),
    top_k=5,
  )
  assert out.shape == (2, 6)
  greedy = decoder.generate(
    cfg,
    params,
    jnp.asarray(random_ids((2, 4))),
    max_new_tokens=6,
    rng=jax.random.key(1),
    temperature=0.0,
  )
  # Greedy decoding is the argmax of the full forward pass, step by step:
  # one compiled forward over the whole row, whose logits at position t see
  # tokens 0..t only (causality is tested above), so the zeros after t are
  # never read.
  forward = jax.jit(
    lambda ids: MODELS['decoder'](cfg).apply(
      {'params': params}, {'input_ids': ids}, deterministic=True
    )['logits']
  )
  seq = np.zeros((2, 10), np.int32)
  seq[:, :4] = random_ids((2, 4))
  for t in range(4, 10):
    seq[:, t] = np.argmax(forward(seq)[:, t - 1], -1)
  np.testing.assert_array_equal(greedy, seq[:, 4:])

  cfg = tiny('encoder_decoder', **VARIANTS['t5'])
  src = random_ids((2, 10))
  _, params = init(
    cfg, {'encoder_input_ids': src, 'decoder_input_ids': src[:, :4]}
  )
  ids, scores = encoder_decoder.generate(
    cfg,
    params,
    {'encoder_input_ids': src},
    start_id=2,
    max_new_tokens=5,
    eos_id=3,
    beam_size=3,
  )
  assert ids.shape == (2, 3, 5) and scores.shape == (2, 3)
  assert np.all(np.diff(np.asarray(scores), axis=1) <= 1e-6)  # best first


def test_jax_nn_attention_path_matches_einsum():
  # The 'xla' path calls jax.nn.dot_product_attention exactly as the cuDNN
  # one does on GPU (only `implementation` differs), so this checks the
  # mask, bias and layout we hand to it.
  ids, segments, positions = packed()
  for kw in (VARIANTS['t5'], VARIANTS['gpt2']):
    cfg = tiny('decoder', **kw)
    batch = family_batch('decoder', ids, segments, positions)
    model, params = init(cfg, batch)
    fused = dataclasses.replace(cfg, attention_impl='xla')
    a = model.apply({'params': params}, batch, deterministic=True)['logits']
    b = MODELS['decoder'](fused).apply(
      {'params': params}, batch, deterministic=True
    )['logits']
    real = segments > 0
    np.testing.assert_allclose(a[real], b[real], rtol=1e-5, atol=1e-5)


def t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
  """Mesh TensorFlow's _relative_position_bucket, for one Python int."""
  ret, n = 0, -relative_position
  if bidirectional:
    num_buckets //= 2
    ret += num_buckets if n < 0 else 0
    n = abs(n)
  else:
    n = max(n, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return ret + n
  val = max_exact + int(
    math.log(n / max_exact)
    / math.log(max_distance / max_exact)
    * (num_buckets - max_exact)
  )
  return ret + min(val, num_buckets - 1)


@pytest.mark.parametrize('bidirectional', [True, False])
def test_relative_buckets_match_t5(bidirectional):
  offsets = np.arange(-300, 301)
  got = layers.relative_bucket(
    jnp.asarray(offsets),
    bidirectional=bidirectional,
    num_buckets=32,
    max_distance=128,
  )
  want = [t5_bucket(int(o), bidirectional, 32, 128) for o in offsets]
  np.testing.assert_array_equal(got, want)


def test_rotary_scores_depend_only_on_the_offset():
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 1, 1, 1, 8)).astype(np.float32)

  def score(i, j):
    qi = layers.rotary(q, jnp.array([[i]]), 10_000.0)
    kj = layers.rotary(k, jnp.array([[j]]), 10_000.0)
    return float(jnp.sum(qi * kj))

  assert score(3, 7) == pytest.approx(score(10, 14), rel=1e-5)
  assert score(3, 7) != pytest.approx(score(3, 9), rel=1e-3)
  # Position 0 is the identity rotation.
  np.testing.assert_allclose(layers.rotary(q, jnp.array([[0]]), 1e4), q)


def test_sinusoidal_matches_vaswani():
  pe = np.asarray(layers.sinusoidal(jnp.arange(50)[None], 16, jnp.float32))[0]
  pos, i = 37, 3
  angle = pos / 10_000 ** (2 * i / 16)
  assert pe[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
  assert pe[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)


def test_variant_switches_change_the_parameters_as_defined():
  batch = {'input_ids': random_ids((1, 8))}
  _, p = init(tiny(**VARIANTS['t5']), batch)
  layer = p['decoder']['layer_0']
  assert set(layer['attention_norm']) == {'scale'}  # RMSNorm: no bias
  assert (
    'query_bias' not in layer['attention'] and 'wi_bias' not in layer['mlp']
  )
  assert p['decoder']['relative_bias'].shape == (32, 2)
  _, p = init(tiny(activation='swiglu', tie_embeddings=False), batch)
  assert {'wi_0_kernel', 'wi_1_kernel'} <= set(p['decoder']['layer_0']['mlp'])
  assert p['lm_head']['logits_kernel'].shape == (128, V)
  _, p = init(tiny(scan_layers=True), batch)
  assert p['decoder']['layers']['mlp']['wi_kernel'].shape == (2, 128, 512)
  _, p = init(tiny(share_layers=True, embed_dim=32), batch)
  assert p['decoder']['shared_layer']['mlp']['wi_kernel'].shape == (128, 512)
  assert p['token_embed']['embedding'].shape == (V, 32)
  assert p['decoder']['embed_projection_kernel'].shape == (32, 128)


def test_gpt2_residual_projections_are_scaled_at_init():
  cfg = tiny(num_layers=8, scaled_residual_init=True)
  _, p = init(cfg, {'input_ids': random_ids((1, 8))})
  layer = p['decoder']['layer_3']
  want = 0.02 / math.sqrt(2 * 8)
  # A truncated normal at +-2 std has std 0.88 x its scale.
  for w in (layer['attention']['out_kernel'], layer['mlp']['wo_kernel']):
    assert np.std(w) == pytest.approx(0.88 * want, rel=0.1)
  assert np.std(layer['mlp']['wi_kernel']) == pytest.approx(
    0.88 * 0.02, rel=0.1
  )


def test_electra_discriminator_sees_generator_samples_without_gradient():
  cfg = tiny('electra', type_vocab_size=2, embed_dim=32, generator_width=0.5)
  ids = random_ids((2, 16))
  positions = np.array([[1, 4, 7, 0], [2, 3, 9, 11]], np.int32)
  weights = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
  originals = np.take_along_axis(ids, positions, 1) * (weights > 0)
  masked = ids.copy()
  for b in range(2):
    masked[b, positions[b][weights[b] > 0]] = 4  # [MASK]
  batch = {
    'input_ids': masked,
    'masked_positions': positions,
    'masked_ids': originals.astype(np.int32),
    'masked_weights': weights,
  }
  model, params = init(cfg, batch)
  out = model.apply(
    {'params': params},
    batch,
    deterministic=False,
    rngs={'dropout': jax.random.key(3)},
  )
  labels = np.asarray(out['disc_labels'])
  # Only masked positions can be replaced.
  chosen = np.zeros_like(labels)
  for b in range(2):
    chosen[b, positions[b][weights[b] > 0]] = 1
  assert np.all(labels[chosen == 0] == 0) and labels.sum() > 0
  assert params['generator']['layer_0']['mlp']['wi_kernel'].shape == (64, 256)


@pytest.mark.parametrize('family', ['decoder', 'encoder_decoder'])
def test_chunked_logits_give_the_full_logits_loss_and_gradient(family):
  # model.logits_chunk computes the vocabulary projection and cross-entropy
  # 6 positions at a time (20 is not a multiple: the last chunk is padded);
  # the loss, accuracy, parameters and gradients must be the full ones.
  from pretrain_lm.objectives import clm

  rng = np.random.default_rng(0)
  B, L = 3, 20
  batch = {
    'target_ids': rng.integers(0, V, (B, L)).astype(np.int32),
    'target_weights': (rng.random((B, L)) > 0.2).astype(np.float32),
  }
  if family == 'decoder':
    batch['input_ids'] = rng.integers(0, V, (B, L)).astype(np.int32)
  else:
    batch['encoder_input_ids'] = rng.integers(1, V, (B, 12)).astype(np.int32)
    batch['decoder_input_ids'] = rng.integers(0, V, (B, L)).astype(np.int32)
  results = []
  for chunk in (0, 6):
    cfg = ModelConfig(
      family=family,
      vocab_size=V,
      num_layers=2,
      emb_dim=32,
      num_heads=2,
      head_dim=16,
      mlp_dim=64,
      max_len=64,
      # Untied for the encoder-decoder: its own logits kernel, inside the
      # scanned chunks, must be the same parameter.
      tie_embeddings=family == 'decoder',
      logits_chunk=chunk,
      dropout_rate=0.0,
      attention_dropout_rate=0.0,
    )
    model = MODELS[family](cfg)
    params = nn.meta.unbox(
      model.init(jax.random.key(0), batch, deterministic=True)
    )['params']
    # Evaluation and decoding (deterministic) always get the logits.
    evaluated = model.apply({'params': params}, batch, deterministic=True)
    assert evaluated['logits'].shape == (B, L, V)

    def loss(p, model=model, chunk=chunk):
      # Training mode; dropout is 0 so that the two runs compare exactly.
      outputs = model.apply(
        {'params': p},
        batch,
        deterministic=False,
        rngs={'dropout': jax.random.key(1)},
      )
      assert ('logits' in outputs) == (chunk == 0)
      return clm.loss(outputs, batch)

    results.append((params, *jax.value_and_grad(loss, has_aux=True)(params)))
  (p0, (l0, m0), g0), (p1, (l1, m1), g1) = results
  assert jax.tree.structure(p0) == jax.tree.structure(p1)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  np.testing.assert_allclose(m1['accuracy'], m0['accuracy'])
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)
