"""The encoder and its MLM head against reference counts and definitions."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from pretrain_lm.models import MODELS, ModelConfig, layers, transformer
from pretrain_lm.models.config import size_preset


def bert(size: str, **kw) -> ModelConfig:
  return ModelConfig(**{'vocab_size': 30522, **size_preset(size), **kw})


def abstract_params(cfg: ModelConfig, seq_len: int = 128, preds: int = 20):
  batch = {
    'input_ids': jnp.zeros((2, seq_len), jnp.int32),
    'masked_positions': jnp.zeros((2, preds), jnp.int32),
  }
  model = MODELS['encoder'](cfg)
  variables = jax.eval_shape(
    lambda: model.init(jax.random.key(0), batch, deterministic=True)
  )
  return nn.meta.unbox(variables)['params']


def count(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
  'size, reference',
  [
    # Hugging Face BertForMaskedLM (bert-base/large-uncased): body without
    # pooler + MLM head (transform, LayerNorm, output bias; tied decoder);
    # plus BERT's pooler (D x D + D), which BertForMaskedLM leaves out.
    ('base', 109_514_298 + 768 * 769),
    ('large', 335_174_458 + 1024 * 1025),
  ],
)
def test_parameter_count_matches_bert(size, reference):
  assert count(abstract_params(bert(size, pooler=True))) == reference


def test_flops_formula_counts_every_matmul_weight():
  cfg = bert('base')
  params = abstract_params(cfg)
  layer = params['encoder']['layer_0']
  weights = sum(
    x.size
    for path, x in jax.tree_util.tree_leaves_with_path(layer)
    if 'kernel' in jax.tree_util.keystr(path)
  )
  kv_weights = (
    layer['attention']['key_kernel'].size
    + layer['attention']['value_kernel'].size
  )
  head_weights = (
    params['mlm_head']['transform_kernel'].size
    + params['token_embed']['embedding'].size
  )
  batch, seq_len, preds = 2, 128, 20
  attention = 12 * seq_len * cfg.num_heads * cfg.head_dim  # per query
  below = (cfg.num_layers - 1) * (6 * weights + attention) * seq_len
  # The last layer's keys and values at every position, the rest of it
  # (and the head) only at the predicted ones.
  last = (
    6 * kv_weights * seq_len + (6 * (weights - kv_weights) + attention) * preds
  )
  per_row = below + last + 6 * head_weights * preds
  shapes = {'input_ids': (batch, seq_len), 'masked_positions': (batch, preds)}
  got = MODELS['encoder'].train_flops(cfg, shapes)
  assert got == pytest.approx(batch * per_row, rel=1e-6)
  # The familiar rule of thumb: ~6 FLOPs per non-embedding weight per token.
  assert got / (batch * seq_len) == pytest.approx(6 * 85e6, rel=0.1)
  # Without predictions every layer runs at every position.
  full = MODELS['encoder'].train_flops(cfg, {'input_ids': (batch, seq_len)})
  per_token = cfg.num_layers * (6 * weights + attention)
  assert full == pytest.approx(batch * seq_len * per_token, rel=1e-6)


def test_pre_ln_normalises_at_the_end():
  post = abstract_params(bert('tiny'))
  pre = abstract_params(bert('tiny', norm_position='pre', embed_norm=False))
  assert 'final_norm' not in post['encoder']
  assert 'embed_norm' in post['embeddings']
  assert 'final_norm' in pre['encoder']
  assert 'embed_norm' not in pre['embeddings']


def small_model_and_batch(seed=0, **kw):
  cfg = dataclasses.replace(
    bert('tiny', vocab_size=97, max_len=32, **kw),
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
  )
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, 97, (3, 16)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[1, 10:] = 0
  ids[1, 10:] = 0
  batch = {
    'input_ids': ids,
    'token_type_ids': np.zeros_like(ids),
    'input_mask': mask,
    'masked_positions': np.array([[1, 4, 0], [2, 9, 0], [0, 5, 15]], np.int32),
  }
  model = MODELS['encoder'](cfg)
  params = model.init(jax.random.key(seed), batch, deterministic=True)
  return model, nn.meta.unbox(params), batch


def test_mlm_logits_are_the_full_logits_at_the_masked_positions():
  model, params, batch = small_model_and_batch()
  out = model.apply(params, batch, deterministic=True)
  assert out['mlm_logits'].shape == (3, 3, 97)
  every = dict(batch, masked_positions=np.tile(np.arange(16), (3, 1)))
  full = model.apply(params, every, deterministic=True)['mlm_logits']
  want = np.take_along_axis(
    np.asarray(full), batch['masked_positions'][..., None], axis=1
  )
  np.testing.assert_allclose(out['mlm_logits'], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  'variant',
  [
    {},  # BERT: post-LN, learned positions
    dict(norm_position='pre', embed_norm=False, position='rotary'),
    dict(norm_position='pre', embed_norm=False, position='relative'),
    dict(share_layers=True),  # ALBERT: the shared weights once more, apart
    dict(share_layers=True, num_layers=1),  # no scan: the layer alone
    dict(scan_layers=True),  # the stacked weights: N - 1 scanned, the last
    dict(scan_layers=True, num_layers=1, remat='full'),  # the last alone
  ],
)
def test_last_layer_at_the_predictions_is_the_full_layer_gathered(variant):
  model, params, batch = small_model_and_batch(pooler=True, **variant)
  # Row 0 packs two documents; NSP labels make the pooler read [CLS].
  segments = (batch['input_mask'] > 0).astype(np.int32)
  segments[0, 7:] = 2
  positions = np.tile(np.arange(16), (3, 1))
  positions[0, 7:] -= 7
  batch = dict(
    batch,
    segment_ids=segments,
    positions=positions,
    # Row 0 predicts in both of its documents.
    masked_positions=np.array([[1, 9, 0], [2, 9, 0], [0, 5, 15]], np.int32),
    masked_weights=np.ones((3, 3), np.float32),
    sentence_labels=np.array([0, 1, 1], np.int32),
  )
  params = nn.meta.unbox(
    model.init(jax.random.key(0), batch, deterministic=True)
  )
  # collect_states runs every layer at every position, then gathers.
  full_model = MODELS['encoder'](model.cfg, collect_states=True)

  def loss_and_outputs(m, p):
    out = m.apply(p, batch, deterministic=True)
    mlm = jax.nn.log_softmax(out['mlm_logits'])[..., 5].sum()
    nsp = jax.nn.log_softmax(out['sentence_logits'])[:, 0].sum()
    return mlm + nsp, out

  grad = jax.grad(loss_and_outputs, argnums=1, has_aux=True)
  got_grads, got = grad(model, params)
  want_grads, want = grad(full_model, params)
  assert 'hidden' not in got and 'hidden' in want
  for key in ('mlm_logits', 'sentence_logits', 'pooled'):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5)
  # A weight's gradient is a sum over positions, and the last layer's
  # matmuls over 4 rows and over 48 round apart: up to 3.1e-6 on an entry
  # of 4e-3 here. A wrong row would be off by far more.
  jax.tree.map(
    lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5),
    got_grads,
    want_grads,
  )

  # The last layer's MLP really ran at the 3 + 1 read positions only.
  def mlp_shapes(m):
    apply = functools.partial(m.apply, deterministic=True)
    text = str(jax.make_jaxpr(apply)(params, batch))
    return [f'f32[3,{n},{m.cfg.mlp_dim}]' in text for n in (4, 16)]

  # (A one-layer stack has no layer at every position.)
  assert mlp_shapes(model) == [True, model.cfg.num_layers > 1]
  assert mlp_shapes(full_model) == [False, True]


def bare_stack(cfg: ModelConfig, **kwargs) -> transformer.Stack:
  """A Stack over its own token embedding, as the models build one."""
  token_embed = layers.Embed(cfg.vocab_size, cfg, cfg.token_dim)
  return transformer.Stack(
    cfg, transformer.Embedder(cfg, token_embed), cfg.num_layers, **kwargs
  )


def test_a_decoder_stack_at_some_positions_reads_its_cross_mask_rows():
  # A causal stack with cross-attention (T5's and BART's decoder) on
  # packed rows: each query's row of the cross mask must follow it.
  cfg = dataclasses.replace(
    bert('tiny', vocab_size=97, max_len=32, norm_position='pre'),
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
  )
  rng = np.random.default_rng(0)
  B, L, S = 2, 12, 10
  ids = rng.integers(5, 97, (B, L)).astype(np.int32)
  segments = np.ones((B, L), np.int32)
  segments[0, 5:] = 2  # row 0 packs two targets
  positions = np.tile(np.arange(L), (B, 1))
  positions[0, 5:] -= 5
  encoder_segments = np.ones((B, S), np.int32)
  encoder_segments[0, 4:] = 2  # and their two inputs
  encoded = rng.normal(size=(B, S, cfg.emb_dim)).astype(np.float32)
  out_BP = np.array([[1, 6, 11], [0, 3, 7]], np.int32)

  stack = bare_stack(cfg, causal=True, cross_attention=True)
  kwargs = dict(
    segment_ids_BL=segments,
    positions_BL=positions,
    deterministic=True,
    encoded_BSD=encoded,
    encoder_segment_ids_BS=encoder_segments,
  )
  params = nn.meta.unbox(stack.init(jax.random.key(0), ids, **kwargs))

  def at_positions(p, enc):
    args = dict(kwargs, encoded_BSD=enc, output_positions_BP=out_BP)
    return stack.apply(p, ids, **args)

  def gathered(p, enc):
    full = stack.apply(p, ids, **dict(kwargs, encoded_BSD=enc))
    return jnp.take_along_axis(full, out_BP[..., None], axis=1)

  got, want = at_positions(params, encoded), gathered(params, encoded)
  assert got.shape == (B, 3, cfg.emb_dim)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda p, enc: jnp.sum(jnp.sin(f(p, enc)))
  got_g = jax.grad(loss(at_positions), argnums=(0, 1))(params, encoded)
  want_g = jax.grad(loss(gathered), argnums=(0, 1))(params, encoded)
  jax.tree.map(
    lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4),
    got_g,
    want_g,
  )

  # Row 0's queries at 1 (first target) and 6 (second) each read their own
  # input's encoder states only (0-3 and 4-9).
  def reads(query):
    g = jax.grad(lambda enc: at_positions(params, enc)[0, query].sum())
    return np.abs(np.asarray(g(encoded)[0])).sum(-1) > 0

  np.testing.assert_array_equal(reads(0), np.arange(S) < 4)
  np.testing.assert_array_equal(reads(1), np.arange(S) >= 4)


def test_padding_does_not_leak_into_real_tokens():
  model, params, batch = small_model_and_batch()
  del batch['masked_positions']  # every position's state
  other = {k: v.copy() for k, v in batch.items()}
  other['input_ids'][1, 10:] = 42  # change only padded positions
  h1 = model.apply(params, batch, deterministic=True)['hidden']
  h2 = model.apply(params, other, deterministic=True)['hidden']
  np.testing.assert_allclose(h1[1, :10], h2[1, :10], rtol=1e-5, atol=1e-6)
  assert not np.allclose(h1[1, 10:], h2[1, 10:])


def test_attention_matches_a_numpy_reference():
  model, params, batch = small_model_and_batch()
  p = params['params']['encoder']['layer_0']['attention']
  x = np.random.default_rng(1).normal(size=(3, 16, 128)).astype(np.float32)
  mask = batch['input_mask'][:, None, None, :].astype(bool)
  cfg = model.cfg
  got = layers.MultiHeadAttention(cfg, out_std=0.02).apply(
    {'params': p}, x, x, mask=mask, deterministic=True
  )

  def proj(name):
    return (
      np.einsum('bld,dhk->blhk', x, p[f'{name}_kernel']) + p[f'{name}_bias']
    )

  q, k, v = proj('query'), proj('key'), proj('value')
  s = np.einsum('blhk,bshk->bhls', q, k) / np.sqrt(cfg.head_dim)
  s = np.where(mask, s, -1e30)
  a = np.exp(s - s.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  o = np.einsum('bhls,bshk->blhk', a, v)
  want = np.einsum('blhk,hkd->bld', o, p['out_kernel']) + p['out_bias']
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_model_config_families_are_the_registry():
  from pretrain_lm.models import MODELS
  from pretrain_lm.models.config import CHOICES

  assert set(CHOICES['family']) == set(MODELS)


def test_output_positions_refuse_decoding_and_collected_states():
  cfg = bert('tiny', vocab_size=97, max_len=32)
  ids = jnp.zeros((2, 8), jnp.int32)
  kwargs = dict(
    segment_ids_BL=jnp.ones_like(ids),
    positions_BL=jnp.tile(jnp.arange(8), (2, 1)),
    deterministic=True,
    output_positions_BP=jnp.zeros((2, 3), jnp.int32),
  )
  for flag in ('decode', 'collect_states'):
    stack = bare_stack(cfg, causal=False, **{flag: True})
    with pytest.raises(ValueError, match='output_positions_BP'):
      stack.init(jax.random.key(0), ids, **kwargs)
