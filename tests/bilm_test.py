"""Tests for the bilm family and objective (ELMo with Transformer stacks)."""

import functools
import importlib.util
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from flax import linen as nn

from pretrain_lm import configlib
from pretrain_lm.data import pipeline
from pretrain_lm.models import MODELS, ModelConfig, transformer
from pretrain_lm.models.bilm import BiLMModel
from pretrain_lm.models.config import size_preset
from pretrain_lm.objectives import OBJECTIVES, bilm

PAD, CLS, SEP = 0, 2, 3
VOCAB = 50
TOKENIZER = types.SimpleNamespace(
  pad_id=PAD,
  unk_id=1,
  cls_id=CLS,
  sep_id=SEP,
  mask_id=4,
  first_normal_id=5,
  vocab_size=VOCAB,
)
L = 32
V = 64  # the models' vocabulary


def _seeds(num_rows, epoch=0):
  return np.stack(
    [np.full(num_rows, epoch), np.arange(num_rows)], axis=1
  ).astype(np.int64)


@pytest.fixture(scope='module')
def rows():
  """Random documents of 1-60 tokens packed by pipeline.pack ('concat')."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 61, 2500)
  tokens = rng.integers(5, VOCAB, lengths.sum()).astype(np.int32)
  docs = tf.data.Dataset.from_tensor_slices(
    tf.RaggedTensor.from_row_lengths(tokens, lengths)
  )
  packed = pipeline.pack(
    docs, row_len=L, packing='concat', cls_id=CLS, sep_id=SEP, pad_id=PAD
  )
  return next(packed.batch(100_000).as_numpy_iterator())


def _transform(rows, seeds):
  config = configlib.base_config().objective
  ds = tf.data.Dataset.from_tensor_slices((rows, seeds)).map(
    lambda row, seed: bilm.transform(
      row, seed, config=config, tokenizer=TOKENIZER
    )
  )
  return next(ds.batch(100_000).as_numpy_iterator())


def test_registered():
  assert OBJECTIVES['bilm'] is bilm
  assert MODELS['bilm'] is BiLMModel
  assert bilm.FAMILIES == ('bilm',)
  # Rows of data.seq_len: both directions' targets lie inside the row.
  assert not hasattr(bilm, 'row_length')


def test_targets_are_the_next_and_previous_token_of_the_document(rows):
  n = len(rows['input_ids'])
  assert n > 2000
  out = _transform(rows, _seeds(n))
  ids, segments = rows['input_ids'], rows['segment_ids']
  assert (segments.max(axis=1) >= 2).mean() > 0.5  # many packed documents
  for key in ('input_ids', 'segment_ids', 'positions'):
    np.testing.assert_array_equal(out[key], rows[key])
  # Neighbours (i, i + 1) in one document, by definition.
  pair = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
  has_next = np.zeros_like(ids, bool)
  has_next[:, :-1] = pair
  has_previous = np.zeros_like(ids, bool)
  has_previous[:, 1:] = pair
  np.testing.assert_array_equal(out['target_weights'], has_next)
  np.testing.assert_array_equal(out['backward_target_weights'], has_previous)
  next_ids = np.zeros_like(ids)
  next_ids[:, :-1] = ids[:, 1:]
  previous_ids = np.zeros_like(ids)
  previous_ids[:, 1:] = ids[:, :-1]
  np.testing.assert_array_equal(
    out['target_ids'], np.where(has_next, next_ids, 0)
  )
  np.testing.assert_array_equal(
    out['backward_target_ids'], np.where(has_previous, previous_ids, 0)
  )
  # Each document of k tokens in a row has k - 1 targets either way; a
  # [SEP] is predicted forward (end of text), never backward, and a
  # document's first token never backward.
  assert out['target_weights'].sum() == out['backward_target_weights'].sum()
  is_sep = ids == SEP
  assert np.all(out['target_ids'][out['target_weights'] > 0] >= 3)
  assert np.any(out['target_ids'][has_next] == SEP)
  assert not np.any(out['backward_target_ids'][has_previous] == SEP)
  assert not np.any(has_previous & (rows['positions'] == 0))
  assert not np.any(has_next[is_sep])
  for key, dtype in (
    ('target_ids', np.int32),
    ('target_weights', np.float32),
    ('backward_target_ids', np.int32),
    ('backward_target_weights', np.float32),
  ):
    assert out[key].shape == (n, L) and out[key].dtype == dtype


def test_same_features_whatever_the_seed(rows):
  # Nothing is random: a seed or an epoch changes nothing.
  some = {k: v[:200] for k, v in rows.items()}
  a = _transform(some, _seeds(200))
  b = _transform(some, _seeds(200, epoch=3))
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])


def _log_softmax(x):
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_loss_is_the_sum_of_both_directions_mean_cross_entropy():
  rng = np.random.default_rng(0)
  B, T, W = 3, 7, 11
  fwd = (rng.normal(size=[B, T, W]) * 3).astype(np.float32)
  bwd = (rng.normal(size=[B, T, W]) * 3).astype(np.float32)
  batch = {
    'target_ids': rng.integers(0, W, [B, T]).astype(np.int32),
    'target_weights': (rng.random([B, T]) < 0.7).astype(np.float32),
    'backward_target_ids': rng.integers(0, W, [B, T]).astype(np.int32),
    'backward_target_weights': (rng.random([B, T]) < 0.4).astype(np.float32),
  }
  outputs = {'logits': fwd, 'backward_logits': bwd}
  loss, metrics = jax.jit(bilm.loss)(outputs, batch)

  def direction(logits, ids, weights):
    nll = -np.take_along_axis(_log_softmax(logits), ids[..., None], -1)[..., 0]
    hits = (logits.argmax(-1) == ids) * weights
    return (nll * weights).sum() / weights.sum(), hits.sum(), weights.sum()

  f_loss, f_hits, f_n = direction(
    fwd, batch['target_ids'], batch['target_weights']
  )
  b_loss, b_hits, b_n = direction(
    bwd, batch['backward_target_ids'], batch['backward_target_weights']
  )
  assert f_n != b_n  # the two means are not one pooled mean
  np.testing.assert_allclose(loss, f_loss + b_loss, rtol=1e-5)
  np.testing.assert_allclose(metrics['loss'], f_loss + b_loss, rtol=1e-5)
  np.testing.assert_allclose(metrics['forward_loss'], f_loss, rtol=1e-5)
  np.testing.assert_allclose(metrics['backward_loss'], b_loss, rtol=1e-5)
  np.testing.assert_allclose(
    metrics['accuracy'], (f_hits + b_hits) / (f_n + b_n), rtol=1e-6
  )
  assert metrics['num_predictions'] == f_n + b_n


def test_loss_without_predictions_is_zero():
  zeros = np.zeros([2, 4], np.float32)
  batch = {
    'target_ids': zeros.astype(np.int32),
    'target_weights': zeros,
    'backward_target_ids': zeros.astype(np.int32),
    'backward_target_weights': zeros,
  }
  logits = np.ones([2, 4, 5], np.float32)
  loss, metrics = jax.jit(bilm.loss)(
    {'logits': logits, 'backward_logits': logits}, batch
  )
  assert loss == 0 and metrics['num_predictions'] == 0
  assert np.isfinite(metrics['accuracy'])


def tiny(**kw) -> ModelConfig:
  """configs/bilm.py's layout (GPT-2 pre-LN) at test size."""
  base = dict(
    family='bilm',
    vocab_size=V,
    max_len=32,
    type_vocab_size=0,
    norm_position='pre',
    embed_norm=False,
    activation='gelu_tanh',
    scaled_residual_init=True,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    **size_preset('tiny', 'gpt2'),
  )
  return ModelConfig(**{**base, **kw})


