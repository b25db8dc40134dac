"""Tests for pretrain_lm.objectives.span_corruption against T5's definition."""

import math
import types

import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from pretrain_lm import configlib
from pretrain_lm.data import pipeline
from pretrain_lm.objectives import OBJECTIVES, clm, span_corruption

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
VOCAB = 60
TOKENIZER = types.SimpleNamespace(
  pad_id=PAD,
  unk_id=UNK,
  cls_id=CLS,
  sep_id=SEP,
  mask_id=MASK,
  first_normal_id=5,
  vocab_size=VOCAB,
)
SEQ_LEN = 64
RAW, INPUTS, TARGETS = span_corruption.lengths(SEQ_LEN, 0.15, 3.0)
NUM_ROWS = 3000


def _config(**overrides):
  config = configlib.base_config().objective
  config.name = 'span_corruption'
  config.update(overrides)
  return config


def concat_rows(num_rows, row_len, seed=0, pad_fraction=0.1):
  """'concat'-packed rows: doc [SEP] doc [SEP] ..., some padded at the end."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 60, size=num_rows * row_len // 10)
  tokens = rng.integers(5, VOCAB, size=lengths.sum()).astype(np.int32)
  stream = np.insert(tokens, np.cumsum(lengths)[:-1], SEP)
  rows = stream[: num_rows * row_len].reshape(num_rows, row_len).copy()
  # Short last rows of an epoch: a random tail of [PAD]s (sometimes all).
  padded = rng.random(num_rows) < pad_fraction
  cut = rng.integers(0, row_len, size=num_rows)
  rows[padded[:, None] & (np.arange(row_len) >= cut[:, None])] = PAD
  return rows


def seeds_for(num_rows, epoch=0):
  return np.stack(
    [np.full(num_rows, epoch), np.arange(num_rows)], axis=1
  ).astype(np.int64)


def run(rows, seeds, config=None, module=span_corruption, batch=None):
  """The transform over rows inside tf.data, as the pipeline runs it."""
  config = config or _config()
  ds = tf.data.Dataset.from_tensor_slices(({'input_ids': rows}, seeds)).map(
    lambda row, seed: module.transform(
      row, seed, config=config, tokenizer=TOKENIZER
    )
  )
  return next(ds.batch(batch or len(rows)).as_numpy_iterator())


def text(row):
  return row[~np.isin(row, [PAD, CLS, SEP, MASK])]


def is_sentinel(ids):
  return ids >= VOCAB


def split_example(inputs, targets):
  """Unpadded bodies: inputs and targets without their final [SEP]."""
  n_in = int(np.sum(inputs != PAD))
  n_tg = int(np.sum(targets != PAD))
  assert inputs[n_in - 1] == SEP and targets[n_tg - 1] == SEP
  return inputs[: n_in - 1], targets[: n_tg - 1]


def merge(inputs, targets):
  """Each sentinel of the inputs replaced by the target tokens after it."""
  spans, current = {}, None
  for token in targets:
    if is_sentinel(token):
      current = int(token)
      spans[current] = []
    else:
      spans[current].append(int(token))
  merged = []
  for token in inputs:
    merged.extend(spans[int(token)] if is_sentinel(token) else [int(token)])
  return np.array(merged, np.int32)


def span_lengths(inputs, targets):
  """(kept span lengths, noise span lengths), in row order."""
  kept = np.diff(np.flatnonzero(np.r_[True, is_sentinel(inputs)])) - 1
  noise = np.diff(np.flatnonzero(np.r_[is_sentinel(targets), True])) - 1
  return kept, noise


@pytest.fixture(scope='module')
def rows():
  return concat_rows(NUM_ROWS, RAW)


@pytest.fixture(scope='module')
def out(rows):
  return run(rows, seeds_for(NUM_ROWS))


def test_registered():
  assert OBJECTIVES['span_corruption'] is span_corruption
  assert span_corruption.FAMILIES == ('encoder_decoder',)
  assert span_corruption.num_reserved_ids(_config(num_sentinels=7)) == 7
  assert span_corruption.loss is clm.loss


def test_lengths_match_t5():
  # T5's published setting: 568 raw tokens -> 512 inputs, 114 targets.
  assert span_corruption.lengths(512, 0.15, 3.0) == (568, 512, 114)


@pytest.mark.parametrize(
  'seq_len, density, mean', [(64, 0.15, 3.0), (100, 0.5, 8.0), (33, 0.3, 2.5)]
)
def test_lengths_are_the_largest_that_fit(seq_len, density, mean):
  def sizes(n):
    noise, spans = span_corruption.noise_counts(n, density, mean)
    return n - noise + spans + 1, noise + spans + 1

  raw, inputs, targets = span_corruption.lengths(seq_len, density, mean)
  assert max(sizes(n)[0] for n in range(raw + 1)) == inputs == seq_len
  assert sizes(raw + 1)[0] > seq_len
  assert max(sizes(n)[1] for n in range(raw + 1)) == targets


def test_row_length_uses_data_seq_len():
  c = configlib.base_config()
  c.objective.name = 'span_corruption'
  c.data.seq_len = 512
  assert span_corruption.row_length(c) == 568


def test_static_shapes_and_dtypes(out):
  want = {
    'encoder_input_ids': ((NUM_ROWS, SEQ_LEN), np.int32),
    'encoder_segment_ids': ((NUM_ROWS, SEQ_LEN), np.int32),
    'encoder_positions': ((NUM_ROWS, SEQ_LEN), np.int32),
    'decoder_input_ids': ((NUM_ROWS, TARGETS), np.int32),
    'decoder_segment_ids': ((NUM_ROWS, TARGETS), np.int32),
    'decoder_positions': ((NUM_ROWS, TARGETS), np.int32),
    'target_ids': ((NUM_ROWS, TARGETS), np.int32),
    'target_weights': ((NUM_ROWS, TARGETS), np.float32),
  }
  assert {k: (v.shape, v.dtype) for k, v in out.items()} == want


def test_counts_follow_the_definition(out, rows):
  noise_total = spans_total = n_total = 0
  for r in range(NUM_ROWS):
    inputs, targets = split_example(
      out['encoder_input_ids'][r], out['target_ids'][r]
    )
    n = len(text(rows[r]))
    num_spans = int(is_sentinel(inputs).sum())
    num_noise = len(targets) - num_spans
    assert (num_noise, num_spans) == span_corruption.noise_counts(n, 0.15, 3.0)
    noise_total, spans_total, n_total = (
      noise_total + num_noise,
      spans_total + num_spans,
      n_total + n,
    )
  assert noise_total / n_total == pytest.approx(0.15, abs=0.005)
  # Rounding num_spans on ~65 tokens (10 noise, 3 spans) lengthens the
  # mean span here, as in T5; T5's own lengths show the mean of 3 below.
  assert noise_total / spans_total == pytest.approx(3.3, abs=0.1)


def test_t5_length_rows_have_density_and_mean_span():
  raw = span_corruption.lengths(512, 0.15, 3.0)[0]
  rows = concat_rows(1000, raw, seed=5, pad_fraction=0.0)
  out = run(rows, seeds_for(1000))
  targets = out['target_ids']
  num_spans = is_sentinel(targets).sum()
  num_noise = (targets >= 5).sum() - num_spans
  n = (rows >= 5).sum()
  assert num_noise / n == pytest.approx(0.15, abs=0.002)
  assert num_noise / num_spans == pytest.approx(3.0, abs=0.05)


def test_spans_alternate_and_sentinels_are_ordered(out, rows):
  for r in range(NUM_ROWS):
    inputs, targets = split_example(
      out['encoder_input_ids'][r], out['target_ids'][r]
    )
    if len(text(rows[r])) < 2:
      assert not is_sentinel(inputs).any() and len(targets) == 0
      continue
    k = int(is_sentinel(inputs).sum())
    sentinels = VOCAB + np.arange(k)
    # Each sentinel once, in increasing order, in both.
    np.testing.assert_array_equal(inputs[is_sentinel(inputs)], sentinels)
    np.testing.assert_array_equal(targets[is_sentinel(targets)], sentinels)
    # non-noise, noise, ..., non-noise, noise: every span non-empty.
    kept, noise = span_lengths(inputs, targets)
    assert len(kept) == len(noise) == k
    assert (kept >= 1).all() and (noise >= 1).all()
    assert not is_sentinel(inputs[0]) and is_sentinel(inputs[-1])
    assert is_sentinel(targets[0]) and not is_sentinel(targets[-1])


def test_merging_recovers_the_rows_text(out, rows):
  for r in range(NUM_ROWS):
    inputs, targets = split_example(
      out['encoder_input_ids'][r], out['target_ids'][r]
    )
    np.testing.assert_array_equal(merge(inputs, targets), text(rows[r]))


def test_only_text_sentinels_and_a_final_sep(out):
  for key, weights in (
    ('encoder_input_ids', out['encoder_segment_ids']),
    ('target_ids', out['target_weights']),
  ):
    ids = out[key]
    real = weights > 0
    last = real.sum(1) - 1
    np.testing.assert_array_equal(ids[np.arange(NUM_ROWS), last], SEP)
    body = real.copy()
    body[np.arange(NUM_ROWS), last] = False
    assert (ids[body] >= 5).all()  # no [PAD]/[UNK]/[CLS]/[SEP]/[MASK]
    np.testing.assert_array_equal(ids[~real], PAD)
    # Real tokens first, then padding.
    np.testing.assert_array_equal(
      real, np.arange(ids.shape[1]) <= last[:, None]
    )


def test_decoder_features(out):
  real = out['target_weights'] > 0
  np.testing.assert_array_equal(out['decoder_segment_ids'], real)
  np.testing.assert_array_equal(
    out['decoder_positions'], np.where(real, np.arange(TARGETS), 0)
  )
  np.testing.assert_array_equal(
    out['encoder_positions'],
    np.where(out['encoder_segment_ids'] > 0, np.arange(SEQ_LEN), 0),
  )
  shifted = np.concatenate(
    [np.full([NUM_ROWS, 1], CLS), out['target_ids'][:, :-1]], axis=1
  )
  np.testing.assert_array_equal(
    out['decoder_input_ids'], np.where(real, shifted, 0)
  )


def composition_cdf(total, parts):
  """CDF of one part of a uniformly random composition into positive parts."""
  j = np.arange(1, total - parts + 2)
  pmf = np.array([math.comb(total - i - 1, parts - 2) for i in j])
  return np.cumsum(pmf / math.comb(total - 1, parts - 1))


def test_span_lengths_are_uniform_compositions():
  # Full rows without separators: n = RAW every time, so the counts are
  # fixed and each span's length has a known distribution.
  rng = np.random.default_rng(1)
  rows = rng.integers(5, VOCAB, size=[NUM_ROWS, RAW]).astype(np.int32)
  out = run(rows, seeds_for(NUM_ROWS, epoch=3))
  # A full row fills the encoder exactly, as in T5.
  np.testing.assert_array_equal(out['encoder_segment_ids'], 1)
  num_noise, k = span_corruption.noise_counts(RAW, 0.15, 3.0)
  assert k >= 3
  kept, noise = [], []
  for r in range(NUM_ROWS):
    lengths = span_lengths(
      *split_example(out['encoder_input_ids'][r], out['target_ids'][r])
    )
    kept.append(lengths[0])
    noise.append(lengths[1])
  for spans, total in (
    (np.array(kept), RAW - num_noise),
    (np.array(noise), num_noise),
  ):
    assert spans.shape == (NUM_ROWS, k)
    np.testing.assert_array_equal(spans.sum(1), total)
    cdf = composition_cdf(total, k)
    # The first, a middle and the last span: all share the one law
    # (Kolmogorov-Smirnov distance, 1% level for 3000 draws is ~0.03).
    for position in (0, k // 2, k - 1):
      counts = np.bincount(spans[:, position], minlength=len(cdf) + 1)[1:]
      empirical = np.cumsum(counts) / NUM_ROWS
      assert np.abs(empirical - cdf).max() < 0.035, (total, position)


def test_same_seed_same_noise_new_epoch_new_noise(rows):
  # One run: the rows twice with the epoch-0 seeds, then with epoch 1's.
  seeds = np.concatenate([seeds_for(200), seeds_for(200), seeds_for(200, 1)])
  out = run(np.concatenate([rows[:200]] * 3), seeds)
  for value in out.values():
    np.testing.assert_array_equal(value[:200], value[200:400])
  ids = out['encoder_input_ids']
  assert (ids[:200] != ids[400:]).any(1).mean() > 0.9


def test_short_rows():
  rows = np.zeros([3, RAW], np.int32)  # all padding
  rows[1, :2] = [7, SEP]  # one token
  rows[2, :3] = [SEP, 8, 9]  # two tokens: one kept, one noise
  out = run(rows, seeds_for(3))
  np.testing.assert_array_equal(out['encoder_input_ids'][0, :2], [SEP, PAD])
  np.testing.assert_array_equal(out['encoder_input_ids'][1, :3], [7, SEP, PAD])
  np.testing.assert_array_equal(out['target_ids'][:2, :2], [[SEP, 0]] * 2)
  np.testing.assert_array_equal(
    out['encoder_input_ids'][2, :4], [8, VOCAB, SEP, PAD]
  )
  np.testing.assert_array_equal(out['target_ids'][2, :4], [VOCAB, 9, SEP, 0])


def test_too_few_sentinels_is_a_clear_error():
  rows = concat_rows(2, RAW)
  with pytest.raises(ValueError, match='objective.num_sentinels=2'):
    run(rows, seeds_for(2), _config(num_sentinels=2))


def test_check_config_fails_before_any_data_work():
  c = configlib.base_config()
  c.objective.name = 'span_corruption'
  span_corruption.check_config(c)
  c.objective.num_sentinels = 5  # 141 raw tokens need up to 7 spans
  with pytest.raises(ValueError, match='objective.num_sentinels=5'):
    span_corruption.check_config(c)
  c.objective.mean_span_length = 0.5
  with pytest.raises(ValueError, match='objective.mean_span_length'):
    span_corruption.check_config(c)


def test_bad_density_is_a_clear_error():
  with pytest.raises(ValueError, match='objective.noise_density'):
    span_corruption.lengths(64, 1.5, 3.0)


def test_rows_from_the_real_packer():
  rng = np.random.default_rng(2)
  docs = [
    rng.integers(5, VOCAB, size=rng.integers(1, 90)).astype(np.int32)
    for _ in range(300)
  ]
  packed = pipeline.pack(
    tf.data.Dataset.from_generator(
      lambda: iter(docs), output_signature=tf.TensorSpec([None], tf.int32)
    ),
    row_len=RAW,
    packing='concat',
    cls_id=CLS,
    sep_id=SEP,
    pad_id=PAD,
  )
  rows = np.stack([r['input_ids'] for r in packed.as_numpy_iterator()])
  out = run(rows, seeds_for(len(rows)))
  merged = [
    merge(*split_example(out['encoder_input_ids'][r], out['target_ids'][r]))
    for r in range(len(rows))
  ]
  # Rows together hold every document's tokens, in order, without [SEP]s.
  np.testing.assert_array_equal(np.concatenate(merged), np.concatenate(docs))


def test_loss_matches_numpy():
  rng = np.random.default_rng(3)
  logits = rng.normal(size=[2, 5, 11]).astype(np.float32)
  labels = rng.integers(0, 11, size=[2, 5]).astype(np.int32)
  weights = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)
  loss, metrics = span_corruption.loss(
    {'logits': jnp.asarray(logits)},
    {'target_ids': jnp.asarray(labels), 'target_weights': jnp.asarray(weights)},
  )
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  picked = np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
  want = -(picked * weights).sum() / weights.sum()
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert float(metrics['num_predictions']) == 8


def test_t5_config_defaults_to_span_corruption():
  import importlib.util
  import os

  path = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), 'configs', 't5.py'
  )
  spec = importlib.util.spec_from_file_location('t5_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for arg in ('size=base', 'size=tiny', 'size=small,v1_1'):
    c = module.get_config(arg)
    assert c.objective.name == 'span_corruption'
  c = module.get_config('size=base')
  assert (c.data.seq_len, c.objective.noise_density) == (512, 0.15)
  assert c.objective.mean_span_length == 3.0
  assert span_corruption.lengths(512, 0.15, 3.0)[2] == 114
