"""Tests for pretrain_lm.objectives.mlm: masking statistics and the loss."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from pretrain_lm import configlib
from pretrain_lm.objectives import OBJECTIVES, mlm

PAD, CLS, SEP, MASK = 0, 2, 3, 4
VOCAB = 40  # small, so random replacements often hit the original token
TOKENIZER = types.SimpleNamespace(
  pad_id=PAD,
  cls_id=CLS,
  sep_id=SEP,
  mask_id=MASK,
  first_normal_id=5,
  vocab_size=VOCAB,
)
L = 64
P = math.ceil(0.15 * L)


def _objective_config(**overrides):
  config = configlib.base_config().objective
  config.update(overrides)
  return config


def _rows(num_rows, seed=0):
  """Packed-looking rows: [CLS] a [SEP] b [SEP] [PAD]*, with a few [MASK]."""
  rng = np.random.default_rng(seed)
  rows = np.zeros([num_rows, L], np.int32)
  for r in range(num_rows):
    n = rng.integers(10, L - 1)
    rows[r, 0] = CLS
    rows[r, 1:n] = rng.integers(5, VOCAB, n - 1)
    rows[r, rng.integers(2, n)] = SEP
    rows[r, rng.integers(1, n)] = MASK
    rows[r, n] = SEP
  return rows


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


def _mask(rows, seeds, **overrides):
  """Runs the transform over rows inside tf.data, as the pipeline does."""
  config = _objective_config(**overrides)
  segment_ids, positions = _segments(rows)
  ds = tf.data.Dataset.from_tensor_slices(
    (
      {'input_ids': rows, 'segment_ids': segment_ids, 'positions': positions},
      seeds,
    )
  ).map(
    lambda row, seed: mlm.transform(
      row, seed, config=config, tokenizer=TOKENIZER
    )
  )
  return next(ds.batch(len(rows)).as_numpy_iterator())


def _seeds(num_rows, epoch=0):
  return np.stack(
    [np.full(num_rows, epoch), np.arange(num_rows)], axis=1
  ).astype(np.int64)


@pytest.fixture(scope='module')
def rows():
  return _rows(1000)


@pytest.fixture(scope='module')
def masked(rows):
  return _mask(rows, _seeds(len(rows)))


def test_registered():
  assert OBJECTIVES['mlm'] is mlm
  assert mlm.max_predictions(0.15, 128) == 20


def test_shapes_and_dtypes(masked, rows):
  n = len(rows)
  want = {
    'input_ids': ((n, L), np.int32),
    'segment_ids': ((n, L), np.int32),
    'positions': ((n, L), np.int32),
    'token_type_ids': ((n, L), np.int32),
    'input_mask': ((n, L), np.int32),
    'masked_positions': ((n, P), np.int32),
    'masked_ids': ((n, P), np.int32),
    'masked_weights': ((n, P), np.float32),
  }
  assert {k: (v.shape, v.dtype) for k, v in masked.items()} == want
  np.testing.assert_array_equal(masked['token_type_ids'], 0)
  np.testing.assert_array_equal(masked['input_mask'], rows != PAD)


def test_packed_segments_pass_through(masked, rows):
  segment_ids, positions = _segments(rows)
  # The rows hold two or three documents each, so this is no all-ones mask.
  assert segment_ids.max() >= 2
  np.testing.assert_array_equal(masked['segment_ids'], segment_ids)
  np.testing.assert_array_equal(masked['positions'], positions)


def test_chosen_count_and_positions(masked, rows):
  is_candidate = ~np.isin(rows, [PAD, CLS, SEP, MASK])
  for r in range(len(rows)):
    n_candidates = is_candidate[r].sum()
    want = min(max(round(0.15 * n_candidates), 1), P)
    weights = masked['masked_weights'][r]
    positions = masked['masked_positions'][r]
    assert weights.sum() == want
    np.testing.assert_array_equal(weights, np.arange(P) < want)
    real = positions[:want]
    # Sorted, distinct, only candidates (never special or pad), padded 0.
    assert np.all(np.diff(real) > 0)
    assert is_candidate[r, real].all()
    np.testing.assert_array_equal(positions[want:], 0)
    np.testing.assert_array_equal(masked['masked_ids'][r, :want], rows[r, real])
    np.testing.assert_array_equal(masked['masked_ids'][r, want:], 0)
    # Everything else is untouched.
    untouched = np.ones(L, bool)
    untouched[real] = False
    np.testing.assert_array_equal(
      masked['input_ids'][r, untouched], rows[r, untouched]
    )


def test_chosen_fraction_and_uniformity():
  # Identical layouts, so each candidate position's chance is visible: 50
  # candidates -> round(7.5) = 8 chosen, 16% of each position.
  rows = np.full([2000, L], PAD, np.int32)
  rows[:, 0] = CLS
  rows[:, 1:51] = 7
  rows[:, 51] = SEP
  out = _mask(rows, _seeds(len(rows)))
  chosen = np.zeros_like(rows, bool)
  for r in range(len(rows)):
    real = out['masked_positions'][r][out['masked_weights'][r] > 0]
    chosen[r, real] = True
  assert not chosen[:, [0, *range(51, L)]].any()
  per_position = chosen[:, 1:51].mean(axis=0)
  std = math.sqrt(0.16 * 0.84 / len(rows))
  assert np.abs(per_position - 0.16).max() < 5 * std


def test_replacement_statistics(masked, rows):
  weights = masked['masked_weights'] > 0
  originals = masked['masked_ids'][weights]
  rows_idx = np.nonzero(weights)[0]
  new = masked['input_ids'][rows_idx, masked['masked_positions'][weights]]
  n = len(originals)
  assert n > 5000
  to_mask = new == MASK
  changed = ~to_mask & (new != originals)
  kept = new == originals
  # A random replacement equals the original with chance 1/(V - 5).
  p_hit = 1 / (VOCAB - 5)
  tol = 4 * math.sqrt(0.25 / n)
  assert abs(to_mask.mean() - 0.8) < tol
  assert abs(changed.mean() - 0.1 * (1 - p_hit)) < tol
  assert abs(kept.mean() - (0.1 + 0.1 * p_hit)) < tol
  # Random tokens are normal tokens of the vocabulary.
  assert new[changed].min() >= 5 and new[changed].max() < VOCAB


def test_custom_rates(rows):
  out = _mask(
    rows[:300],
    _seeds(300),
    mask_rate=0.3,
    mask_token_rate=0.0,
    random_token_rate=1.0,
  )
  p = math.ceil(0.3 * L)
  assert out['masked_positions'].shape == (300, p)
  weights = out['masked_weights'] > 0
  new = out['input_ids'][
    np.nonzero(weights)[0], out['masked_positions'][weights]
  ]
  assert not (new == MASK).any()
  assert (new != out['masked_ids'][weights]).mean() > 0.9


def test_same_seed_same_mask_new_seed_new_mask(rows, masked):
  again = _mask(rows, _seeds(len(rows)))
  for key in masked:
    np.testing.assert_array_equal(again[key], masked[key])
  next_epoch = _mask(rows, _seeds(len(rows), epoch=1))
  same = np.all(
    next_epoch['masked_positions'] == masked['masked_positions'], axis=1
  )
  # Rows with 5+ of 30+ candidates chosen coincide with chance < 1e-5.
  many = masked['masked_weights'].sum(axis=1) >= 5
  assert many.sum() > 300
  assert not same[many].any()
  assert same.mean() < 0.05


def test_rows_with_few_candidates():
  rows = np.full([3, L], PAD, np.int32)
  rows[:, 0] = CLS
  rows[0, 1] = SEP  # no candidates at all
  rows[1, 1:3] = [9, SEP]  # one: still predicted
  rows[2, 1:5] = [MASK, 9, 10, SEP]
  out = _mask(rows, _seeds(3))
  np.testing.assert_array_equal(out['masked_weights'].sum(axis=1), [0, 1, 1])
  np.testing.assert_array_equal(out['input_ids'][0], rows[0])
  assert out['masked_positions'][1, 0] == 1
  assert out['masked_positions'][2, 0] in (2, 3)


def _reference_loss(logits, labels, weights):
  logits = logits.astype(np.float64)
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
  log_z += logits.max(-1)
  picked = np.take_along_axis(logits, labels[..., None], -1)[..., 0]
  xent = log_z - picked
  return (xent * weights).sum() / weights.sum()


def test_loss_matches_reference():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=[3, 5, 11]).astype(np.float32) * 3
  labels = rng.integers(0, 11, [3, 5]).astype(np.int32)
  weights = np.array(
    [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], np.float32
  )
  # Garbage at padding slots must not matter.
  logits[weights == 0] = 1e4
  batch = {'masked_ids': labels, 'masked_weights': weights}
  loss, metrics = jax.jit(mlm.loss)({'mlm_logits': logits}, batch)
  want = _reference_loss(logits, labels, weights)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(metrics['loss'], want, rtol=1e-5)
  assert metrics['num_predictions'] == 9
  correct = (logits.argmax(-1) == labels) * weights
  np.testing.assert_allclose(metrics['mlm_accuracy'], correct.sum() / 9)


def test_accuracy_and_low_precision_logits():
  labels = np.array([[1, 2, 0, 3]], np.int32)
  weights = np.array([[1, 1, 1, 0]], np.float32)
  # Right at slots 0 and 2, wrong at 1, and slot 3 is padding.
  logits = jax.nn.one_hot(np.array([[1, 0, 0, 3]]), 5) * 10
  batch = {'masked_ids': labels, 'masked_weights': weights}
  outputs = {'mlm_logits': logits.astype(jnp.bfloat16)}
  loss, metrics = jax.jit(mlm.loss)(outputs, batch)
  np.testing.assert_allclose(metrics['mlm_accuracy'], 2 / 3, rtol=1e-6)
  assert loss.dtype == jnp.float32
  want = _reference_loss(np.asarray(logits), labels, weights)
  np.testing.assert_allclose(loss, want, rtol=1e-2)


def test_loss_without_predictions_is_zero():
  batch = {
    'masked_ids': np.zeros([2, 4], np.int32),
    'masked_weights': np.zeros([2, 4], np.float32),
  }
  outputs = {'mlm_logits': np.ones([2, 4, 7], np.float32)}
  loss, metrics = jax.jit(mlm.loss)(outputs, batch)
  assert loss == 0 and np.isfinite(metrics['mlm_accuracy'])
  assert metrics['num_predictions'] == 0