def packed_row():
  """One row: documents of 7 and 6 tokens, then 3 [PAD]s."""
  segments = np.array([[1] * 7 + [2] * 6 + [0] * 3], np.int32)
  positions = np.array([[*range(7), *range(6), 0, 0, 0]], np.int32)
  ids = np.zeros_like(segments)
  ids[0, :13] = np.random.default_rng(0).integers(5, V - 1, 13)
  ids[0, [6, 12]] = SEP
  return {'input_ids': ids, 'segment_ids': segments, 'positions': positions}


# Variants the model tests share: each costs a compile, so each is built
# once per module.
VARIANTS = {
  'gpt2': {},
  'rotary_scan_untied': dict(
    position='rotary', scan_layers=True, tie_embeddings=False
  ),
}


@functools.cache
def init(variant='gpt2'):
  cfg = tiny(**VARIANTS[variant])
  model = BiLMModel(cfg)
  variables = model.init(jax.random.key(0), packed_row(), deterministic=True)
  return cfg, model, nn.meta.unbox(variables)['params']


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_each_direction_reads_only_its_side_of_its_document(variant):
  cfg, model, params = init(variant)
  batch = packed_row()
  # Row j + 1 changes only token j, to an id no row has elsewhere.
  n = batch['input_ids'].shape[1]
  changed = np.tile(batch['input_ids'], (n + 1, 1))
  changed[np.arange(1, n + 1), np.arange(n)] = V - 1
  many = {k: np.tile(v, (n + 1, 1)) for k, v in batch.items()}
  out = model.apply(
    {'params': params}, dict(many, input_ids=changed), deterministic=True
  )
  segments = batch['segment_ids'][0]
  same = (segments[:, None] == segments[None]) & (segments[None] > 0)
  before = np.tril(np.ones((n, n), bool))  # [t, j]: j <= t
  D = cfg.emb_dim
  for key, half, want in (
    ('logits', np.s_[:], same & before),
    ('backward_logits', np.s_[:], same & before.T),
    ('hidden', np.s_[:D], same & before),
    ('hidden', np.s_[D:], same & before.T),
  ):
    x = np.asarray(out[key])[..., half]
    diff = np.abs(x[1:] - x[:1]).max(axis=-1)  # [j, t]
    # Exactly unchanged, or clearly changed.
    assert np.all((diff < 1e-6) | (diff > 1e-4)), key
    # [PAD] queries see nothing and are never used: real rows only.
    np.testing.assert_array_equal((diff.T > 1e-4)[:13], want[:13], key)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_shared_embeddings_and_softmax_separate_stacks(variant):
  cfg, _, params = init(variant)
  want = {'token_embed', 'forward', 'backward'}
  if cfg.position == 'learned':
    want.add('embeddings')
    assert set(params['embeddings']) == {'position_embed'}
  if not cfg.tie_embeddings:
    want.add('lm_head')  # one output kernel for both directions
    assert set(params['lm_head']) == {'logits_kernel'}
  assert set(params) == want
  fwd, bwd = params['forward'], params['backward']
  assert jax.tree.structure(fwd) == jax.tree.structure(bwd)
  assert 'embeddings' not in fwd and 'token_embed' not in fwd
  # Separately initialised: no layer weight is shared.
  for a, b in zip(jax.tree.leaves(fwd), jax.tree.leaves(bwd), strict=True):
    assert a.shape == b.shape
    if np.asarray(a).std() > 0:
      assert not np.allclose(a, b)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_both_directions_train_the_shared_parameters(variant):
  _, model, params = init(variant)
  batch = packed_row()
  # The token table, positions (if learned) and output kernel (if untied).
  shared = set(params) - {'forward', 'backward'}

  @jax.jit
  def grads(p):
    def summed(key):
      return lambda p: model.apply({'params': p}, batch, deterministic=True)[
        key
      ].sum()

    return {k: jax.grad(summed(k))(p) for k in ('logits', 'backward_logits')}

  g = grads(params)
  for key, other in (('logits', 'backward'), ('backward_logits', 'forward')):
    for name in shared:
      assert any(np.any(x != 0) for x in jax.tree.leaves(g[key][name])), name
    assert all(np.all(x == 0) for x in jax.tree.leaves(g[key][other]))


