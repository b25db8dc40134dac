"""Tests for XLNet's permutation LM: the orders, the masks, two streams."""

import dataclasses
import importlib.util
import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from flax import linen as nn

from pretrain_lm import configlib
from pretrain_lm.models import MODELS, ModelConfig
from pretrain_lm.models import plm as plm_model
from pretrain_lm.models.config import size_preset
from pretrain_lm.models.encoder import EncoderModel
from pretrain_lm.objectives import OBJECTIVES, mlm, plm

PAD, CLS, SEP, MASK = 0, 2, 3, 4
VOCAB = 80
TOKENIZER = types.SimpleNamespace(
  pad_id=PAD,
  cls_id=CLS,
  sep_id=SEP,
  mask_id=MASK,
  first_normal_id=5,
  vocab_size=VOCAB,
)
L = 64
K = 6
P = math.ceil(L / K)


def _segments(rows):
  """Packing-style segment ids and positions: a segment ends at a [SEP]."""
  segment_ids = np.zeros_like(rows)
  positions = np.zeros_like(rows)
  for r, row in enumerate(rows):
    seg, pos = 1, 0
    for i, token in enumerate(row):
      if token == PAD:
        break
      segment_ids[r, i], positions[r, i] = seg, pos
      seg, pos = (seg + 1, 0) if token == SEP else (seg, pos + 1)
  return segment_ids, positions


def _random_rows(num_rows, seed=0):
  """[CLS] a [SEP] b [SEP] [PAD]* of random lengths, with a few [MASK]s."""
  rng = np.random.default_rng(seed)
  rows = np.zeros([num_rows, L], np.int32)
  for r in range(num_rows):
    n = rng.integers(3, L)
    rows[r, 0] = CLS
    rows[r, 1:n] = rng.integers(5, VOCAB, n - 1)
    rows[r, rng.integers(1, n)] = SEP
    rows[r, rng.integers(1, n)] = MASK
    rows[r, n] = SEP
  return rows


def _fixed_rows(num_rows, seed=1):
  """Rows of one layout, [CLS] 29 tokens [SEP] 30 tokens [SEP] [PAD] [PAD]:
  every row has the same n = 59 normal tokens."""
  rng = np.random.default_rng(seed)
  rows = rng.integers(5, VOCAB, [num_rows, L]).astype(np.int32)
  rows[:, 0], rows[:, 30], rows[:, 61] = CLS, SEP, SEP
  rows[:, 62:] = PAD
  return rows


def _seeds(num_rows, epoch=0):
  return np.stack(
    [np.full(num_rows, epoch), np.arange(num_rows)], axis=1
  ).astype(np.int64)


def _transform(rows, seeds, plm_k=K):
  """Runs the transform over rows inside tf.data, as the pipeline does."""
  config = configlib.base_config().objective
  config.plm_k = plm_k
  segment_ids, positions = _segments(rows)
  ds = tf.data.Dataset.from_tensor_slices(
    (
      {'input_ids': rows, 'segment_ids': segment_ids, 'positions': positions},
      seeds,
    )
  ).map(
    lambda row, seed: plm.transform(
      row, seed, config=config, tokenizer=TOKENIZER
    )
  )
  return next(ds.batch(len(rows)).as_numpy_iterator())


def _is_normal(rows):
  return ~np.isin(rows, [PAD, CLS, SEP, MASK])


@pytest.fixture(scope='module')
def rows():
  return _random_rows(1000)


@pytest.fixture(scope='module')
def examples(rows):
  return _transform(rows, _seeds(len(rows)))


def test_registered():
  assert OBJECTIVES['plm'] is plm
  assert MODELS['plm'] is plm_model.PlmModel
  assert plm.FAMILIES == ('plm',)
  assert plm.loss is mlm.loss
  assert plm.max_predictions(6, 512) == 86


