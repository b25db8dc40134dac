"""Tests for pretrain_lm.data.pipeline: packing, epochs, restarts, eval."""

import itertools
import os
import types

import numpy as np
import pytest
import tensorflow as tf

from pretrain_lm import configlib, objectives
from pretrain_lm.data import pipeline
from pretrain_lm.data import rows as rows_lib
from pretrain_lm.data import tokenizer as tokenizer_lib

CORPUS = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')
PAD, CLS, SEP = 0, 2, 3
SEQ_LEN = 32
BATCH = 4


def _padded(rows, row_len):
  """[(ids, segment_ids)] -> [(ids, segment_ids)] padded to row_len."""
  return [
    (ids + [PAD] * (row_len - len(ids)), segs + [0] * (row_len - len(segs)))
    for ids, segs in rows
  ]


def reference_full_sentences(docs, seq_len):
  """FULL-SENTENCES packing, token by token, as the docstring defines it.

  Returns (ids, segment_ids) per row; a segment is one document's piece,
  numbered as placed, with the row's [CLS] in the first.
  """
  rows, row, segs = [], [CLS], [1]
  for doc in docs:
    tokens = list(doc)
    while tokens:
      room = seq_len - len(row)
      # A document that does not fit is split; its piece ends with [SEP].
      take = min(len(tokens), room - 1)
      seg = segs[-1] + 1 if len(row) > 1 else 1
      row += tokens[:take] + [SEP]
      segs += [seg] * (take + 1)
      tokens = tokens[take:]
      # One slot left cannot hold a token and its [SEP]: pad it.
      if len(row) >= seq_len - 1:
        rows.append((row, segs))
        row, segs = [CLS], [1]
  if len(row) > 1:
    rows.append((row, segs))
  return _padded(rows, seq_len)


def reference_doc_sentences(docs, seq_len):
  """Each document cut into pieces of seq_len - 2, one row per piece."""
  rows = []
  for doc in docs:
    for start in range(0, len(doc), seq_len - 2):
      row = [CLS, *doc[start : start + seq_len - 2], SEP]
      rows.append((row, [1] * len(row)))
  return _padded(rows, seq_len)


def reference_concat(docs, seq_len):
  """doc [SEP] doc [SEP] ... cut every seq_len tokens, the rest padded."""
  stream = [(t, d) for d, doc in enumerate(docs) if doc for t in [*doc, SEP]]
  rows = []
  for start in range(0, len(stream), seq_len):
    ids, doc_index = zip(*stream[start : start + seq_len], strict=True)
    # Segments number the documents in the row in order of appearance.
    number = {d: i + 1 for i, d in enumerate(dict.fromkeys(doc_index))}
    rows.append((list(ids), [number[d] for d in doc_index]))
  return _padded(rows, seq_len)


REFERENCES = {
  'full_sentences': reference_full_sentences,
  'doc_sentences': reference_doc_sentences,
  'concat': reference_concat,
}


def reference_positions(segment_ids):
  """Index of each token within its run of equal segment ids; 0 on pad."""
  positions, prev = [], None
  for seg in segment_ids:
    positions.append(0 if seg == 0 or seg != prev else positions[-1] + 1)
    prev = seg
  return positions


def reference_features(docs, seq_len, packing):
  rows = REFERENCES[packing](docs, seq_len)
  ids = np.array([r[0] for r in rows], np.int32).reshape(-1, seq_len)
  segs = np.array([r[1] for r in rows], np.int32).reshape(-1, seq_len)
  positions = np.array([reference_positions(s) for s in segs], np.int32)
  return {
    'input_ids': ids,
    'segment_ids': segs,
    'positions': positions.reshape(-1, seq_len),
  }


def _synthetic_docs(seq_len, seed=0):
  rng = np.random.default_rng(seed)
  # Lengths around the row size hit every boundary case.
  lengths = [1, seq_len - 2, seq_len - 1, seq_len - 3, seq_len, 2, 1]
  lengths += list(rng.integers(1, 3 * seq_len, 25))
  return [list(rng.integers(5, 100, n)) for n in lengths]


