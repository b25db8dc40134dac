"""Tests for pretrain_lm.objectives.ul2: the mixture, each denoiser, lengths."""

import importlib.util
import os
import types

import numpy as np
import pytest
import tensorflow as tf

from pretrain_lm import configlib
from pretrain_lm.objectives import OBJECTIVES, clm, span_corruption, ul2

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
NUM_SENTINELS = 100
# Paradigm tokens after the sentinels: [NLU], [S2S], [NLG].
MODE_ID = {m: VOCAB + NUM_SENTINELS + i for i, m in enumerate('RSX')}
SEQ_LEN = 64
DEFAULT = configlib.base_config().objective.denoisers
# One denoiser per mode, unequal weights: the mode token names the denoiser.
DISTINCT = 'R:3:0.15:1,S:0:0.25:2,X:32:0.5:3'
NUM_ROWS = 3000


def _config(**overrides):
  config = configlib.base_config().objective
  config.update(overrides)
  return config


def concat_rows(num_rows, row_len, seed=0):
  """'concat'-packed rows, doc [SEP] doc [SEP] ..., a few padded."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 80, size=num_rows * row_len // 10)
  tokens = rng.integers(5, VOCAB, size=lengths.sum()).astype(np.int32)
  stream = np.insert(tokens, np.cumsum(lengths)[:-1], SEP)
  rows = stream[: num_rows * row_len].reshape(num_rows, row_len).copy()
  padded = rng.random(num_rows) < 0.05
  cut = rng.integers(0, row_len, size=num_rows)
  rows[padded[:, None] & (np.arange(row_len) >= cut[:, None])] = PAD
  return rows


def seeds_for(num_rows, epoch=0):
  return np.stack(
    [np.full(num_rows, epoch), np.arange(num_rows)], axis=1
  ).astype(np.int64)


def run(rows, seeds, transform, **overrides):
  config = _config(**overrides)
  ds = tf.data.Dataset.from_tensor_slices(({'input_ids': rows}, seeds)).map(
    lambda row, seed: transform(row, seed, config=config, tokenizer=TOKENIZER)
  )
  return next(ds.batch(len(rows)).as_numpy_iterator())


def text(row):
  return row[row >= 5]


def is_sentinel(ids):
  return (ids >= VOCAB) & (ids < VOCAB + NUM_SENTINELS)


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


def reconstruct(mode, inputs, targets):
  """The text a denoised example stands for."""
  if mode == 'S':
    assert not is_sentinel(inputs).any() and not is_sentinel(targets).any()
    return np.concatenate([inputs, targets])
  return merge(inputs, targets)


def seq2seq_examples(out):
  """(mode, inputs body, targets body) per row of encoder-decoder features."""
  modes = {v: k for k, v in MODE_ID.items()}
  examples = []
  for enc, tgt in zip(out['encoder_input_ids'], out['target_ids'], strict=True):
    n_in, n_tg = int((enc != PAD).sum()), int((tgt != PAD).sum())
    assert enc[n_in - 1] == SEP and tgt[n_tg - 1] == SEP
    # [mode] and the final [SEP]s are the only tokens outside text and
    # sentinels.
    body = np.concatenate([enc[1 : n_in - 1], tgt[: n_tg - 1]])
    assert (body >= 5).all() and (body < VOCAB + NUM_SENTINELS).all()
    examples.append((modes[int(enc[0])], enc[1 : n_in - 1], tgt[: n_tg - 1]))
  return examples


def counts(mode, n, denoiser, inputs, targets):
  """Observed and expected (noise, spans) of a row, or (t, None) for S."""
  if mode == 'S':
    return len(targets), None
  spans = int(is_sentinel(inputs).sum())
  observed = (len(targets) - spans, spans)
  expected = span_corruption.noise_counts(
    n, denoiser.density, denoiser.mean_span
  )
  return observed, expected


@pytest.fixture(scope='module')
def raw_length():
  return ul2.lengths(SEQ_LEN, DEFAULT)[0]


@pytest.fixture(scope='module')
def default_rows(raw_length):
  return concat_rows(NUM_ROWS, raw_length)


@pytest.fixture(scope='module')
def default_out(default_rows):
  return run(default_rows, seeds_for(NUM_ROWS), ul2.transform)


def test_registered():
  assert OBJECTIVES['ul2'] is ul2
  assert OBJECTIVES['ul2_decoder'] is ul2.DECODER
  assert ul2.FAMILIES == ('encoder_decoder',)
  assert ul2.DECODER.FAMILIES == ('decoder',)
  assert ul2.loss is clm.loss and ul2.DECODER.loss is clm.loss
  assert ul2.num_reserved_ids(_config()) == NUM_SENTINELS + 3
  assert ul2.DECODER.num_reserved_ids(_config(num_sentinels=7)) == 10


def test_parse_denoisers():
  assert ul2.parse_denoisers('r:3:0.15:1, S:0:0.25:2') == (
    ul2.Denoiser('R', 3.0, 0.15, 1.0),
    ul2.Denoiser('S', 0.0, 0.25, 2.0),
  )
  assert len(ul2.parse_denoisers(DEFAULT)) == 7


@pytest.mark.parametrize(
  'spec',
  [
    '',
    'R:3:0.15',
    'Q:3:0.15:1',
    'R:a:0.15:1',
    'R:3:0.15:0',
    'R:3:1.5:1',
    'X:0.5:0.5:1',
    'S:0:0.7:1',
    'R:3:0.15:1,',
  ],
)
def test_bad_denoisers_are_clear_errors(spec):
  with pytest.raises(ValueError, match='objective.denoisers') as error:
    ul2.parse_denoisers(spec)
  assert 'mode:mean_span:density:weight' in str(error.value)


def test_lengths():
  def fits(n, seq_len, denoisers):
    return all(
      ul2._bodies(d)(m)[0] + 2 <= seq_len
      for d in denoisers
      for m in range(n + 1)
    )

  # X with spans of 3 at 50% noise sets the target length: on 511 tokens,
  # 256 noise in 85 spans, + [SEP].
  assert ul2.lengths(512, DEFAULT) == (511, 512, 342)
  for seq_len, spec in ((64, DEFAULT), (100, 'R:3:0.15:1,X:8:0.5:1')):
    denoisers = ul2.parse_denoisers(spec)
    raw, inputs, targets = ul2.lengths(seq_len, spec)
    assert fits(raw, seq_len, denoisers) and not fits(
      raw + 1, seq_len, denoisers
    )
    assert inputs == seq_len
    assert targets == 1 + max(
      ul2._bodies(d)(m)[1] for d in denoisers for m in range(raw + 1)
    )
  c = configlib.base_config()
  c.data.seq_len = 512
  assert ul2.row_length(c) == 511
  assert ul2.DECODER.row_length(c) == 513


def test_static_shapes(default_out, raw_length):
  _, inputs, targets = ul2.lengths(SEQ_LEN, DEFAULT)
  assert inputs == SEQ_LEN
  for key, value in default_out.items():
    length = SEQ_LEN if key.startswith('encoder_') else targets
    assert value.shape == (NUM_ROWS, length), key


def _frequencies(modes, weights):
  """Asserts mode frequencies within 4 standard errors of the weights."""
  total = sum(weights.values())
  for mode, weight in weights.items():
    p = weight / total
    tolerance = 4 * np.sqrt(p * (1 - p) / len(modes))
    assert np.mean(np.array(modes) == mode) == pytest.approx(p, abs=tolerance)


def test_default_mixture(default_out, default_rows):
  examples = seq2seq_examples(default_out)
  # Two R, one S and four X denoisers, equal weights.
  _frequencies([m for m, _, _ in examples], {'R': 2, 'S': 1, 'X': 4})
  denoisers = ul2.parse_denoisers(DEFAULT)
  for row, (mode, inputs, targets) in zip(default_rows, examples, strict=True):
    np.testing.assert_array_equal(reconstruct(mode, inputs, targets), text(row))
    # The counts are those of one of the mode's denoisers.
    n = len(text(row))
    candidates = [d for d in denoisers if d.mode == mode]
    if mode != 'S':
      assert any(
        counts(mode, n, d, inputs, targets)[0]
        == counts(mode, n, d, inputs, targets)[1]
        for d in candidates
      )


def test_distinct_mixture_per_denoiser_statistics():
  raw = ul2.lengths(SEQ_LEN, DISTINCT)[0]
  rows = concat_rows(NUM_ROWS, raw, seed=1)
  out = run(rows, seeds_for(NUM_ROWS), ul2.transform, denoisers=DISTINCT)
  examples = seq2seq_examples(out)
  _frequencies([m for m, _, _ in examples], {'R': 1, 'S': 2, 'X': 3})
  denoisers = {d.mode: d for d in ul2.parse_denoisers(DISTINCT)}
  noise = {'R': 0, 'X': 0}
  tokens = {'R': 0, 'X': 0, 'S': 0}
  s_targets, s_position = 0, []
  for row, (mode, inputs, targets) in zip(rows, examples, strict=True):
    n = len(text(row))
    np.testing.assert_array_equal(reconstruct(mode, inputs, targets), text(row))
    tokens[mode] += n
    if mode == 'S':
      t = len(targets)
      if n >= 2:
        most = ul2._max_target(n, 0.25)
        assert 1 <= t <= most and len(inputs) >= 1
        if most > 1:
          s_position.append((t - 1) / (most - 1))
      s_targets += t
      continue
    observed, expected = counts(mode, n, denoisers[mode], inputs, targets)
    assert observed == expected
    noise[mode] += observed[0]
  # The definitions' densities; the S target length is uniform over 1..m.
  assert noise['R'] / tokens['R'] == pytest.approx(0.15, abs=0.01)
  assert noise['X'] / tokens['X'] == pytest.approx(0.5, abs=0.01)
  assert s_targets / tokens['S'] == pytest.approx(0.25, abs=0.015)
  assert np.mean(s_position) == pytest.approx(0.5, abs=0.03)
  hist = np.histogram(s_position, bins=4, range=(0, 1))[0] / len(s_position)
  np.testing.assert_allclose(hist, 0.25, atol=0.05)


def test_mean_span_lengths_on_long_rows():
  spec = 'R:3:0.15:1,X:8:0.5:1'
  raw = ul2.lengths(512, spec)[0]
  rows = concat_rows(400, raw, seed=2)
  out = run(rows, seeds_for(400), ul2.transform, denoisers=spec)
  noise, spans = {'R': 0, 'X': 0}, {'R': 0, 'X': 0}
  for mode, inputs, targets in seq2seq_examples(out):
    k = int(is_sentinel(inputs).sum())
    spans[mode] += k
    noise[mode] += len(targets) - k
  assert noise['R'] / spans['R'] == pytest.approx(3.0, abs=0.1)
  assert noise['X'] / spans['X'] == pytest.approx(8.0, abs=0.3)


def test_same_seed_same_example_new_epoch_new_noise(default_rows):
  # One run per transform: the rows twice with the epoch-0 seeds, then once
  # with epoch 1's.
  for transform, rows in (
    (ul2.transform, default_rows[:100]),
    (ul2.decoder_transform, concat_rows(100, SEQ_LEN + 1)),
  ):
    seeds = np.concatenate(
      [seeds_for(100), seeds_for(100), seeds_for(100, epoch=1)]
    )
    out = run(np.concatenate([rows] * 3), seeds, transform)
    for value in out.values():
      np.testing.assert_array_equal(value[:100], value[100:200])
    ids = out.get('encoder_input_ids', out.get('input_ids'))
    assert (ids[:100] != ids[200:]).any(1).mean() > 0.9


def test_too_few_sentinels_is_a_clear_error(default_rows):
  with pytest.raises(ValueError, match='objective.num_sentinels=3'):
    run(default_rows[:2], seeds_for(2), ul2.transform, num_sentinels=3)


def test_check_config_fails_before_any_data_work():
  c = configlib.base_config()
  for check in (ul2.check_config, ul2.DECODER.check_config):
    check(c)
    c.objective.num_sentinels = 10  # 16 to 21 spans on 128 tokens
    with pytest.raises(ValueError, match='objective.num_sentinels=10'):
      check(c)
    c.objective.num_sentinels = 100
    c.objective.denoisers = 'R:3:0.15'
    with pytest.raises(ValueError, match='objective.denoisers'):
      check(c)
    c.objective.denoisers = DEFAULT


def test_decoder_only():
  rows = concat_rows(2000, SEQ_LEN + 1, seed=3)
  out = run(rows, seeds_for(2000), ul2.decoder_transform)
  for key, value in out.items():
    assert value.shape == (2000, SEQ_LEN), key
  denoisers = ul2.parse_denoisers(DEFAULT)
  limits = ul2.decoder_token_limits(SEQ_LEN, denoisers)
  modes_by_id = {v: k for k, v in MODE_ID.items()}
  modes, used = [], []
  for r in range(2000):
    ids, targets = out['input_ids'][r], out['target_ids'][r]
    weights, prefix = out['target_weights'][r], out['prefix_mask'][r]
    # Each input predicts the next token.
    np.testing.assert_array_equal(targets[:-1], ids[1:])
    sequence = np.append(ids, targets[-1])
    sequence = sequence[: int((sequence != PAD).sum())]
    real = out['segment_ids'][r]
    np.testing.assert_array_equal(real, np.arange(SEQ_LEN) < len(sequence))
    np.testing.assert_array_equal(
      out['positions'][r], np.where(real > 0, np.arange(SEQ_LEN), 0)
    )
    mode = modes_by_id[int(sequence[0])]
    modes.append(mode)
    num_prefix = int(prefix.sum())
    np.testing.assert_array_equal(prefix, np.arange(SEQ_LEN) < num_prefix)
    assert sequence[num_prefix - 1] == SEP and sequence[-1] == SEP
    # Weighted exactly where the next token is a target or the final [SEP].
    index = np.arange(SEQ_LEN)
    np.testing.assert_array_equal(
      weights, (index >= num_prefix - 1) & (index < len(sequence) - 1)
    )
    inputs = sequence[1 : num_prefix - 1]
    target_body = sequence[num_prefix:-1]
    body = np.concatenate([inputs, target_body])
    assert (body >= 5).all() and (body < VOCAB + NUM_SENTINELS).all()
    merged = reconstruct(mode, inputs, target_body)
    # A start of the row's text: as much as the drawn denoiser fits.
    row_text = text(rows[r])
    np.testing.assert_array_equal(merged, row_text[: len(merged)])
    assert len(merged) in {
      min(len(row_text), limit)
      for d, limit in zip(denoisers, limits, strict=True)
      if d.mode == mode
    }
    if len(row_text):
      used.append(len(merged) / len(row_text))
  _frequencies(modes, {'R': 2, 'S': 1, 'X': 4})
  # Every denoiser fits the sequence length.
  assert (
    max(
      ul2._bodies(d)(limit)[0] + ul2._bodies(d)(limit)[1] + 3
      for d, limit in zip(denoisers, limits, strict=True)
    )
    <= SEQ_LEN + 1
  )
  assert np.mean(used) > 0.7


def _config_file(arg):
  path = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), 'configs', 'ul2.py'
  )
  spec = importlib.util.spec_from_file_location('ul2_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_config_file():
  c = _config_file(None)
  assert (c.model.family, c.objective.name) == ('encoder_decoder', 'ul2')
  assert c.model.activation == 'geglu' and c.model.size == 'base'
  assert c.objective.denoisers == DEFAULT
  c = _config_file('decoder')
  assert (c.model.family, c.objective.name) == ('decoder', 'ul2_decoder')
  assert c.model.size == 'small'
  for arg in ('size=tiny', 'size=tiny,decoder'):
    c = _config_file(arg)
    assert c.data.seq_len == 128 and c.model.vocab_size == 8192