def test_shapes_and_unchanged_inputs(examples, rows):
  n = len(rows)
  want = {
    'input_ids': ((n, L), np.int32),
    'segment_ids': ((n, L), np.int32),
    'positions': ((n, L), np.int32),
    'input_mask': ((n, L), np.int32),
    'perm_rank': ((n, L), np.int32),
    'masked_positions': ((n, P), np.int32),
    'masked_ids': ((n, P), np.int32),
    'masked_weights': ((n, P), np.float32),
  }
  assert {k: (v.shape, v.dtype) for k, v in examples.items()} == want
  segment_ids, positions = _segments(rows)
  # Permutation LM corrupts nothing: the model sees the original row.
  np.testing.assert_array_equal(examples['input_ids'], rows)
  np.testing.assert_array_equal(examples['segment_ids'], segment_ids)
  np.testing.assert_array_equal(examples['positions'], positions)
  np.testing.assert_array_equal(examples['input_mask'], rows != PAD)


def test_last_ceil_n_over_k_of_the_order_are_predicted(examples, rows):
  is_normal = _is_normal(rows)
  for r in range(len(rows)):
    n = is_normal[r].sum()
    m = -(-n // K)  # ceil: at least one target unless n = 0
    assert m <= P
    weights = examples['masked_weights'][r]
    targets = examples['masked_positions'][r]
    rank = examples['perm_rank'][r]
    np.testing.assert_array_equal(weights, np.arange(P) < m)
    real = targets[:m]
    assert np.all(np.diff(real) > 0)  # ascending and distinct
    assert is_normal[r, real].all()  # never a special token or [PAD]
    np.testing.assert_array_equal(targets[m:], 0)
    np.testing.assert_array_equal(examples['masked_ids'][r, :m], rows[r, real])
    np.testing.assert_array_equal(examples['masked_ids'][r, m:], 0)
    # The targets' ranks are an order of them: 0 .. m-1, -1 elsewhere.
    np.testing.assert_array_equal(np.sort(rank[real]), np.arange(m))
    others = np.ones(L, bool)
    others[real] = False
    np.testing.assert_array_equal(rank[others], -1)
  # The rows cover the edge cases: nothing to predict, and n < K.
  counts = is_normal.sum(1)
  assert (counts == 0).any() and ((counts > 0) & (counts < K)).any()


def test_each_token_is_predicted_one_in_k_times_at_uniform_ranks():
  num_rows = 3000
  rows = _fixed_rows(num_rows)
  examples = _transform(rows, _seeds(num_rows))
  normal = np.flatnonzero(_is_normal(rows[0]))
  n, m = len(normal), math.ceil(len(normal) / K)
  assert (n, m) == (59, 10)
  rank = examples['perm_rank']
  predicted = rank >= 0
  assert not predicted[:, ~_is_normal(rows[0])].any()
  np.testing.assert_array_equal(predicted.sum(1), m)

  # Each normal token is among the last m of a uniform order with
  # probability m / n (~1/K): binomial counts per position.
  p = m / n
  counts = predicted[:, normal].sum(0)
  expected, std = num_rows * p, math.sqrt(num_rows * p * (1 - p))
  assert np.abs(counts - expected).max() < 4.5 * std
  chi2 = np.sum((counts - expected) ** 2 / (expected * (1 - p)))
  df = n - 1
  assert chi2 < df + 5 * math.sqrt(2 * df)

  # Given that it is predicted, a token's rank is uniform on 0 .. m-1.
  table = np.zeros([n, m])
  for j, position in enumerate(normal):
    table[j] = np.bincount(rank[predicted[:, position], position], minlength=m)
  cell = counts[:, None] / m
  chi2 = np.sum((table - cell) ** 2 / cell)
  df = n * (m - 1)
  assert chi2 < df + 5 * math.sqrt(2 * df)


def test_same_seed_same_order_new_epoch_new_order(rows):
  sample = rows[:200]
  a = _transform(sample, _seeds(200, epoch=0))
  b = _transform(sample, _seeds(200, epoch=0))
  c = _transform(sample, _seeds(200, epoch=1))
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])
  differs = np.any(a['perm_rank'] != c['perm_rank'], axis=1)
  # With 30+ normal tokens two draws of 5+ ranked targets never agree by
  # chance; a row with one normal token has one possible order.
  many = _is_normal(sample).sum(1) >= 30
  assert many.sum() > 50 and differs[many].all()