def _pack(docs, seq_len, packing, **kwargs):
  """pipeline.pack's rows as a dict of [rows, seq_len] arrays."""
  ds = tf.data.Dataset.from_generator(
    lambda: iter(docs), output_signature=tf.TensorSpec([None], tf.int32)
  )
  rows = pipeline.pack(
    ds,
    row_len=seq_len,
    packing=packing,
    cls_id=CLS,
    sep_id=SEP,
    pad_id=PAD,
    **kwargs,
  )
  keys = ('input_ids', 'segment_ids', 'positions')
  assert {k: (v.shape, v.dtype) for k, v in rows.element_spec.items()} == {
    k: ([seq_len], tf.int32) for k in keys
  }
  rows = list(rows.as_numpy_iterator())
  return {
    k: np.array([r[k] for r in rows], np.int32).reshape(-1, seq_len)
    for k in keys
  }


def _assert_features_equal(got, want):
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize('packing', pipeline.PACKINGS)
@pytest.mark.parametrize('seq_len', [3, 4, 13])
def test_pack_matches_reference(packing, seq_len):
  docs = _synthetic_docs(seq_len, seed=seq_len)
  want = reference_features(docs, seq_len, packing)
  _assert_features_equal(_pack(docs, seq_len, packing), want)


@pytest.mark.parametrize('packing', ['full_sentences', 'concat'])
@pytest.mark.parametrize('docs_per_run', [1, 3])
def test_pack_rows_do_not_depend_on_runs(packing, docs_per_run):
  # Rows carry over from one run of documents (one scan step) to the next.
  for seq_len in (3, 13):
    docs = _synthetic_docs(seq_len, seed=seq_len)
    want = reference_features(docs, seq_len, packing)
    got = _pack(docs, seq_len, packing, docs_per_run=docs_per_run)
    _assert_features_equal(got, want)


SMALL_DOCS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [30]]
# By hand, for rows of 8: (input_ids, segment_ids, positions) per row.
SMALL_ROWS = {
  'full_sentences': [
    (
      [CLS, 10, 11, 12, SEP, 20, 21, SEP],
      [1, 1, 1, 1, 1, 2, 2, 2],
      [0, 1, 2, 3, 4, 0, 1, 2],
    ),
    # Document 2 goes on in a new segment, which the [CLS] starts.
    (
      [CLS, 22, 23, 24, 25, 26, 27, SEP],
      [1, 1, 1, 1, 1, 1, 1, 1],
      [0, 1, 2, 3, 4, 5, 6, 7],
    ),
    (
      [CLS, 30, SEP, PAD, PAD, PAD, PAD, PAD],
      [1, 1, 1, 0, 0, 0, 0, 0],
      [0, 1, 2, 0, 0, 0, 0, 0],
    ),
  ],
  'doc_sentences': [
    (
      [CLS, 10, 11, 12, SEP, PAD, PAD, PAD],
      [1, 1, 1, 1, 1, 0, 0, 0],
      [0, 1, 2, 3, 4, 0, 0, 0],
    ),
    (
      [CLS, 20, 21, 22, 23, 24, 25, SEP],
      [1, 1, 1, 1, 1, 1, 1, 1],
      [0, 1, 2, 3, 4, 5, 6, 7],
    ),
    (
      [CLS, 26, 27, SEP, PAD, PAD, PAD, PAD],
      [1, 1, 1, 1, 0, 0, 0, 0],
      [0, 1, 2, 3, 0, 0, 0, 0],
    ),
    (
      [CLS, 30, SEP, PAD, PAD, PAD, PAD, PAD],
      [1, 1, 1, 0, 0, 0, 0, 0],
      [0, 1, 2, 0, 0, 0, 0, 0],
    ),
  ],
  'concat': [
    (
      [10, 11, 12, SEP, 20, 21, 22, 23],
      [1, 1, 1, 1, 2, 2, 2, 2],
      [0, 1, 2, 3, 0, 1, 2, 3],
    ),
    (
      [24, 25, 26, 27, SEP, 30, SEP, PAD],
      [1, 1, 1, 1, 1, 2, 2, 0],
      [0, 1, 2, 3, 4, 0, 1, 0],
    ),
  ],
}


