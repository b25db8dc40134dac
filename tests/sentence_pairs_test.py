"""Tests for NSP and SOP (pretrain_lm.objectives.sentence_pairs via mlm)."""

import math
import types

import jax
import numpy as np
import pytest
import tensorflow as tf

from pretrain_lm import configlib
from pretrain_lm.objectives import mlm

PAD, CLS, SEP, MASK = 0, 2, 3, 4
VOCAB = 1000
TOKENIZER = types.SimpleNamespace(
  pad_id=PAD,
  cls_id=CLS,
  sep_id=SEP,
  mask_id=MASK,
  first_normal_id=5,
  vocab_size=VOCAB,
  piece_texts=lambda: [''] * 5 + [f' t{i}' for i in range(5, VOCAB)],
)
R = 63  # packed rows: data.seq_len - 1
L = R + 1  # the pair: [CLS] A [SEP] B [SEP] [PAD]*
P = math.ceil(0.15 * L)
N = 2000


def _doc_rows(num_rows, seed=0):
  """'doc_sentences' rows [CLS] piece [SEP] [PAD]*, pieces of 1..R-2."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, R - 1, num_rows)
  lengths[:400] = 21  # many of one length: the split point's histogram
  lengths[400:450] = 1  # too short to split
  rows = np.full([num_rows, R], PAD, np.int32)
  for r, n in enumerate(lengths):
    rows[r, 0] = CLS
    rows[r, 1 : n + 1] = rng.integers(5, VOCAB, n)
    rows[r, n + 1] = SEP
  return rows, lengths


def _pairs(rows, partners, seeds, **overrides):
  """mlm.transform over rows in tf.data, with partner rows."""
  config = configlib.base_config().objective
  config.update(overrides)

  def packed(ids):
    is_real = ids != PAD
    return {
      'input_ids': ids,
      'segment_ids': is_real.astype(np.int32),
      'positions': np.where(is_real, np.arange(R), 0).astype(np.int32),
    }

  ds = tf.data.Dataset.from_tensor_slices(
    (packed(rows), packed(partners), seeds)
  ).map(
    lambda row, partner, seed: mlm.transform(
      row, seed, config=config, tokenizer=TOKENIZER, partner=partner
    )
  )
  return next(ds.batch(len(rows)).as_numpy_iterator())


def _seeds(num_rows, epoch=0):
  return np.stack(
    [np.full(num_rows, epoch), np.arange(num_rows)], axis=1
  ).astype(np.int64)


def _unmasked(out):
  """The pair before masking: the original ids put back at the slots."""
  ids = out['input_ids'].copy()
  for r in range(len(ids)):
    real = out['masked_weights'][r] > 0
    ids[r, out['masked_positions'][r, real]] = out['masked_ids'][r, real]
  return ids


def _split(ids):
  """(first, second) segments of an unmasked pair; second None if single."""
  seps = np.nonzero(ids == SEP)[0]
  first = ids[1 : seps[0]]
  second = ids[seps[0] + 1 : seps[1]] if len(seps) > 1 else None
  return first, second


@pytest.fixture(scope='module')
def rows():
  return _doc_rows(N)


@pytest.fixture(scope='module')
def partners(rows):
  return np.roll(rows[0], 7, axis=0), np.roll(rows[1], 7)


@pytest.fixture(scope='module')
def nsp(rows, partners):
  return _pairs(rows[0], partners[0], _seeds(N), sentence_task='nsp')


@pytest.fixture(scope='module')
def sop(rows, partners):
  return _pairs(rows[0], partners[0], _seeds(N), sentence_task='sop')


def test_row_length_and_partner():
  config = configlib.base_config()
  config.data.seq_len = 128
  assert mlm.row_length(config) == 128
  assert not mlm.needs_partner(config.objective)
  config.objective.sentence_task = 'nsp'
  assert mlm.row_length(config) == 127
  assert mlm.needs_partner(config.objective)
  config.objective.sentence_task = 'sop'
  assert mlm.row_length(config) == 127
  assert not mlm.needs_partner(config.objective)


@pytest.mark.parametrize('task', ['nsp', 'sop'])
def test_shapes_types_segments_and_positions(task, request):
  out = request.getfixturevalue(task)
  want = {
    'input_ids': ((N, L), np.int32),
    'segment_ids': ((N, L), np.int32),
    'positions': ((N, L), np.int32),
    'token_type_ids': ((N, L), np.int32),
    'input_mask': ((N, L), np.int32),
    'masked_positions': ((N, P), np.int32),
    'masked_ids': ((N, P), np.int32),
    'masked_weights': ((N, P), np.float32),
    'sentence_labels': ((N,), np.int32),
    'sentence_weights': ((N,), np.float32),
  }
  assert {k: (v.shape, v.dtype) for k, v in out.items()} == want
  ids = _unmasked(out)
  index = np.arange(L)
  size = (ids != PAD).sum(axis=1)
  real = index < size[:, None]
  np.testing.assert_array_equal(ids != PAD, real)  # padding only at the end
  # [CLS] A [SEP] B [SEP], or [CLS] piece [SEP] for an unsplit piece.
  np.testing.assert_array_equal(ids[:, 0], CLS)
  np.testing.assert_array_equal(ids[np.arange(N), size - 1], SEP)
  num_seps = (ids == SEP).sum(axis=1)
  np.testing.assert_array_equal(num_seps, 1 + out['sentence_weights'])
  first_sep = np.argmax(ids == SEP, axis=1)
  # A and B attend to each other: one segment, positions over the pair.
  np.testing.assert_array_equal(out['segment_ids'], real)
  np.testing.assert_array_equal(out['input_mask'], real)
  np.testing.assert_array_equal(out['positions'], np.where(real, index, 0))
  # Token types: 0 on [CLS] A [SEP], 1 on B [SEP], 0 on padding.
  is_b = real & (index > first_sep[:, None]) & (num_seps[:, None] == 2)
  np.testing.assert_array_equal(out['token_type_ids'], is_b)


@pytest.mark.parametrize('task', ['nsp', 'sop'])
def test_mlm_budget_counts_only_a_and_b(task, request):
  out = request.getfixturevalue(task)
  ids = _unmasked(out)
  n = (~np.isin(ids, [PAD, CLS, SEP, MASK])).sum(axis=1)
  want = np.minimum(np.maximum(np.round(0.15 * n), 1), P)
  np.testing.assert_array_equal(out['masked_weights'].sum(axis=1), want)
  # Specials are never predicted.
  chosen = np.take_along_axis(ids, out['masked_positions'], axis=1)
  assert not np.isin(chosen[out['masked_weights'] > 0], [CLS, SEP, PAD]).any()


def _check_label_rate_and_split(out, lengths):
  labels, weights = out['sentence_labels'], out['sentence_weights']
  np.testing.assert_array_equal(weights, lengths >= 2)
  pairs = weights > 0
  n = pairs.sum()
  assert abs(labels[pairs].mean() - 0.5) < 4 * math.sqrt(0.25 / n)
  assert not labels[~pairs].any()


def test_nsp_pairs(nsp, rows, partners):
  ids = _unmasked(nsp)
  (pieces, lengths), (partner_rows, partner_lengths) = rows, partners
  _check_label_rate_and_split(nsp, lengths)
  first_lengths, offsets = [], []
  for r in range(N):
    piece = pieces[r, 1 : lengths[r] + 1]
    first, second = _split(ids[r])
    if lengths[r] < 2:
      np.testing.assert_array_equal(first, piece)
      assert second is None
      continue
    first_lengths.append(len(first))
    # A is a non-empty prefix of the piece.
    assert 1 <= len(first) < lengths[r]
    np.testing.assert_array_equal(first, piece[: len(first)])
    if nsp['sentence_labels'][r] == 0:
      # IsNext: A + B is exactly the piece.
      np.testing.assert_array_equal(np.concatenate([first, second]), piece)
    else:
      # NotNext: B is as many tokens of the partner's piece as the true B
      # had (fewer if the partner is shorter), from a random offset.
      other = partner_rows[r, 1 : partner_lengths[r] + 1]
      assert len(second) == min(lengths[r] - len(first), len(other))
      starts = [
        o
        for o in range(len(other) - len(second) + 1)
        if np.array_equal(other[o : o + len(second)], second)
      ]
      assert starts
      if len(other) > len(second):
        offsets.append(starts[0] / (len(other) - len(second)))
  # The split point is uniform over 1..20 for the pieces of 21 tokens.
  counts = np.bincount(first_lengths[:400], minlength=21)[1:]
  expected = 400 / 20
  assert ((counts - expected) ** 2 / expected).sum() < 43.8  # chi2 0.999
  # Offsets are uniform over the partner's piece.
  assert len(offsets) > 300 and abs(np.mean(offsets) - 0.5) < 0.05


def test_sop_pairs(sop, rows):
  ids = _unmasked(sop)
  pieces, lengths = rows
  _check_label_rate_and_split(sop, lengths)
  for r in range(N):
    piece = pieces[r, 1 : lengths[r] + 1]
    first, second = _split(ids[r])
    if lengths[r] < 2:
      np.testing.assert_array_equal(first, piece)
      assert second is None
      continue
    assert len(first) >= 1 and len(second) >= 1
    # Label 1: the two parts of the piece, swapped; label 0: in order.
    parts = (second, first) if sop['sentence_labels'][r] else (first, second)
    np.testing.assert_array_equal(np.concatenate(parts), piece)


def test_same_seed_same_pair_other_epoch_other_pair(nsp, rows, partners):
  pieces, partner_rows = rows[0][:300], partners[0][:300]
  again = _pairs(pieces, partner_rows, _seeds(300), sentence_task='nsp')
  for key, value in again.items():
    np.testing.assert_array_equal(value, nsp[key][:300])
  other = _pairs(pieces, partner_rows, _seeds(300, 1), sentence_task='nsp')
  differ = other['sentence_labels'] != nsp['sentence_labels'][:300]
  assert 0.3 < differ.mean() < 0.7
  same_split = np.all(_unmasked(other) == _unmasked(nsp)[:300], axis=1)
  assert same_split.mean() < 0.2


@pytest.mark.parametrize('masking', ['whole_word', 'span'])
def test_word_maskings_apply_to_the_pair(masking, rows):
  pieces = rows[0][400:600]
  out = _pairs(
    pieces, pieces, _seeds(200), sentence_task='sop', masking=masking
  )
  ids = _unmasked(out)
  chosen = np.take_along_axis(ids, out['masked_positions'], axis=1)
  assert not np.isin(chosen[out['masked_weights'] > 0], [CLS, SEP, PAD]).any()
  # Every token is a word here, so the budget is met exactly.
  n = (~np.isin(ids, [PAD, CLS, SEP, MASK])).sum(axis=1)
  want = np.minimum(np.maximum(np.round(0.15 * n), 1), P)
  np.testing.assert_array_equal(out['masked_weights'].sum(axis=1), want)


def test_nsp_needs_a_partner(rows):
  config = configlib.base_config().objective
  config.sentence_task = 'nsp'
  row = {
    'input_ids': tf.constant(rows[0][0]),
    'segment_ids': tf.constant(rows[0][0] != PAD, tf.int32),
    'positions': tf.range(R),
  }
  with pytest.raises(ValueError, match='partner'):
    mlm.transform(
      row, tf.constant([0, 0], tf.int64), config=config, tokenizer=TOKENIZER
    )


def test_loss_with_sentence_task_matches_reference():
  rng = np.random.default_rng(0)
  mlm_logits = rng.normal(size=[4, 3, 9]).astype(np.float32) * 3
  masked_ids = rng.integers(0, 9, [4, 3]).astype(np.int32)
  masked_weights = np.array(
    [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], np.float32
  )
  sentence_logits = rng.normal(size=[4, 2]).astype(np.float32) * 2
  labels = np.array([0, 1, 1, 0], np.int32)
  weights = np.array([1, 1, 0, 1], np.float32)
  batch = {
    'masked_ids': masked_ids,
    'masked_weights': masked_weights,
    'sentence_labels': labels,
    'sentence_weights': weights,
  }
  outputs = {'mlm_logits': mlm_logits, 'sentence_logits': sentence_logits}
  loss, metrics = jax.jit(mlm.loss)(outputs, batch)

  def xent(logits, target):
    logits = logits.astype(np.float64)
    log_z = np.log(np.exp(logits).sum(-1))
    return log_z - np.take_along_axis(logits, target[..., None], -1)[..., 0]

  want_mlm = (xent(mlm_logits, masked_ids) * masked_weights).sum() / 6
  want_sentence = (xent(sentence_logits, labels) * weights).sum() / 3
  np.testing.assert_allclose(metrics['mlm_loss'], want_mlm, rtol=1e-5)
  np.testing.assert_allclose(metrics['sentence_loss'], want_sentence, rtol=1e-5)
  # BERT's total: the sum of the two means.
  np.testing.assert_allclose(loss, want_mlm + want_sentence, rtol=1e-5)
  np.testing.assert_allclose(metrics['loss'], loss)
  correct = (sentence_logits.argmax(-1) == labels) * weights
  np.testing.assert_allclose(metrics['sentence_accuracy'], correct.sum() / 3)
  assert metrics['num_predictions'] == 6
  # Without sentence logits the loss is MLM's alone.
  mlm_only, metrics = jax.jit(mlm.loss)({'mlm_logits': mlm_logits}, batch)
  np.testing.assert_allclose(mlm_only, want_mlm, rtol=1e-5)
  assert 'sentence_loss' not in metrics


def test_check_config_names_the_field():
  config = configlib.base_config()
  config.model.pooler = True
  config.data.packing = 'doc_sentences'
  config.objective.sentence_task = 'sop'
  mlm.check_config(config)
  config.data.packing = 'full_sentences'
  with pytest.raises(ValueError, match='data.packing'):
    mlm.check_config(config)
  config.data.packing = 'doc_sentences'
  config.model.pooler = False
  with pytest.raises(ValueError, match='model.pooler'):
    mlm.check_config(config)
  config.objective.sentence_task = 'next'
  with pytest.raises(ValueError, match='objective.sentence_task'):
    mlm.check_config(config)