def _python_masks(segment_ids, rank, targets, num_targets):
  """XLNet's masks by a loop over one explicit factorisation order.

  The order puts the specials and non-target tokens first (shuffled: their
  order must not matter) and then the targets by rank. Content: a token sees
  itself, what comes before it, and, among non-targets, everything. Query:
  a target sees exactly what comes before it.
  """
  rng = np.random.default_rng(0)
  length = len(rank)
  real = np.flatnonzero(segment_ids > 0)
  context = rng.permutation([i for i in real if rank[i] < 0])
  order = list(context) + sorted(
    (i for i in real if rank[i] >= 0), key=lambda i: rank[i]
  )
  index = {token: t for t, token in enumerate(order)}
  content = np.zeros([length, length], bool)
  query = np.zeros([num_targets, length], bool)
  for q in range(length):
    for k in range(length):
      if q not in index or k not in index:
        continue  # [PAD] neither sees nor is seen
      if segment_ids[q] != segment_ids[k]:
        continue
      both_context = rank[q] < 0 and rank[k] < 0
      content[q, k] = k == q or index[k] < index[q] or both_context
  for p in range(num_targets):
    target = targets[p]
    for k in range(length):
      if k in index and segment_ids[k] == segment_ids[target]:
        query[p, k] = index[k] < index[target]
  return content, query


def test_masks_match_a_loop_over_the_order(rows):
  sample = rows[:20]
  ex = _transform(sample, _seeds(20, epoch=3), plm_k=3)
  content, query = plm_model.two_stream_masks(
    jnp.asarray(ex['segment_ids']),
    jnp.asarray(ex['perm_rank']),
    jnp.asarray(ex['masked_positions']),
  )
  assert content.shape == (20, 1, L, L)
  assert query.shape == (20, 1, math.ceil(L / 3), L)
  for r in range(len(sample)):
    m = int(ex['masked_weights'][r].sum())
    want_content, want_query = _python_masks(
      ex['segment_ids'][r], ex['perm_rank'][r], ex['masked_positions'][r], m
    )
    np.testing.assert_array_equal(content[r, 0], want_content)
    np.testing.assert_array_equal(query[r, 0, :m], want_query)


def _model_config(**kw):
  fields = dict(
    vocab_size=VOCAB,
    **size_preset('tiny'),
    max_len=64,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
  )
  fields.update(kw)
  return ModelConfig(**fields)


def _init(model, batch):
  """Unboxed params; jitted, as op-by-op tracing is slow on a busy CPU."""
  init = jax.jit(lambda b: model.init(jax.random.key(0), b, deterministic=True))
  return nn.meta.unbox(init(batch))['params']


def _unique_id_row():
  """One row whose normal tokens all differ, so that the gradient on a row
  of the token table is the gradient on one position. Two documents."""
  length = 24
  ids = np.full([1, length], PAD, np.int32)
  ids[0, :20] = np.arange(5, 25)
  ids[0, 0], ids[0, 9], ids[0, 19] = CLS, SEP, SEP
  return ids


def _token_jacobian(model, params, batch, output):
  """d output(model outputs) / d token table: [..., V, E], jitted."""

  def f(table):
    p = {**params, 'token_embed': {'embedding': table}}
    return output(model.apply({'params': p}, batch, deterministic=True))

  table = params['token_embed']['embedding']
  return np.asarray(jax.jit(jax.jacrev(f))(table))


