"""Tests for pretrain_lm.objectives.denoising: BART's noises by definition.

Each noise runs alone (or at the paper setting) over a few thousand packed
rows inside tf.data, and its output is checked against the definition in
Lewis et al. (2020), section 2.2: rates, the Poisson span lengths, one
token per span, sentence multisets, rotations; specials never corrupted;
the decoder's targets exactly the original row.
"""

import math
import types

import numpy as np
import pytest
import tensorflow as tf

from pretrain_lm import configlib
from pretrain_lm.objectives import OBJECTIVES, clm, denoising

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIALS = (PAD, CLS, SEP, MASK)
VOCAB = 1000
# Ids 5..9 end a sentence ('x. ' too: trailing space is ignored); 10 has a
# '.' inside only; the rest are words.
PUNCT = (5, 6, 7, 8, 9)
WORD0 = 10
TEXTS = ['', '', '', '', '', '.', ' end.', '!', ' why?', 'x. ', ' a.b'] + [
  f' w{i}' for i in range(11, VOCAB)
]
ENDS = np.array([t.rstrip().endswith(('.', '!', '?')) for t in TEXTS])
TOKENIZER = types.SimpleNamespace(
  pad_id=PAD,
  unk_id=UNK,
  cls_id=CLS,
  sep_id=SEP,
  mask_id=MASK,
  first_normal_id=5,
  vocab_size=VOCAB,
  piece_texts=lambda: list(TEXTS),
)
R = 128
OFF = dict(
  permute_sentences=0.0,
  token_mask_rate=0.0,
  delete_rate=0.0,
  infill_rate=0.0,
  infill_random_rate=0.0,
  rotate_rate=0.0,
)


def _config(**overrides):
  config = configlib.base_config().objective
  config.name = 'denoising'
  config.update(overrides)
  return config