@pytest.mark.parametrize('packing', pipeline.PACKINGS)
def test_segments_and_positions_by_hand(packing):
  rows = SMALL_ROWS[packing]
  ids, segs, positions = (np.array([r[i] for r in rows]) for i in range(3))
  want = {'input_ids': ids, 'segment_ids': segs, 'positions': positions}
  _assert_features_equal(_pack(SMALL_DOCS, 8, packing), want)
  _assert_features_equal(reference_features(SMALL_DOCS, 8, packing), want)


@pytest.mark.parametrize('seq_len', [2, 13, 64])
def test_concat_is_the_cut_stream(seq_len):
  rng = np.random.default_rng(seq_len)
  # More documents than one scan step joins; some empty, which are dropped.
  docs = [list(rng.integers(5, 100, n)) for n in rng.integers(0, 30, 400)]
  stream = []
  for doc in docs:
    if doc:
      stream += [*doc, SEP]
  stream += [PAD] * (-len(stream) % seq_len)
  got = _pack(docs, seq_len, 'concat')
  np.testing.assert_array_equal(
    got['input_ids'], np.reshape(stream, [-1, seq_len])
  )
  # A segment ends right after each [SEP] and at a row's end.
  ids, segs = got['input_ids'], got['segment_ids']
  ends_segment = (ids[:, :-1] == SEP) & (ids[:, 1:] != PAD)
  np.testing.assert_array_equal(
    np.diff(segs, axis=1),
    np.where(ids[:, 1:] == PAD, -segs[:, :-1], 0) + ends_segment,
  )


def test_full_sentences_properties():
  seq_len = 16
  docs = _synthetic_docs(seq_len)
  rows = _pack(docs, seq_len, 'full_sentences')['input_ids']
  assert (rows[:, 0] == CLS).all()
  # All tokens in order; each row ends with [SEP] (then at most padding).
  content = rows[:, 1:][rows[:, 1:] != PAD]
  np.testing.assert_array_equal(content[content != SEP], np.concatenate(docs))
  for row in rows:
    last = np.nonzero(row != PAD)[0][-1]
    assert row[last] == SEP
  # At least one [SEP] per document, one more per split at a row end.
  assert (content == SEP).sum() >= len(docs)
  # Rows are full, but for one [PAD] after a final [SEP], and the last row.
  num_pads = (rows[:-1] == PAD).sum(axis=1)
  assert set(num_pads) <= {0, 1}
  assert (rows[:-1][num_pads == 1, -2] == SEP).all()


def test_doc_sentences_rows_stay_in_one_document():
  docs = [[10] * 5, [11] * 30, [12] * 14]
  packed = _pack(docs, 16, 'doc_sentences')
  for row in packed['input_ids']:
    tokens = row[(row != PAD) & (row != CLS) & (row != SEP)]
    assert len(set(tokens)) == 1
  assert len(packed['input_ids']) == 1 + 3 + 1
  np.testing.assert_array_equal(
    packed['segment_ids'], packed['input_ids'] != PAD
  )


def test_unknown_packing():
  with pytest.raises(ValueError, match='data.packing'):
    _pack([[5]], 8, 'sentences')