@pytest.mark.parametrize(
  'variant',
  [
    dict(position='relative'),
    dict(position='learned', norm_position='pre', embed_norm=False),
    # ALBERT's factorised embedding and shared layers.
    dict(position='rotary', embed_dim=32, share_layers=True),
  ],
)
def test_query_stream_sees_exactly_the_tokens_before_its_target(variant):
  ids = _unique_id_row()
  ex = _transform(ids, _seeds(1, epoch=5), plm_k=3)
  batch = {k: jnp.asarray(v) for k, v in ex.items()}
  rank, targets = ex['perm_rank'][0], ex['masked_positions'][0]
  segments = ex['segment_ids'][0]
  m = int(ex['masked_weights'][0].sum())
  assert m == 6

  model = plm_model.PlmModel(_model_config(**variant))
  params = _init(model, batch)
  # The logit of an id in no input row, so that the tied output table's own
  # gradient lands on that row only.
  unused = VOCAB - 1
  jacobian = _token_jacobian(
    model, params, batch, lambda out: out['mlm_logits'][0, :, unused]
  )
  depends = np.abs(jacobian).sum(-1) > 0  # [P, V]
  normal = np.flatnonzero(_is_normal(ids[0]))
  for p in range(m):
    t = targets[p]
    for j in normal:
      before = segments[j] == segments[t] and rank[j] < rank[t]
      assert depends[p, ids[0, j]] == before, (p, t, j, rank[j], rank[t])
    assert not depends[p, ids[0, t]]  # never its own token


def test_content_stream_non_targets_never_see_targets():
  ids = _unique_id_row()
  ex = _transform(ids, _seeds(1, epoch=6), plm_k=3)
  batch = {k: jnp.asarray(v) for k, v in ex.items()}
  rank, segments = ex['perm_rank'][0], ex['segment_ids'][0]
  model = plm_model.PlmModel(_model_config(position='relative'))
  params = _init(model, batch)
  normal = np.flatnonzero(_is_normal(ids[0]))
  # A non-target of each document and a target.
  queries = [
    next(j for j in normal if rank[j] < 0 and segments[j] == 1),
    next(j for j in normal if rank[j] < 0 and segments[j] == 2),
    next(j for j in normal if rank[j] >= 0),
  ]
  # A random direction: the sum over D of a LayerNorm output is constant.
  direction = jax.random.normal(jax.random.key(1), [model.cfg.emb_dim])
  jacobian = _token_jacobian(
    model, params, batch, lambda out: out['hidden'][0, queries] @ direction
  )
  depends = np.abs(jacobian).sum(-1) > 0
  for i, q in enumerate(queries):
    for j in normal:
      # Content: itself, the non-targets and the targets before it.
      sees = segments[j] == segments[q] and rank[j] <= rank[q]
      assert depends[i, ids[0, j]] == sees, (q, j)


def test_without_an_order_it_is_the_bidirectional_encoder():
  rows = _random_rows(4, seed=3)
  segment_ids, positions = _segments(rows)
  batch = {
    'input_ids': jnp.asarray(rows),
    'segment_ids': jnp.asarray(segment_ids),
    'positions': jnp.asarray(positions),
    'masked_positions': jnp.zeros([4, P], jnp.int32),
  }
  cfg = _model_config(position='relative', pooler=True)
  plm_params = _init(plm_model.PlmModel(cfg), batch)
  encoder_params = _init(EncoderModel(cfg), batch)
  # Same tree and shapes: a PLM checkpoint loads as an encoder.
  assert jax.tree.map(np.shape, plm_params) == jax.tree.map(
    np.shape, encoder_params
  )
  features = {k: batch[k] for k in ('input_ids', 'segment_ids', 'positions')}

  def apply(model):
    return jax.jit(
      lambda: model.apply({'params': plm_params}, features, deterministic=True)
    )()

  got, want = apply(plm_model.PlmModel(cfg)), apply(EncoderModel(cfg))
  assert set(got) == {'hidden', 'pooled'}
  np.testing.assert_allclose(got['hidden'], want['hidden'], atol=1e-6)
  np.testing.assert_allclose(got['pooled'], want['pooled'], atol=1e-6)