def _rows(num_rows, seed=0, row_len=R, punct_end=False):
  """Packed-looking rows: [CLS] doc [SEP] doc [SEP] ... [PAD]*.

  Words, with a sentence-final piece at 15% of the places and a document
  end ([SEP]) at 4%, so a document's last sentence often lacks its final
  piece. Most rows are full, as 'full_sentences' packs them; some end early
  or with one [PAD]. With `punct_end` the row's last body token ends a
  sentence.
  """
  rng = np.random.default_rng(seed)
  shape = [num_rows, row_len]
  rows = rng.integers(WORD0 + 1, VOCAB, shape)
  draw = rng.random(shape)
  rows = np.where(draw < 0.15, rng.choice(PUNCT, shape), rows)
  is_sep = (draw > 0.96) & (np.arange(row_len) > 1)
  # No empty documents: no [SEP] right after another.
  is_sep[:, 1:] &= ~is_sep[:, :-1]
  rows = np.where(is_sep, SEP, rows)
  n = row_len - rng.choice(
    [0, 1, row_len // 4, row_len // 2], num_rows, p=[0.8, 0.1, 0.05, 0.05]
  )
  r = np.arange(num_rows)
  # The body's last token: never a [SEP] (an empty last document).
  fix = punct_end | (rows[r, n - 2] == SEP)
  rows[r, n - 2] = np.where(fix, rng.choice(PUNCT, num_rows), rows[r, n - 2])
  rows[r, n - 1] = SEP
  rows[np.arange(row_len) >= n[:, None]] = PAD
  rows[:, 0] = CLS
  return rows.astype(np.int32)


def _seeds(num_rows, epoch=0):
  return np.stack(
    [np.full(num_rows, epoch), np.arange(num_rows)], axis=1
  ).astype(np.int64)


def _features(rows):
  segment_ids = (rows != PAD).astype(np.int32)
  return {
    'input_ids': rows,
    'segment_ids': segment_ids,
    'positions': np.where(segment_ids > 0, np.arange(rows.shape[1]), 0),
  }


def _transform(rows, seeds=None, **overrides):
  """Runs the transform over rows inside tf.data, as the pipeline does."""
  config = _config(**overrides)
  seeds = _seeds(len(rows)) if seeds is None else seeds
  ds = tf.data.Dataset.from_tensor_slices((_features(rows), seeds)).map(
    lambda row, seed: denoising.transform(
      row, seed, config=config, tokenizer=TOKENIZER
    )
  )
  return next(ds.batch(len(rows)).as_numpy_iterator())


def _noise(rows, **overrides):
  """denoising.noise over rows: (ids, n, the infilled spans)."""
  config = _config(**overrides)

  def run(ids, seed):
    n = tf.reduce_sum(tf.cast(ids != PAD, tf.int32))
    return denoising.noise(
      ids,
      n,
      seed,
      config=config,
      tokenizer=TOKENIZER,
      ends=tf.constant(ENDS),
    )

  ds = tf.data.Dataset.from_tensor_slices((rows, _seeds(len(rows)))).map(run)
  return next(ds.batch(len(rows)).as_numpy_iterator())


def _n(ids):
  return (ids != PAD).sum(axis=-1)


def _sentences(body):
  """The definition: a sentence ends after a sentence-final piece (unless a
  [SEP] follows, which it keeps), at a [SEP] and at the body's end."""
  out, sentence = [], []
  for k, token in enumerate(body):
    sentence.append(int(token))
    following = body[k + 1] if k + 1 < len(body) else None
    if token == SEP or (ENDS[token] and following != SEP) or following is None:
      out.append(tuple(sentence))
      sentence = []
  return out


def _is_text(ids):
  return ~np.isin(ids, SPECIALS)


@pytest.fixture(scope='module')
def rows():
  return _rows(2000)


@pytest.fixture(scope='module')
def paper(rows):
  """The paper's BART-large setting: base_config's defaults."""
  return _transform(rows)


def test_registered_and_defaults_are_the_papers():
  assert OBJECTIVES['denoising'] is denoising
  assert denoising.FAMILIES == ('encoder_decoder',)
  assert denoising.loss is clm.loss  # the seq2seq token cross-entropy
  c = _config()
  assert (c.infill_rate, c.poisson_lambda, c.infill_random_rate) == (
    0.3,
    3.5,
    0.1,
  )
  assert c.permute_sentences == 1.0
  assert c.rotate_rate == c.delete_rate == c.token_mask_rate == 0.0


def test_sentence_end_table():
  table = denoising.sentence_end_table(['', '.', ' end.', 'x!  ', '?', 'a.b'])
  np.testing.assert_array_equal(table, [0, 1, 1, 1, 1, 0])
  np.testing.assert_array_equal(denoising.sentence_end_table(TEXTS), ENDS)


def test_decoder_reads_and_predicts_the_original_row(paper, rows):
  n = _n(rows)
  real = np.arange(R) < n[:, None]
  np.testing.assert_array_equal(paper['decoder_input_ids'], rows)
  shifted = np.concatenate([rows[:, 1:], np.zeros([len(rows), 1], int)], 1)
  np.testing.assert_array_equal(paper['target_ids'], shifted)
  # Every token after [CLS] is predicted, the final [SEP] included.
  np.testing.assert_array_equal(paper['target_weights'], shifted != PAD)
  assert paper['target_weights'].sum(1).tolist() == (n - 1).tolist()
  # One segment over the row, whatever documents it packs.
  np.testing.assert_array_equal(paper['decoder_segment_ids'], real)
  np.testing.assert_array_equal(
    paper['decoder_positions'], np.where(real, np.arange(R), 0)
  )


def test_shapes_and_encoder_segments(paper, rows):
  for key, value in paper.items():
    assert value.shape == (len(rows), R), key
    assert value.dtype == (np.float32 if key == 'target_weights' else np.int32)
  ids = paper['encoder_input_ids']
  n = _n(ids)
  real = np.arange(R) < n[:, None]
  # Padding only at the end; one segment; positions 0..n-1.
  np.testing.assert_array_equal(ids != PAD, real)
  np.testing.assert_array_equal(paper['encoder_segment_ids'], real)
  np.testing.assert_array_equal(
    paper['encoder_positions'], np.where(real, np.arange(R), 0)
  )


def test_paper_setting_never_corrupts_specials(paper, rows):
  ids = paper['encoder_input_ids']
  n = _n(ids)
  assert (ids[:, 0] == CLS).all()
  assert (ids[np.arange(len(ids)), n - 1] == SEP).all()
  # [CLS] and [SEP]s are neither masked, deleted nor inserted.
  np.testing.assert_array_equal((ids == CLS).sum(1), 1)
  np.testing.assert_array_equal((ids == SEP).sum(1), (rows == SEP).sum(1))
  assert ids.max() < VOCAB
  # Infilling takes 30% of the text tokens (spans cut at a [SEP] leave a
  # little more in these rows of short documents) for ~0.09 m spans, 90%
  # of them [MASK].
  m = _is_text(rows).sum()
  assert 0.7 < _is_text(ids).sum() / m < 0.75
  assert 0.07 < (ids == MASK).sum() / m < 0.09


def _reference_infill(row, n, starts, placed, num_spans):
  """Infilling by the definition, from the spans the transform laid out.

  Text token t of a span [start, start + length) is replaced (the first)
  or deleted (the rest) unless a special token separates it from the
  start; a zero-length span inserts a [MASK] before text token `start`
  (after the last one when start == m). Overlong rows keep their first
  R - 1 tokens and their last.
  """
  text = [j for j in range(n) if row[j] not in SPECIALS]
  replaced, deleted, inserts = set(), set(), {}
  for start, length in zip(starts[:num_spans], placed[:num_spans], strict=True):
    if length == 0:
      at = text[start] if start < len(text) else text[-1] + 1
      inserts[at] = inserts.get(at, 0) + 1
      continue
    replaced.add(text[start])
    for t in range(start + 1, start + length):
      if text[t] - text[start] != t - start:
        break
      deleted.add(text[t])
  out = []
  for j in range(n + 1):
    out += [MASK] * inserts.get(j, 0)
    if j < n and j not in deleted:
      out.append(MASK if j in replaced else int(row[j]))
  if len(out) > len(row):
    out = out[: len(row) - 1] + out[-1:]
  return out + [PAD] * (len(row) - len(out))


@pytest.fixture(scope='module')
def infilled(rows):
  return _noise(rows, **{**OFF, 'infill_rate': 0.3})


def test_infill_spans_follow_the_definition(infilled, rows):
  ids, n, spans = infilled
  m = _is_text(rows).sum(1)
  num_spans = spans['num_spans']
  # round(0.3 m) tokens in spans, exactly.
  np.testing.assert_array_equal(spans['num_noise'], np.round(0.3 * m))
  for r in range(len(rows)):
    k = num_spans[r]
    drawn, placed = spans['lengths'][r], spans['placed'][r]
    assert drawn[:k].sum() == spans['num_noise'][r]
    assert (drawn[k:] == 0).all() and (placed[k:] == 0).all()
    # The spans, left to right, are the drawn ones in rotated order.
    assert any(
      (np.roll(drawn[:k], -s) == placed[:k]).all() for s in range(max(k, 1))
    )
    # Ordered, disjoint, inside the m text tokens.
    starts = spans['starts'][r, :k]
    assert (starts[1:] >= starts[:-1] + placed[: k - 1]).all()
    assert k == 0 or starts[-1] + placed[k - 1] <= m[r]
  fraction = spans['num_noise'].sum() / m.sum()
  assert abs(fraction - 0.3) < 0.002


def test_infill_span_lengths_are_poisson(infilled):
  _, _, spans = infilled
  k = spans['num_spans']
  # Whether draw i is used (the draws before it cover fewer than num_noise
  # tokens) does not depend on draw i, so the used draws, the last before
  # its cut included, are Poisson(3.5) exactly (Wald's argument).
  drawn = np.concatenate(
    [d[:c] for d, c in zip(spans['drawn'], k, strict=True)]
  )
  assert len(drawn) > 20_000
  lam = 3.5
  pmf = np.array(
    [math.exp(-lam) * lam**x / math.factorial(x) for x in range(10)]
  )
  freq = np.bincount(drawn, minlength=10)[:10] / len(drawn)
  tol = 5 * np.sqrt(pmf * (1 - pmf) / len(drawn))
  assert (np.abs(freq - pmf) < tol).all(), (freq, pmf)
  assert abs(drawn.mean() - lam) < 5 * math.sqrt(lam / len(drawn))
  # Zero-length spans (insertions) come at Poisson's rate exp(-3.5) = 3%.
  assert abs((drawn == 0).mean() - math.exp(-lam)) < tol[0]
  # Only the last span is cut, to what is left of num_noise.
  for r in range(len(k)):
    lengths, drawn_r = spans['lengths'][r], spans['drawn'][r]
    if k[r]:
      np.testing.assert_array_equal(lengths[: k[r] - 1], drawn_r[: k[r] - 1])
      left = spans['num_noise'][r] - drawn_r[: k[r] - 1].sum()
      assert lengths[k[r] - 1] == min(drawn_r[k[r] - 1], left)


def test_infill_covers_every_position_alike():
  # One document filling the row: away from its ends each token lies in a
  # span with chance ~0.3. Near the ends fewer do (a span covering the
  # first token must start there), the same at both ends.
  rows = np.full([2000, R], WORD0 + 1, np.int32)
  rows[:, 0], rows[:, -1] = CLS, SEP
  _, _, spans = _noise(rows, **{**OFF, 'infill_rate': 0.3})
  covered = np.zeros([len(rows), R - 2])
  for r in range(len(rows)):
    k = spans['num_spans'][r]
    for start, length in zip(
      spans['starts'][r][:k], spans['placed'][r][:k], strict=True
    ):
      covered[r, start : start + length] = 1
  per_position = covered.mean(0)
  sd = math.sqrt(0.21 / len(rows))
  assert np.abs(per_position[8:-8] - 0.3).max() < 0.01 + 4 * sd
  edges = per_position[:8] - per_position[::-1][:8]
  assert np.abs(edges).max() < 5 * sd
  assert per_position[0] < 0.15


def test_infill_output_matches_reference(infilled, rows):
  ids, n, spans = infilled
  for r in range(len(rows)):
    want = _reference_infill(
      rows[r],
      _n(rows[r]),
      spans['starts'][r],
      spans['placed'][r],
      spans['num_spans'][r],
    )
    np.testing.assert_array_equal(ids[r], want, err_msg=f'row {r}')
  np.testing.assert_array_equal(n, _n(ids))
  # One [MASK] per span, zero-length ones included.
  np.testing.assert_array_equal((ids == MASK).sum(1), spans['num_spans'])
  # Rows grow only when zero-length spans outnumber the covered tokens: none
  # of these rows of 128 does (nor any row of 64 or 512 of the bundled
  # corpus, measured).
  assert not spans['overflow'].any()


def test_infill_spans_stop_at_document_boundaries(infilled, rows):
  # A span that reaches an interior [SEP] loses its tokens past it, which
  # stay; the reference agrees (above). Such cut spans are rare but occur.
  _, _, spans = infilled
  cut = 0
  for r in range(len(rows)):
    text = np.nonzero(_is_text(rows[r]))[0]
    for start, length in zip(
      spans['starts'][r][: spans['num_spans'][r]],
      spans['placed'][r][: spans['num_spans'][r]],
      strict=True,
    ):
      if length > 1:
        cut += text[start + length - 1] - text[start] != length - 1
  assert cut > 0


def test_infill_overflow_keeps_final_sep():
  # lambda 0.2: mostly zero-length spans, so insertions outnumber the
  # covered tokens and full rows grow past R.
  rows = _rows(300, seed=3, row_len=64)
  ids, n, spans = _noise(
    rows, **{**OFF, 'infill_rate': 0.3, 'poisson_lambda': 0.2}
  )
  assert spans['overflow'].mean() > 0.5
  over = spans['overflow']
  assert (n[over] == 64).all() and (ids[over, -1] == SEP).all()
  for r in range(len(rows)):
    want = _reference_infill(
      rows[r],
      _n(rows[r]),
      spans['starts'][r],
      spans['placed'][r],
      spans['num_spans'][r],
    )
    np.testing.assert_array_equal(ids[r], want, err_msg=f'row {r}')


def test_infill_random_tokens(rows):
  # Same seeds: the same spans, only each span's token differs.
  masks = _transform(rows, **{**OFF, 'infill_rate': 0.3})['encoder_input_ids']
  mixed = _transform(
    rows, **{**OFF, 'infill_rate': 0.3, 'infill_random_rate': 0.1}
  )['encoder_input_ids']
  span_tokens = masks == MASK
  np.testing.assert_array_equal(mixed[~span_tokens], masks[~span_tokens])
  random = mixed[span_tokens]
  num = len(random)
  assert num > 10_000
  is_random = random != MASK
  assert abs(is_random.mean() - 0.1) < 5 * math.sqrt(0.09 / num)
  # Random tokens are text tokens, never specials or [UNK].
  assert random[is_random].min() >= 5 and random[is_random].max() < VOCAB


@pytest.mark.parametrize('rate', [1.0, 0.5])
def test_sentence_permutation(rate):
  rows = _rows(2000, seed=1, punct_end=True)
  out = _transform(rows, **{**OFF, 'permute_sentences': rate})
  ids = out['encoder_input_ids']
  np.testing.assert_array_equal(_n(ids), _n(rows))
  identity, expected_identity, moved, expected_moved = 0, 0.0, 0, 0.0
  # Each slot moves with chance (k - 1) / S: the first and last alike.
  ends_moved, expected_ends = 0, 0.0
  for r in range(len(rows)):
    n = _n(rows[r])
    assert ids[r, 0] == CLS and ids[r, n - 1] == SEP
    before = _sentences(rows[r, 1 : n - 1])
    after = _sentences(ids[r, 1 : n - 1])
    # The same sentences ([SEP]s inside theirs), in another order.
    assert sorted(after) == sorted(before)
    k = round(rate * len(before))
    num_moved = sum(a != b for a, b in zip(after, before, strict=True))
    assert num_moved <= k
    moved += num_moved
    # A uniform permutation of k sentences keeps 1 of them on average.
    expected_moved += k - (k > 0)
    identity += after == before
    ends_moved += (after[0] != before[0]) + (after[-1] != before[-1])
    expected_ends += 2 * max(k - 1, 0) / len(before)
    expected_identity += 1 / math.factorial(k)
  assert abs(moved - expected_moved) < 0.03 * expected_moved
  sd = math.sqrt(expected_identity)
  assert abs(identity - expected_identity) < 5 * sd + 1
  if rate == 1.0:
    assert identity < 0.05 * len(rows)
  assert abs(ends_moved - expected_ends) < 5 * math.sqrt(expected_ends)


def test_sentence_permutation_row_ending_mid_sentence():
  # The body's last sentence lacks a final piece and moves as a whole.
  row = np.array([[CLS, 20, 5, 21, 22, 7, SEP, 23, 24, 6, 25, 26, SEP, PAD]])
  rows = np.repeat(row, 200, axis=0)
  out = _transform(rows, **{**OFF, 'permute_sentences': 1.0})
  ids = out['encoder_input_ids']
  sentences = [(20, 5), (21, 22, 7, SEP), (23, 24, 6), (25, 26)]
  orders = set()
  for r in range(len(rows)):
    assert ids[r, 0] == CLS and ids[r, 12] == SEP and ids[r, 13] == PAD
    body, order = list(ids[r, 1:12]), []
    while body:
      s = next(s for s in sentences if tuple(body[: len(s)]) == s)
      order.append(sentences.index(s))
      body = body[len(s) :]
    orders.add(tuple(order))
  assert len(orders) == 24  # all 4! orders occur


def test_token_masking(rows):
  out = _transform(rows, **{**OFF, 'token_mask_rate': 0.2})
  ids = out['encoder_input_ids']
  changed = ids != rows
  assert (ids[changed] == MASK).all()
  text = _is_text(rows)
  assert not changed[~text].any()
  assert abs(changed.sum() / text.sum() - 0.2) < 5 * math.sqrt(
    0.16 / text.sum()
  )


def test_token_deletion(rows):
  out = _transform(rows, **{**OFF, 'delete_rate': 0.2})
  ids = out['encoder_input_ids']
  deleted = 0
  for r in range(len(rows)):
    before, after = rows[r, : _n(rows[r])], ids[r, : _n(ids[r])]
    # A subsequence of the row with every special kept.
    it = iter(before)
    assert all(any(a == b for b in it) for a in after)
    np.testing.assert_array_equal(
      before[~_is_text(before)], after[~_is_text(after)]
    )
    deleted += len(before) - len(after)
  text = _is_text(rows).sum()
  assert abs(deleted / text - 0.2) < 5 * math.sqrt(0.16 / text)


def test_document_rotation(rows):
  out = _transform(rows, **{**OFF, 'rotate_rate': 0.5})
  ids = out['encoder_input_ids']
  offsets = []
  for r in range(len(rows)):
    n = _n(rows[r])
    assert ids[r, 0] == CLS and ids[r, n - 1] == SEP
    np.testing.assert_array_equal(ids[r, n:], PAD)
    body, rotated = rows[r, 1 : n - 1], ids[r, 1 : n - 1]
    found = [
      s
      for s in np.nonzero(body == rotated[0])[0]
      if (np.roll(body, -s) == rotated).all()
    ]
    assert found, f'row {r} is not a rotation'
    offsets.append(found[0] / len(body))
  offsets = np.array(offsets)
  # Rotated with probability 0.5, to a uniformly random start.
  rotated = offsets > 0
  assert abs(rotated.mean() - 0.5) < 5 * math.sqrt(0.25 / len(rows))
  assert abs(offsets[rotated].mean() - 0.5) < 0.05
  assert abs((offsets[rotated] < 0.25).mean() - 0.25) < 0.05


def test_all_noises_together_keep_specials(rows):
  out = _transform(
    rows,
    token_mask_rate=0.1,
    delete_rate=0.1,
    rotate_rate=0.5,
  )
  ids = out['encoder_input_ids']
  n = _n(ids)
  assert (ids[:, 0] == CLS).all()
  assert (ids[np.arange(len(ids)), n - 1] == SEP).all()
  np.testing.assert_array_equal((ids == SEP).sum(1), (rows == SEP).sum(1))
  np.testing.assert_array_equal(out['decoder_input_ids'], rows)


def test_same_seed_same_noise_new_epoch_new_noise(rows, paper):
  again = _transform(rows)
  for key in paper:
    np.testing.assert_array_equal(again[key], paper[key])
  next_epoch = _transform(rows, _seeds(len(rows), epoch=1))
  same = (next_epoch['encoder_input_ids'] == paper['encoder_input_ids']).all(1)
  assert same.mean() < 0.01
  np.testing.assert_array_equal(next_epoch['target_ids'], paper['target_ids'])


def test_bad_config_fails_with_the_field_name(rows):
  with pytest.raises(ValueError, match='objective.delete_rate'):
    _transform(rows[:2], delete_rate=1.5)
  config = configlib.base_config()
  config.objective.name = 'denoising'
  config.data.packing = 'full_sentences'
  denoising.check_config(config)
  config.objective.poisson_lambda = -1.0
  with pytest.raises(ValueError, match='objective.poisson_lambda'):
    denoising.check_config(config)
  config.objective.poisson_lambda = 3.5
  config.data.packing = 'concat'
  with pytest.raises(ValueError, match='data.packing'):
    denoising.check_config(config)
