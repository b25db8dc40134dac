"""Tests for pretrain_lm.objectives.mlm: masking statistics and the loss."""

import math
import re
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
# Piece texts as piece_texts() gives them, for whole-word and span masking: a
# leading space starts a word; 34 is a lone space (it joins the next word)
# and 35 ends with a space (the next token starts a word).
TEXTS = (
  [''] * 5
  + [f' w{i}' for i in range(5, 18)]
  + [f'c{i}' for i in range(18, 34)]
  + [' ', 'e ']
  + [f'.{i}' for i in range(36, VOCAB)]
)
TOKENIZER = types.SimpleNamespace(
  pad_id=PAD,
  cls_id=CLS,
  sep_id=SEP,
  mask_id=MASK,
  first_normal_id=5,
  vocab_size=VOCAB,
  piece_texts=lambda: TEXTS,
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


SPECIALS = [PAD, CLS, SEP, MASK]


def _reference_words(row):
  """Word index per token (-1 on specials), from the text of each run.

  Independent of the implementation's per-token rule: each run of
  non-special tokens is joined into text and split into words by the regex
  below (leading whitespace belongs to the word after it), and a token
  belongs to the word holding its first character.
  """
  words = np.full(len(row), -1)
  count, i = 0, 0
  while i < len(row):
    if row[i] in SPECIALS:
      i += 1
      continue
    j = i
    while j < len(row) and row[j] not in SPECIALS:
      j += 1
    starts = np.cumsum([0] + [len(TEXTS[t]) for t in row[i:j]])[:-1]
    text = ''.join(TEXTS[t] for t in row[i:j])
    for m in re.finditer(r'\s*\S+|\s+', text):
      inside = (starts >= m.start()) & (starts < m.end())
      # A match may hold no token's start: the space of 'e ' at a run's end.
      if inside.any():
        words[i:j][inside] = count
        count += 1
    i = j
  return words


def _budget(row):
  n = (~np.isin(row, SPECIALS)).sum()
  return min(max(round(0.15 * n), 1), P)


def _mask_units(rows, seeds, **overrides):
  """mlm.mask over rows in tf.data: (features, units)."""
  config = _objective_config(**overrides)
  ds = tf.data.Dataset.from_tensor_slices((rows, seeds)).map(
    lambda ids, seed: mlm.mask(ids, seed, config=config, tokenizer=TOKENIZER)
  )
  return next(ds.batch(len(rows)).as_numpy_iterator())


@pytest.fixture(scope='module')
def word_rows():
  # Two documents and a few [MASK]s per row; words of ~2.5 tokens.
  rows = _rows(1500, seed=1)
  return rows, np.stack([_reference_words(row) for row in rows])


@pytest.fixture(scope='module')
def whole_word_masked(word_rows):
  rows, _ = word_rows
  return _mask_units(rows, _seeds(len(rows)), masking='whole_word')


@pytest.fixture(scope='module')
def span_masked(word_rows):
  rows, _ = word_rows
  return _mask_units(rows, _seeds(len(rows)), masking='span')


def test_word_segmentation_matches_reference():
  row = np.array(
    [CLS, 5, 18, 19, 34, 6, 35, 20, SEP, 21, 36, 34, 34, 7, 34, SEP, MASK, 8]
  )
  # [CLS] " w5c18c19" "  w6e " "c20" [SEP] "c21.36" "   w7" " " [SEP] [MASK]
  # " w8"
  want = [-1, 0, 0, 0, 1, 1, 1, 2, -1, 3, 3, 4, 4, 4, 5, -1, -1, 6]
  np.testing.assert_array_equal(_reference_words(row), want)
  is_candidate = ~np.isin(row, SPECIALS)
  word_id, num_words = mlm._words(
    tf.constant(row, tf.int32), tf.constant(is_candidate), TOKENIZER
  )
  np.testing.assert_array_equal(word_id, want)
  assert num_words == 7


@pytest.mark.parametrize('masking', ['whole_word', 'span'])
def test_words_are_predicted_whole(masking, word_rows, request):
  rows, words = word_rows
  features, units = request.getfixturevalue(f'{masking}_masked')
  chosen = units > 0
  # No special token is ever predicted.
  assert not chosen[words < 0].any()
  for r, row in enumerate(rows):
    # Every word is in or out whole.
    lengths = np.bincount(words[r][words[r] >= 0])
    hits = np.bincount(words[r][chosen[r]], minlength=len(lengths))
    assert np.all((hits == 0) | (hits == lengths))
    # The slots list exactly the chosen tokens, in order, then padding.
    count = chosen[r].sum()
    assert count <= _budget(row)
    np.testing.assert_array_equal(
      features['masked_positions'][r, :count], np.nonzero(chosen[r])[0]
    )
    np.testing.assert_array_equal(
      features['masked_weights'][r], np.arange(P) < count
    )
    np.testing.assert_array_equal(
      features['masked_ids'][r, :count], row[chosen[r]]
    )
    untouched = features['input_ids'][r, ~chosen[r]]
    np.testing.assert_array_equal(untouched, row[~chosen[r]])


def test_whole_word_is_greedy_over_words(word_rows, whole_word_masked):
  rows, words = word_rows
  _, units = whole_word_masked
  short = 0
  for r, row in enumerate(rows):
    lengths = np.bincount(words[r][words[r] >= 0])
    is_chosen = np.bincount(words[r][units[r] > 0], minlength=len(lengths)) > 0
    room = _budget(row) - lengths[is_chosen].sum()
    # BERT's greedy skips a word only when it does not fit, and the room
    # only shrinks: every word left out is longer than the room left.
    assert (lengths[~is_chosen] > room).all()
    short += room > 0
  fraction = (units > 0).sum(axis=1) / (words >= 0).sum(axis=1)
  assert abs(fraction.mean() - 0.15) < 0.005
  assert short / len(rows) < 0.05


def test_whole_word_chooses_words_uniformly():
  # 25 two-token words: budget round(7.5) = 8 tokens = 4 words, 16% each.
  rows = np.full([2000, L], PAD, np.int32)
  rows[:, 0] = CLS
  rows[:, 1:51:2] = 5
  rows[:, 2:51:2] = 18
  rows[:, 51] = SEP
  _, units = _mask_units(rows, _seeds(len(rows)), masking='whole_word')
  chosen = units[:, 1:51:2] > 0
  np.testing.assert_array_equal(chosen, units[:, 2:51:2] > 0)
  np.testing.assert_array_equal(chosen.sum(axis=1), 4)
  std = math.sqrt(0.16 * 0.84 / len(rows))
  assert np.abs(chosen.mean(axis=0) - 0.16).max() < 5 * std


def _treatments(rows, features, units):
  """Per predicted token: row, unit, kind ('M' [MASK], 'R' changed, 'K'
  kept) and new id."""
  weights = features['masked_weights'] > 0
  r = np.nonzero(weights)[0]
  pos = features['masked_positions'][weights]
  new = features['input_ids'][r, pos]
  kind = np.where(new == MASK, 'M', np.where(new != rows[r, pos], 'R', 'K'))
  return r, units[r, pos], kind, new


def _groups(r, unit):
  """Token indices of each (row, unit), via one sort."""
  key = r * (L + 1) + unit
  order = np.argsort(key, kind='stable')
  cuts = np.nonzero(np.diff(key[order]))[0] + 1
  return np.split(order, cuts)


def test_whole_word_decides_80_10_10_per_token(word_rows, whole_word_masked):
  rows, _ = word_rows
  r, unit, kind, new = _treatments(rows, *whole_word_masked)
  n = len(kind)
  p_hit = 1 / (VOCAB - 5)
  tol = 4 * math.sqrt(0.25 / n)
  assert abs((kind == 'M').mean() - 0.8) < tol
  assert abs((kind == 'R').mean() - 0.1 * (1 - p_hit)) < tol
  assert new[kind == 'R'].min() >= 5 and new[kind == 'R'].max() < VOCAB
  # Per token, so a two-token word mixes [MASK] and not with 2 * 0.8 * 0.2.
  pairs = [g for g in _groups(r, unit) if len(g) == 2]
  mixed = np.mean([(kind[g] == 'M').sum() == 1 for g in pairs])
  assert len(pairs) > 1000
  assert abs(mixed - 0.32) < 4 * math.sqrt(0.32 * 0.68 / len(pairs))


def test_span_lengths_are_truncated_geometric():
  draws = mlm.span_lengths(tf.constant([3, 4], tf.int64), 200_000, 0.2, 10)
  counts = np.bincount(draws.numpy(), minlength=11)[1:]
  assert counts.sum() == 200_000 and len(counts) == 10
  # Geometric(0.2) truncated to 1..10 and renormalised: SpanBERT's mean 3.8.
  pmf = 0.2 * 0.8 ** np.arange(10)
  pmf /= pmf.sum()
  assert abs((pmf * np.arange(1, 11)).sum() - 3.797) < 1e-3
  assert abs(draws.numpy().mean() - 3.797) < 0.03
  expected = pmf * 200_000
  chi2 = ((counts - expected) ** 2 / expected).sum()
  assert chi2 < 27.9  # the 0.999 quantile of chi-square with 9 dof
  ones = mlm.span_lengths(tf.constant([3, 4], tf.int64), 5, 1.0, 10)
  np.testing.assert_array_equal(ones, 1)


def test_spans_are_contiguous_whole_words_within_a_document(
  word_rows, span_masked
):
  rows, words = word_rows
  _, units = span_masked
  r, unit, _, _ = _treatments(rows, *span_masked)
  pos = np.nonzero(units > 0)[1]
  span_words = []
  for g in _groups(r, unit):
    # Contiguous, so no special token inside: one document's words.
    p = np.sort(pos[g])
    np.testing.assert_array_equal(p, np.arange(p[0], p[-1] + 1))
    span_words.append(len(np.unique(words[r[g[0]], p])))
  span_words = np.array(span_words)
  assert span_words.min() >= 1 and span_words.max() <= 10
  # Budgets of ~5 tokens and document ends clip spans below the 3.8 mean.
  assert 1 < span_words.mean() < 3.8
  # Anchors must fit the room left, so the budget is nearly always spent.
  fraction = (units > 0).sum(axis=1) / (words >= 0).sum(axis=1)
  assert abs(fraction.mean() - 0.15) < 0.01


def test_long_rows_realise_the_span_length_distribution():
  # One 510-word document: budget 76 tokens = words, so few spans are cut
  # short (by the budget, a document end or a span placed before).
  rows = np.full([200, 512], 5, np.int32)
  rows[:, 0], rows[:, -1] = CLS, SEP
  _, units = _mask_units(rows, _seeds(len(rows)), masking='span')
  np.testing.assert_array_equal((units > 0).sum(axis=1), 76)
  lengths = np.concatenate([np.bincount(u)[1:] for u in units])
  lengths = lengths[lengths > 0]
  assert len(lengths) > 3000 and lengths.max() <= 10
  pmf = 0.2 * 0.8 ** np.arange(10)
  pmf /= pmf.sum()
  histogram = np.bincount(lengths, minlength=11)[1:] / len(lengths)
  assert np.abs(histogram - pmf).max() < 0.04
  assert 3.3 < lengths.mean() < 3.8


def test_span_decides_80_10_10_per_span(word_rows, span_masked):
  rows, _ = word_rows
  r, unit, kind, new = _treatments(rows, *span_masked)
  span_kinds, distinct = [], []
  for g in _groups(r, unit):
    kinds = set(kind[g])
    # Every token of a span gets the span's treatment: all [MASK], or all
    # random (a random token may equal the original: 'K' then), or kept.
    assert kinds in ({'M'}, {'R'}, {'K'}, {'R', 'K'})
    span_kinds.append('M' if 'M' in kinds else 'R' if 'R' in kinds else 'K')
    if (kind[g] == 'R').sum() >= 3:
      distinct.append(len(set(new[g])) > 1)
  span_kinds = np.array(span_kinds)
  n = len(span_kinds)
  assert n > 3000
  tol = 4 * math.sqrt(0.25 / n)
  assert abs((span_kinds == 'M').mean() - 0.8) < tol
  # A random span of l tokens all equal to the original is rare (1/35^l).
  assert abs((span_kinds == 'R').mean() - 0.1) < tol + 0.01
  assert abs((span_kinds == 'K').mean() - 0.1) < tol + 0.01
  # A random replacement draws a token per position.
  assert np.mean(distinct) > 0.9


@pytest.mark.parametrize('masking', ['whole_word', 'span'])
def test_word_masking_is_deterministic_per_seed(masking, word_rows, request):
  rows = word_rows[0][:300]
  first = _mask(rows, _seeds(300), masking=masking)
  segment_ids, positions = _segments(rows)
  np.testing.assert_array_equal(first['segment_ids'], segment_ids)
  np.testing.assert_array_equal(first['positions'], positions)
  # The same seeds give the same masks, and mask() is the transform's
  # masking.
  features, _ = request.getfixturevalue(f'{masking}_masked')
  for key, value in features.items():
    np.testing.assert_array_equal(value[:300], first[key])
  other = _mask(rows, _seeds(300, epoch=1), masking=masking)
  same = np.all(other['masked_positions'] == first['masked_positions'], 1)
  # Short rows predict one or two words, which may coincide.
  many = first['masked_weights'].sum(axis=1) >= 5
  assert many.sum() > 100
  assert same[many].mean() < 0.03 and same.mean() < 0.15


def test_unknown_masking_is_an_error(rows):
  with pytest.raises(ValueError, match='objective.masking'):
    _mask(rows[:2], _seeds(2), masking='ngram')