def test_backward_direction_is_the_forward_lm_on_reversed_text():
  # With the forward stack's weights in the backward stack too, the
  # backward outputs on a row are the forward outputs on the row reversed
  # (positions counted from each document's end).
  cfg, model, params = init()
  batch = packed_row()
  params = dict(params, backward=params['forward'])
  segments = batch['segment_ids'][:, ::-1]
  reversed_batch = {
    'input_ids': batch['input_ids'][:, ::-1],
    'segment_ids': segments,
    'positions': np.asarray(transformer.default_positions(segments)),
  }
  out = model.apply({'params': params}, batch, deterministic=True)
  rev = model.apply({'params': params}, reversed_batch, deterministic=True)
  real = batch['segment_ids'][0] > 0
  D = cfg.emb_dim
  np.testing.assert_allclose(
    np.asarray(out['backward_logits'])[0, real],
    np.asarray(rev['logits'])[0, ::-1][real],
    rtol=1e-5,
    atol=1e-5,
  )
  np.testing.assert_allclose(
    np.asarray(out['hidden'])[0, real, D:],
    np.asarray(rev['hidden'])[0, ::-1][real, :D],
    rtol=1e-5,
    atol=1e-5,
  )
  np.testing.assert_allclose(
    np.asarray(out['layer_states'])[1:, 0, real, D:],
    np.asarray(rev['layer_states'])[1:, 0, ::-1][:, real, :D],
    rtol=1e-5,
    atol=1e-5,
  )


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_layer_states(variant):
  cfg, model, params = init(variant)
  batch = packed_row()
  out = model.apply({'params': params}, batch, deterministic=True)
  N, D = cfg.num_layers, cfg.emb_dim
  states = np.asarray(out['layer_states'])
  assert states.shape == (N + 1, 1, 16, 2 * D)
  assert out['hidden'].shape == (1, 16, 2 * D)
  assert out['logits'].shape == out['backward_logits'].shape == (1, 16, V)
  # Layer 0: one context-free token layer in both halves (ELMo).
  np.testing.assert_array_equal(states[0, ..., :D], states[0, ..., D:])
  embedded = np.asarray(params['token_embed']['embedding'])[batch['input_ids']]
  if cfg.position == 'learned':
    table = params['embeddings']['position_embed']['embedding']
    embedded = embedded + np.asarray(table)[batch['positions']]
  np.testing.assert_allclose(states[0, ..., :D], embedded, rtol=1e-6)
  # The last layer is the final (normalised) states; layers differ.
  np.testing.assert_allclose(states[-1], out['hidden'], rtol=1e-6)
  for k in range(1, N + 1):
    assert not np.allclose(states[k], states[k - 1])