@pytest.mark.parametrize(
  ('packing', 'row_len'), [('concat', 1), ('full_sentences', 2)]
)
def test_rows_too_short(packing, row_len):
  with pytest.raises(ValueError, match='data.seq_len'):
    _pack([[5]], row_len, packing)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  with open(CORPUS, encoding='utf-8') as f:
    lines = [line.strip() for line in f if line.strip()]
  root = tmp_path_factory.mktemp('corpus')
  (root / 'train.txt').write_text('\n'.join(lines[:40]) + '\n')
  (root / 'eval.txt').write_text('\n'.join(lines[40:70]) + '\n')
  # BPE: tensorflow-text then segments exactly like the Python encode used
  # by the reference below (unigram may break ties differently).
  tok = tokenizer_lib.train_tokenizer(
    lines[:300], str(root / 'tok.model'), vocab_size=400, model_type='bpe'
  )
  return {
    'train': lines[:40],
    'eval': lines[40:70],
    'root': root,
    'tokenizer': tok,
  }


def _config(corpus, packing='full_sentences', **data):
  config = configlib.base_config()
  config.data.source = str(corpus['root'] / 'train.txt')
  config.data.eval_source = str(corpus['root'] / 'eval.txt')
  config.data.seq_len = SEQ_LEN
  config.data.batch_size = BATCH
  config.data.shuffle_buffer = 64
  config.data.eval_batches = 3
  config.data.packing = packing
  config.data.update(data)
  return config


def _reference_rows(corpus, split, packing, seq_len=SEQ_LEN):
  """The reference features of a split's packed rows, [rows, seq_len]."""
  tok = corpus['tokenizer']
  docs = [tok.encode(text) for text in corpus[split]]
  return reference_features(docs, seq_len, packing)


def _unmask(batch):
  """The packed rows a masked batch came from."""
  ids = batch['input_ids'].copy()
  for b in range(len(ids)):
    real = batch['masked_weights'][b] > 0
    ids[b, batch['masked_positions'][b, real]] = batch['masked_ids'][b, real]
  return ids


def _batches(config, corpus, num, **kwargs):
  it = pipeline.train_iterator(
    config, corpus['tokenizer'], objectives.row_transform(config), **kwargs
  )
  return list(itertools.islice(it, num))


