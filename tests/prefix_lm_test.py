"""Tests for pretrain_lm.objectives.prefix_lm: prefixes, weights, attention."""

import importlib.util
import math
import os
import types

import jax
import numpy as np
import pytest
import tensorflow as tf

from pretrain_lm import configlib
from pretrain_lm.data import pipeline
from pretrain_lm.models import MODELS, ModelConfig
from pretrain_lm.models.config import size_preset
from pretrain_lm.objectives import OBJECTIVES, clm, prefix_lm

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
L = 32  # seq_len; packed rows have L + 1 tokens
R = L + 1


def _config(**overrides):
  config = configlib.base_config().objective
  config.update(overrides)
  return config


def _seeds(num_rows, epoch=0):
  return np.stack(
    [np.full(num_rows, epoch), np.arange(num_rows)], axis=1
  ).astype(np.int64)


def _packed_rows(num_docs, seed=0):
  """Random documents of 1-60 tokens packed as GPT rows by pipeline.pack."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 61, num_docs)
  tokens = rng.integers(5, VOCAB, lengths.sum()).astype(np.int32)
  ds = tf.data.Dataset.from_tensor_slices(
    tf.RaggedTensor.from_row_lengths(tokens, lengths)
  )
  rows = pipeline.pack(
    ds, row_len=R, packing='concat', cls_id=CLS, sep_id=SEP, pad_id=PAD
  )
  return next(rows.batch(100_000).as_numpy_iterator())


def _run(fn, *tensors):
  """Maps fn over the rows of `tensors` in tf.data; all results at once."""
  ds = tf.data.Dataset.from_tensor_slices(tensors).map(fn)
  return next(ds.batch(100_000).as_numpy_iterator())


def _transform(rows, seeds, **overrides):
  config = _config(**overrides)
  return _run(
    lambda row, seed: prefix_lm.transform(
      row, seed, config=config, tokenizer=TOKENIZER
    ),
    rows,
    seeds,
  )


@pytest.fixture(scope='module')
def rows():
  return _packed_rows(3000)


@pytest.fixture(scope='module')
def out(rows):
  return _transform(rows, _seeds(len(rows['input_ids'])))


def test_registered_with_clm_rows_and_loss():
  assert OBJECTIVES['prefix_lm'] is prefix_lm
  assert prefix_lm.FAMILIES == ('decoder',)
  assert prefix_lm.loss is clm.loss
  full = configlib.base_config()
  full.data.seq_len = L
  assert prefix_lm.row_length(full) == R


def test_inputs_and_targets_are_clm_s(rows, out):
  n = len(rows['input_ids'])
  assert n > 2500
  # Documents of up to 61 tokens in 33-token rows: many rows hold several.
  assert (rows['segment_ids'].max(axis=1) >= 2).mean() > 0.5
  want = _run(
    lambda row, seed: clm.transform(
      row, seed, config=_config(), tokenizer=TOKENIZER
    ),
    rows,
    _seeds(n),
  )
  assert set(out) == {*want, 'prefix_mask'}
  for key in ('input_ids', 'segment_ids', 'positions', 'target_ids'):
    np.testing.assert_array_equal(out[key], want[key])
  assert out['prefix_mask'].shape == (n, L)
  assert out['prefix_mask'].dtype == np.int32
  assert out['target_weights'].dtype == np.float32


def _reference(rows, lengths):
  """prefix_mask and target_weights by definition, from the prefix lengths.

  lengths[r, k] is the prefix length of segment k of row r: the segment's
  first lengths[r, k] tokens of the R-token row are its prefix.
  """
  segments, positions = rows['segment_ids'], rows['positions']
  in_prefix = (segments > 0) & (
    positions < np.take_along_axis(lengths, segments, axis=1)
  )
  same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
  weights = same & ~in_prefix[:, 1:]
  return in_prefix[:, :-1].astype(np.int32), weights.astype(np.float32)


def _drawn_lengths(rows, seeds, min_prefix):
  """The per-segment prefix lengths the transform draws from each seed."""
  counts = np.stack(
    [np.bincount(s, minlength=R + 1) for s in rows['segment_ids']]
  ).astype(np.int32)
  return counts, _run(
    lambda c, seed: prefix_lm.prefix_lengths(c, seed, min_prefix),
    counts,
    seeds,
  )


@pytest.mark.parametrize('min_prefix', [0.0, 0.25])
def test_prefix_and_weights_exactly_by_definition(rows, min_prefix):
  n = len(rows['input_ids'])
  seeds = _seeds(n)
  got = _transform(rows, seeds, min_prefix=min_prefix)
  counts, lengths = _drawn_lengths(rows, seeds, min_prefix)
  # The drawn lengths respect min_prefix at both ends (slot 0, [PAD]'s, is
  # drawn too but never used).
  lo = np.ceil(np.round(min_prefix * counts, 9))
  hi = np.floor(np.round((1 - min_prefix) * counts, 9))
  assert np.all((lengths >= lo) & (lengths <= np.maximum(lo, hi)))
  mask, weights = _reference(rows, lengths)
  np.testing.assert_array_equal(got['prefix_mask'], mask)
  np.testing.assert_array_equal(got['target_weights'], weights)
  # No target inside a prefix, and the prefix ends right before the first
  # predicted token of each document: the last prefix input predicts it.
  inputs_prefix = got['prefix_mask'].astype(bool)
  assert not np.any(got['target_weights'][:, :-1][inputs_prefix[:, 1:]])
  # About half of what clm predicts is left (E[p / n] = 1/2).
  clm_weights = (rows['segment_ids'][:, 1:] == rows['segment_ids'][:, :-1]) & (
    rows['segment_ids'][:, 1:] > 0
  )
  kept = got['target_weights'].sum() / clm_weights.sum()
  assert 0.4 < kept < 0.6


def _fixed_layout(num_rows):
  """Identical rows: documents of 5 and 20 tokens, then one to the row end."""
  lengths = [5, 20, R - 25]
  segments = np.concatenate([np.full(n, k + 1) for k, n in enumerate(lengths)])
  positions = np.concatenate([np.arange(n) for n in lengths])
  ids = np.random.default_rng(1).integers(5, VOCAB, R)
  ids[[4, 24]] = SEP
  tile = lambda x: np.tile(x.astype(np.int32), (num_rows, 1))  # noqa: E731
  return {
    'input_ids': tile(ids),
    'segment_ids': tile(segments),
    'positions': tile(positions),
  }


@pytest.mark.parametrize(
  'min_prefix, first, second',
  # (min_prefix, the prefix lengths allowed for the 5- and 20-token
  # documents): ceil(m n) to floor((1 - m) n).
  [(0.0, range(0, 6), range(0, 21)), (0.2, range(1, 5), range(4, 17))],
)
def test_prefix_lengths_are_uniform(min_prefix, first, second):
  num_rows = 4000
  layout = _fixed_layout(num_rows)
  got = _transform(layout, _seeds(num_rows), min_prefix=min_prefix)
  segments = layout['segment_ids'][:, :L]
  for k, allowed in ((1, first), (2, second)):
    in_segment = segments == k
    p = (got['prefix_mask'] * in_segment).sum(axis=1)
    # The prefix is the segment's first p tokens.
    starts = np.argmax(in_segment, axis=1)
    index = np.arange(L)[None]
    want = in_segment & (index < (starts + p)[:, None])
    np.testing.assert_array_equal(
      got['prefix_mask'].astype(bool) & in_segment, want
    )
    freq = np.bincount(p, minlength=max(allowed) + 2) / num_rows
    assert set(np.nonzero(freq)[0]) == set(allowed)
    cell = 1 / len(allowed)
    tol = 5 * math.sqrt(cell * (1 - cell) / num_rows)
    assert np.abs(freq[list(allowed)] - cell).max() < tol


def test_prefix_lengths_at_small_and_odd_counts():
  # ceil/floor of rate * n must not suffer from float error (0.3 * 10 is
  # 3.0000000000000004), and a document too short for both ends gets
  # ceil(m * n).
  counts = np.tile(np.array([0, 1, 2, 3, 10], np.int32), (2000, 1))
  lengths = _run(
    lambda c, seed: prefix_lm.prefix_lengths(c, seed, 0.3),
    counts,
    _seeds(2000),
  )
  allowed = [{0}, {1}, {1}, {1, 2}, {3, 4, 5, 6, 7}]
  for k, want in enumerate(allowed):
    assert set(lengths[:, k]) == want


def test_same_seed_same_prefixes_new_epoch_new_prefixes(rows, out):
  n = len(rows['input_ids'])
  again = _transform(rows, _seeds(n))
  for key in out:
    np.testing.assert_array_equal(again[key], out[key])
  other = _transform(rows, _seeds(n, epoch=1))
  same = np.all(other['prefix_mask'] == out['prefix_mask'], axis=1)
  # A row whose first document fills it has a 1-in-34 chance to repeat.
  assert same.mean() < 0.2
  np.testing.assert_array_equal(other['input_ids'], out['input_ids'])


def test_gpt_config_picks_the_objective():
  path = os.path.join(os.path.dirname(__file__), '..', 'configs', 'gpt.py')
  spec = importlib.util.spec_from_file_location('gpt_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.get_config('size=tiny').objective.name == 'clm'
  c = module.get_config('size=tiny,objective=prefix_lm')
  assert c.objective.name == 'prefix_lm'
  assert c.model.family in prefix_lm.FAMILIES
  with pytest.raises(ValueError, match='objective'):
    module.get_config('objective=mlm')


def test_decoder_attends_bidirectionally_within_the_prefix_only():
  V = 64
  cfg = ModelConfig(
    family='decoder',
    vocab_size=V,
    max_len=32,
    type_vocab_size=0,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    norm_position='pre',
    embed_norm=False,
    **size_preset('tiny'),
  )
  # Documents of 7 and 6 tokens with prefixes of 3 and 4, then 3 [PAD]s.
  segments = np.array([[1] * 7 + [2] * 6 + [0] * 3], np.int32)
  positions = np.array([[*range(7), *range(6), 0, 0, 0]], np.int32)
  prefix = np.array([[1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]])
  ids = np.zeros_like(segments)
  ids[0, :13] = np.random.default_rng(0).integers(5, V - 1, 13)
  batch = {
    'input_ids': ids,
    'segment_ids': segments,
    'positions': positions,
    'prefix_mask': prefix.astype(np.int32),
  }
  model = MODELS['decoder'](cfg)
  params = model.init(jax.random.key(0), batch, deterministic=True)
  # Row j + 1 changes only token j (to an id no row uses elsewhere).
  L16 = ids.shape[1]
  changed = np.tile(ids, (L16 + 1, 1))
  changed[np.arange(1, L16 + 1), np.arange(L16)] = V - 1
  many = {k: np.tile(v, (L16 + 1, 1)) for k, v in batch.items()}
  logits = np.asarray(
    jax.jit(model.apply, static_argnames='deterministic')(
      params, dict(many, input_ids=changed), deterministic=True
    )['logits']
  )
  # seen[t, j]: the logits at t moved when token j changed.
  diff = np.abs(logits[1:] - logits[:1]).max(axis=-1)
  assert np.all((diff < 1e-6) | (diff > 1e-4))
  seen = diff.T > 1e-4
  # Query t sees key j: same document, and j <= t or both in the prefix.
  # (Prefixes lead their documents, so deeper layers add nothing.)
  same = (segments[0][:, None] == segments[0][None]) & (segments[0] > 0)
  both_prefix = prefix[0][:, None].astype(bool) & prefix[0][None].astype(bool)
  causal = np.tril(np.ones((L16, L16), bool))
  want = same & (causal | both_prefix)
  # [PAD] queries attend to nothing; their logits are never used.
  np.testing.assert_array_equal(seen[:13], want[:13])
  # In particular: prefix positions read later prefix tokens, and nothing
  # reads a later token outside the prefix.
  assert seen[0, 2] and seen[7, 10]
  later = np.triu(np.ones((L16, L16), bool), 1)
  assert not (seen & later & ~prefix[0][None].astype(bool))[:13].any()


def test_check_config_bounds_min_prefix():
  c = configlib.base_config()
  for ok in (0.0, 0.3, 0.5):
    c.objective.min_prefix = ok
    prefix_lm.check_config(c)
  for bad in (-0.1, 0.6):
    c.objective.min_prefix = bad
    with pytest.raises(ValueError, match='objective.min_prefix'):
      prefix_lm.check_config(c)