def test_train_flops_are_two_decoders():
  cfg = tiny()
  shapes = {'input_ids': (4, 32)}
  decoder = MODELS['decoder'].train_flops(cfg, shapes)
  assert BiLMModel.train_flops(cfg, shapes) == pytest.approx(2 * decoder)
  factorised = tiny(embed_dim=32)
  assert BiLMModel.train_flops(factorised, shapes) == pytest.approx(
    2 * MODELS['decoder'].train_flops(factorised, shapes)
  )


def test_bilm_config():
  path = os.path.join(os.path.dirname(__file__), '..', 'configs', 'bilm.py')
  spec = importlib.util.spec_from_file_location('bilm_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config('size=tiny')
  assert c.model.family == 'bilm' and c.objective.name == 'bilm'
  assert c.model.family in bilm.FAMILIES
  assert c.data.packing == 'concat'
  assert c.model.norm_position == 'pre' and c.model.num_layers == 4
  assert module.get_config('size=small').model.emb_dim == 768
  # The model builds from the run config.
  cfg = ModelConfig.from_config(c.model)
  assert cfg.family == 'bilm'
  ids = jnp.zeros((1, 8), jnp.int32)
  shapes = jax.eval_shape(
    lambda: BiLMModel(cfg).init(
      jax.random.key(0), {'input_ids': ids}, deterministic=True
    )
  )
  assert 'forward' in shapes['params']