@pytest.mark.parametrize('packing', pipeline.PACKINGS)
def test_first_epoch_is_the_packed_corpus(corpus, packing):
  # A shuffle buffer of 1 keeps the order.
  config = _config(corpus, packing, shuffle_buffer=1)
  want = _reference_rows(corpus, 'train', packing)
  batches = _batches(config, corpus, len(want['input_ids']) // BATCH)
  got = {
    'input_ids': np.concatenate([_unmask(b) for b in batches]),
    # MLM passes the packing's segments and positions through.
    'segment_ids': np.concatenate([b['segment_ids'] for b in batches]),
    'positions': np.concatenate([b['positions'] for b in batches]),
  }
  num = len(got['input_ids'])
  _assert_features_equal(got, {k: v[:num] for k, v in want.items()})
  assert (got['segment_ids'][:, 0] == 1).all()
  if packing != 'concat':
    assert (got['input_ids'][:, 0] == CLS).all()


def test_static_shapes_and_dtypes(corpus):
  ds = pipeline.train_dataset(
    _config(corpus),
    corpus['tokenizer'],
    objectives.row_transform(_config(corpus)),
  )
  p = 5  # ceil(0.15 * 32)
  specs = {k: (v.shape.as_list(), v.dtype) for k, v in ds.element_spec.items()}
  assert specs == {
    'input_ids': ([BATCH, SEQ_LEN], tf.int32),
    'segment_ids': ([BATCH, SEQ_LEN], tf.int32),
    'positions': ([BATCH, SEQ_LEN], tf.int32),
    'token_type_ids': ([BATCH, SEQ_LEN], tf.int32),
    'input_mask': ([BATCH, SEQ_LEN], tf.int32),
    'masked_positions': ([BATCH, p], tf.int32),
    'masked_ids': ([BATCH, p], tf.int32),
    'masked_weights': ([BATCH, p], tf.float32),
  }


@pytest.mark.parametrize('doc_format', ['line', 'blank_line', 'file'])
def test_no_function_goes_through_autograph(corpus, doc_format, monkeypatch):
  """tf.data traces our functions as written (sources.no_autograph).

  AutoGraph's rewrite is seconds per pipeline and changes nothing in code
  that keeps data-dependent control flow in TF ops; a function handed to
  tf.data without the wrapper would be converted, and seen here.
  """
  from tensorflow.python.autograph.impl import api

  converted = []

  def record(f, *args, **kwargs):
    converted.append(f)
    raise RuntimeError('not converted')  # AutoGraph then runs `f` as is

  monkeypatch.setattr(api, '_convert_actual', record)
  for packing in pipeline.PACKINGS:
    config = _config(corpus, packing, doc_format=doc_format, eval_batches=1)
    if doc_format == 'line':  # every 3rd document held out for eval
      config.data.eval_holdout_every = 3
      config.data.eval_source = ''
    if packing == 'doc_sentences':  # + partner rows
      config.objective.sentence_task = 'nsp'
      config.model.pooler = True
    next(
      pipeline.train_iterator(
        config,
        corpus['tokenizer'],
        objectives.row_transform(config),
        start_batch=9,
      )
    )
    pipeline.eval_batches(
      config, corpus['tokenizer'], objectives.row_transform(config)
    )
  assert not converted
  # The probe is live: an unwrapped function is seen.
  tf.data.Dataset.range(3).map(lambda x: x + 1)
  assert len(converted) == 1


@pytest.fixture(scope='module')
def fresh_stream(corpus):
  """Over two epochs of batches from a fresh start, and rows per epoch."""
  want = _reference_rows(corpus, 'train', 'full_sentences')
  rows_per_epoch = len(want['input_ids'])
  num = 2 * rows_per_epoch // BATCH + 3
  return _batches(_config(corpus), corpus, num), rows_per_epoch


def _assert_same_batches(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want, strict=True):
    assert g.keys() == w.keys()
    for key in g:
      np.testing.assert_array_equal(g[key], w[key], err_msg=key)


def test_restart_reproduces_the_stream(corpus, fresh_stream):
  stream, rows_per_epoch = fresh_stream
  epoch_batches = rows_per_epoch // BATCH
  assert rows_per_epoch % BATCH, 'a batch should straddle the epoch boundary'
  # Mid-epoch, the batch across the boundary, and past a whole epoch.
  for start in (3, epoch_batches, epoch_batches + 4):
    got = _batches(_config(corpus), corpus, 4, start_batch=start)
    _assert_same_batches(got, stream[start : start + 4])


def test_cached_tokens_give_the_same_stream(corpus, fresh_stream):
  # data.cache_tokens keeps epoch 0's token ids for later epochs: the
  # batches (order, packing, masks) must not change, across epochs and
  # after a restart past the first epoch.
  stream, rows_per_epoch = fresh_stream
  got = _batches(_config(corpus, cache_tokens=True), corpus, len(stream))
  _assert_same_batches(got, stream)
  start = rows_per_epoch // BATCH + 2
  got = _batches(
    _config(corpus, cache_tokens=True), corpus, 4, start_batch=start
  )
  _assert_same_batches(got, stream[start : start + 4])
  assert pipeline.rows_per_epoch(
    _config(corpus),
    corpus['tokenizer'],
    objectives.row_transform(_config(corpus)),
  ) == (rows_per_epoch)


def test_cached_tokens_are_not_read_again(corpus, tmp_path):
  # Past epoch 0, data.cache_tokens serves the tokens from memory: a source
  # replaced on disk then changes nothing. Without the cache it does (the
  # control), so the test sees whether the file is read again.
  rows_per_epoch = len(
    _reference_rows(corpus, 'train', 'full_sentences')['input_ids']
  )
  epoch_batches = rows_per_epoch // BATCH
  source = tmp_path / 'train.txt'

  def stream(cache_tokens, replace_after):
    source.write_text('\n'.join(corpus['train']) + '\n')
    config = _config(corpus, cache_tokens=cache_tokens)
    config.data.source = str(source)
    it = pipeline.train_iterator(
      config, corpus['tokenizer'], objectives.row_transform(config)
    )
    got = list(itertools.islice(it, replace_after))
    # A new file (os.replace), as an edit would leave: open readers keep
    # the old one.
    other = tmp_path / 'other.txt'
    other.write_text('\n'.join(reversed(corpus['eval'])) + '\n')
    os.replace(other, source)
    return got + list(itertools.islice(it, 3 * epoch_batches))

  # Into epoch 1: epoch 0 has been read to its end, so its cache is whole.
  after = epoch_batches + 2
  want = _batches(_config(corpus), corpus, after + 3 * epoch_batches)
  _assert_same_batches(stream(True, after), want)
  uncached = stream(False, after)
  assert not all(
    np.array_equal(g['input_ids'], w['input_ids'])
    for g, w in zip(uncached, want, strict=True)
  ), 'the control did not read the replaced file'


def test_restart_reproduces_next_sentence_pairs(corpus):
  # NSP takes each row's random B from its neighbour in the host batch:
  # restarts (at the epoch boundary and past it) must pair rows the same.
  def nsp_config():
    config = _config(corpus, 'doc_sentences')
    config.objective.sentence_task = 'nsp'
    config.model.pooler = True
    return config

  rows_per_epoch = sum(
    1
    for _ in rows_lib.packed_rows(
      nsp_config(),
      corpus['tokenizer'],
      objectives.row_transform(nsp_config()),
      split='train',
      process_index=0,
      process_count=1,
    )
  )
  start = rows_per_epoch // BATCH
  stream = _batches(nsp_config(), corpus, start + 6)
  assert 0 < np.mean([b['sentence_labels'].mean() for b in stream]) < 1
  for begin in (3, start, start + 2):
    got = _batches(nsp_config(), corpus, 4, start_batch=begin)
    _assert_same_batches(got, stream[begin : begin + 4])


def test_epochs_differ_in_order_and_masks(corpus, fresh_stream):
  stream, rows_per_epoch = fresh_stream
  rows = np.concatenate([_unmask(b) for b in stream])
  masked = np.concatenate([b['input_ids'] for b in stream])
  epochs = [slice(e * rows_per_epoch, (e + 1) * rows_per_epoch) for e in (0, 1)]
  first, second = (rows[s] for s in epochs)
  # Each epoch is a permutation of the same packed rows ...
  want = _reference_rows(corpus, 'train', 'full_sentences')['input_ids']
  assert sorted(map(tuple, first)) == sorted(map(tuple, want))
  assert sorted(map(tuple, second)) == sorted(map(tuple, want))
  # ... in a new order, and a row gets new masks.
  assert (first != second).any(axis=1).mean() > 0.9
  masks = {}
  for s in epochs:
    for row, masked_row in zip(rows[s], masked[s], strict=True):
      masks.setdefault(row.tobytes(), []).append(masked_row)
  differ = [not np.array_equal(*m) for m in masks.values() if len(m) == 2]
  assert np.mean(differ) > 0.9


def test_eval_batches(corpus):
  config = _config(corpus)
  first = pipeline.eval_batches(
    config, corpus['tokenizer'], objectives.row_transform(config)
  )
  second = pipeline.eval_batches(
    config, corpus['tokenizer'], objectives.row_transform(config)
  )
  assert len(first) == 3
  _assert_same_batches(first, second)
  # Not shuffled: the eval corpus's packed rows, in order.
  got = np.concatenate([_unmask(b) for b in first])
  want = _reference_rows(corpus, 'eval', 'full_sentences')['input_ids']
  want = want[: 3 * BATCH]
  np.testing.assert_array_equal(got, want)
  assert (np.concatenate([b['masked_weights'] for b in first]) > 0).any()


def test_eval_split_too_small(corpus):
  config = _config(corpus, eval_batches=1000)
  with pytest.raises(ValueError, match='data.eval_batches'):
    pipeline.eval_batches(
      config, corpus['tokenizer'], objectives.row_transform(config)
    )


def test_hosts_get_their_share(corpus):
  config = _config(corpus)
  streams = [
    _batches(config, corpus, 2, process_index=i, process_count=2)
    for i in range(2)
  ]
  for stream in streams:
    assert stream[0]['input_ids'].shape == (BATCH // 2, SEQ_LEN)
  assert not np.array_equal(
    streams[0][0]['input_ids'], streams[1][0]['input_ids']
  )


def test_batch_not_divisible_by_hosts(corpus):
  with pytest.raises(ValueError, match='data.batch_size=4'):
    pipeline.train_dataset(
      _config(corpus),
      corpus['tokenizer'],
      objectives.row_transform(_config(corpus)),
      process_count=3,
    )


def test_corpus_too_small_for_a_batch(corpus, tmp_path):
  tiny = tmp_path / 'tiny.txt'
  tiny.write_text('just a few words\n')
  config = _config(corpus, source=str(tiny))
  with pytest.raises(ValueError, match='tiny.txt'):
    pipeline.train_dataset(
      config, corpus['tokenizer'], objectives.row_transform(config)
    )


def test_row_length_defaults_to_seq_len():
  config = configlib.base_config()
  assert objectives.row_transform(config).row_length == config.data.seq_len


@pytest.fixture
def rows_objective(monkeypatch):
  """An objective that keeps rows as packed, of seq_len + 1 like a causal LM."""
  fake = types.SimpleNamespace(
    row_length=lambda config: config.data.seq_len + 1,
    transform=lambda row, seed, *, config, tokenizer: row,
  )
  monkeypatch.setitem(objectives.OBJECTIVES, 'rows', fake)
  return 'rows'


def test_char_file_slices_concat(corpus, rows_objective, tmp_path):
  """GPT-style data: one file, split 90/10, characters, 'concat' rows."""
  # The eval slice (the last 10%) gets characters the training one lacks.
  text = '\n'.join(corpus['train']) + '\n\n  Ünïcödé —\n' + 'tail ' * 50
  path = tmp_path / 'book.txt'
  path.write_bytes(text.encode('utf-8'))
  config = configlib.base_config()
  config.objective.name = rows_objective
  config.data.update(
    source=f'{path}[:90%]',
    eval_source=f'{path}[90%:]',
    doc_format='file',
    packing='concat',
    tokenizer_type='char',
    seq_len=15,
    batch_size=BATCH,
    shuffle_buffer=1,
  )
  row_len = 16
  assert objectives.row_transform(config).row_length == row_len
  tok = tokenizer_lib.setup_tokenizer(
    config.data, vocab_size=300, workdir=str(tmp_path / 'run')
  )
  cut = int(len(text) * 0.9)
  assert tok.chars == tuple(sorted(set(text[:cut])))
  want = reference_features([tok.encode(text[:cut])], row_len, 'concat')
  num_batches = len(want['input_ids']) // BATCH
  batches = list(
    itertools.islice(
      pipeline.train_iterator(config, tok, objectives.row_transform(config)),
      num_batches,
    )
  )
  got = {k: np.concatenate([b[k] for b in batches]) for k in want}
  _assert_features_equal(
    got, {k: v[: num_batches * BATCH] for k, v in want.items()}
  )
  # Rows run on across documents' boundaries: one document, one segment.
  np.testing.assert_array_equal(got['segment_ids'], 1)
  np.testing.assert_array_equal(got['positions'][0], np.arange(row_len))
  # The eval slice is the rest of the file, its new characters [UNK].
  want = reference_features([tok.encode(text[cut:])], row_len, 'concat')
  config.data.eval_batches = len(want['input_ids']) // BATCH
  evals = pipeline.eval_batches(config, tok, objectives.row_transform(config))
  got = np.concatenate([b['input_ids'] for b in evals])
  np.testing.assert_array_equal(got, want['input_ids'][: len(got)])
  assert (got == tok.unk_id).sum() >= 4  # Ü, ï, ö, é at least