def test_initial_loss_is_log_vocab():
  rows = _random_rows(8, seed=4)
  batch = {k: jnp.asarray(v) for k, v in _transform(rows, _seeds(8)).items()}
  model = plm_model.PlmModel(_model_config(position='relative'))
  params = _init(model, batch)

  @jax.jit
  def loss(params):
    outputs = model.apply({'params': params}, batch, deterministic=True)
    return outputs['mlm_logits'], plm.loss(outputs, batch)

  logits, (value, metrics) = loss(params)
  assert logits.shape == (8, P, VOCAB)
  assert metrics['num_predictions'] == batch['masked_weights'].sum()
  # Small initial weights: near-uniform predictions.
  assert abs(float(value) - math.log(VOCAB)) < 0.1


def test_flops_add_the_query_stream_to_the_encoder():
  cfg = ModelConfig(vocab_size=30522, **size_preset('base'))
  B, seq_len, preds = 2, 128, 22
  shapes = {'input_ids': (B, seq_len), 'masked_positions': (B, preds)}
  batch = {k: jnp.zeros(s, jnp.int32) for k, s in shapes.items()}
  params = nn.meta.unbox(
    jax.eval_shape(
      lambda: plm_model.PlmModel(cfg).init(
        jax.random.key(0), batch, deterministic=True
      )
    )
  )['params']
  layer = params['encoder']['layer_0']
  weights = sum(
    x.size
    for path, x in jax.tree_util.tree_leaves_with_path(layer)
    if 'kernel' in jax.tree_util.keystr(path)
  )
  # The query stream's own matmuls run at the targets; it projects the
  # content stream's keys and values again, at all seq_len positions.
  kv_weights = (
    layer['attention']['key_kernel'].size
    + layer['attention']['value_kernel'].size
  )
  attention = 12 * seq_len * cfg.num_heads * cfg.head_dim
  query = cfg.num_layers * (
    (6 * (weights - kv_weights) + attention) * preds + 6 * kv_weights * seq_len
  )
  got = MODELS['plm'].train_flops(cfg, shapes)
  # Nothing reads the content stream's last layer but through g's keys and
  # values (counted above): the encoder body with one layer fewer.
  shallower = dataclasses.replace(cfg, num_layers=cfg.num_layers - 1)
  body = EncoderModel.train_flops(shallower, {'input_ids': (B, seq_len)})
  head = (
    6
    * preds
    * (
      params['mlm_head']['transform_kernel'].size
      + params['token_embed']['embedding'].size
    )
  )
  assert got == pytest.approx(body + B * (query + head), rel=1e-9)
  # Without targets only the content stream runs: the encoder's cost.
  no_targets = {'input_ids': (B, seq_len)}
  assert MODELS['plm'].train_flops(cfg, no_targets) == pytest.approx(
    EncoderModel.train_flops(cfg, no_targets)
  )


def _xlnet_config(arg):
  path = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), 'configs', 'xlnet.py'
  )
  spec = importlib.util.spec_from_file_location('xlnet_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_xlnet_config():
  base = _xlnet_config('size=base')
  assert (base.model.family, base.objective.name) == ('plm', 'plm')
  assert base.objective.plm_k == 6
  assert base.model.position == 'relative'
  assert base.model.norm_position == 'post'
  assert base.data.seq_len == 512
  assert base.data.packing in ('full_sentences', 'doc_sentences')
  for key, value in size_preset('base').items():
    assert base.model[key] == value
  assert ModelConfig.from_config(base.model).family == 'plm'
  tiny = _xlnet_config('size=tiny')
  assert tiny.model.num_layers == 2 and tiny.train.num_steps == 300
