"""Tests for pretrain_lm.data.pipeline: packing, epochs, restarts, eval."""

import itertools
import os

import numpy as np
import pytest
import tensorflow as tf

from pretrain_lm import configlib
from pretrain_lm.data import pipeline
from pretrain_lm.data import tokenizer as tokenizer_lib

CORPUS = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')
PAD, CLS, SEP = 0, 2, 3
SEQ_LEN = 32
BATCH = 4


def reference_full_sentences(docs, seq_len):
  """FULL-SENTENCES packing, token by token, as the docstring defines it."""
  rows, row = [], [CLS]
  for doc in docs:
    tokens = list(doc)
    while tokens:
      room = seq_len - len(row)
      # A document that does not fit is split; its piece ends with [SEP].
      take = min(len(tokens), room - 1)
      row += tokens[:take] + [SEP]
      tokens = tokens[take:]
      # One slot left cannot hold a token and its [SEP]: pad it.
      if len(row) >= seq_len - 1:
        rows.append(row + [PAD] * (seq_len - len(row)))
        row = [CLS]
  if len(row) > 1:
    rows.append(row + [PAD] * (seq_len - len(row)))
  return rows


def reference_doc_sentences(docs, seq_len):
  """Each document cut into pieces of seq_len - 2, one row per piece."""
  rows = []
  for doc in docs:
    for start in range(0, len(doc), seq_len - 2):
      row = [CLS, *doc[start : start + seq_len - 2], SEP]
      rows.append(row + [PAD] * (seq_len - len(row)))
  return rows


REFERENCES = {
  'full_sentences': reference_full_sentences,
  'doc_sentences': reference_doc_sentences,
}


def _synthetic_docs(seq_len, seed=0):
  rng = np.random.default_rng(seed)
  # Lengths around the row size hit every boundary case.
  lengths = [1, seq_len - 2, seq_len - 1, seq_len - 3, seq_len, 2, 1]
  lengths += list(rng.integers(1, 3 * seq_len, 25))
  return [list(rng.integers(5, 100, n)) for n in lengths]


def _pack(docs, seq_len, packing):
  ds = tf.data.Dataset.from_generator(
    lambda: iter(docs), output_signature=tf.TensorSpec([None], tf.int32)
  )
  rows = pipeline.pack(
    ds, seq_len=seq_len, packing=packing, cls_id=CLS, sep_id=SEP, pad_id=PAD
  )
  assert rows.element_spec['input_ids'].shape == [seq_len]
  return [r['input_ids'].tolist() for r in rows.as_numpy_iterator()]


@pytest.mark.parametrize('packing', ['full_sentences', 'doc_sentences'])
@pytest.mark.parametrize('seq_len', [3, 4, 13])
def test_pack_matches_reference(packing, seq_len):
  docs = _synthetic_docs(seq_len, seed=seq_len)
  assert _pack(docs, seq_len, packing) == REFERENCES[packing](docs, seq_len)


def test_full_sentences_properties():
  seq_len = 16
  docs = _synthetic_docs(seq_len)
  rows = np.array(_pack(docs, seq_len, 'full_sentences'))
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
  rows = np.array(_pack(docs, 16, 'doc_sentences'))
  for row in rows:
    tokens = row[(row != PAD) & (row != CLS) & (row != SEP)]
    assert len(set(tokens)) == 1
  assert len(rows) == 1 + 3 + 1


def test_unknown_packing():
  with pytest.raises(ValueError, match='data.packing'):
    _pack([[5]], 8, 'sentences')


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


def _reference_rows(corpus, split, packing):
  tok = corpus['tokenizer']
  docs = [tok.encode(text) for text in corpus[split]]
  return REFERENCES[packing](docs, SEQ_LEN)


def _unmask(batch):
  """The packed rows a masked batch came from."""
  ids = batch['input_ids'].copy()
  for b in range(len(ids)):
    real = batch['masked_weights'][b] > 0
    ids[b, batch['masked_positions'][b, real]] = batch['masked_ids'][b, real]
  return ids


def _batches(config, corpus, num, **kwargs):
  it = pipeline.train_iterator(config, corpus['tokenizer'], **kwargs)
  return list(itertools.islice(it, num))


@pytest.mark.parametrize('packing', ['full_sentences', 'doc_sentences'])
def test_first_epoch_is_the_packed_corpus(corpus, packing):
  # A shuffle buffer of 1 keeps the order.
  config = _config(corpus, packing, shuffle_buffer=1)
  want = _reference_rows(corpus, 'train', packing)
  batches = _batches(config, corpus, len(want) // BATCH)
  got = np.concatenate([_unmask(b) for b in batches])
  np.testing.assert_array_equal(got, want[: len(got)])
  assert (got[:, 0] == CLS).all()


def test_static_shapes_and_dtypes(corpus):
  ds = pipeline.train_dataset(_config(corpus), corpus['tokenizer'])
  p = 5  # ceil(0.15 * 32)
  specs = {k: (v.shape.as_list(), v.dtype) for k, v in ds.element_spec.items()}
  assert specs == {
    'input_ids': ([BATCH, SEQ_LEN], tf.int32),
    'segment_ids': ([BATCH, SEQ_LEN], tf.int32),
    'input_mask': ([BATCH, SEQ_LEN], tf.int32),
    'masked_positions': ([BATCH, p], tf.int32),
    'masked_ids': ([BATCH, p], tf.int32),
    'masked_weights': ([BATCH, p], tf.float32),
  }


@pytest.fixture(scope='module')
def fresh_stream(corpus):
  """Over two epochs of batches from a fresh start, and rows per epoch."""
  rows_per_epoch = len(_reference_rows(corpus, 'train', 'full_sentences'))
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


def test_epochs_differ_in_order_and_masks(corpus, fresh_stream):
  stream, rows_per_epoch = fresh_stream
  rows = np.concatenate([_unmask(b) for b in stream])
  masked = np.concatenate([b['input_ids'] for b in stream])
  epochs = [slice(e * rows_per_epoch, (e + 1) * rows_per_epoch) for e in (0, 1)]
  first, second = (rows[s] for s in epochs)
  # Each epoch is a permutation of the same packed rows ...
  want = _reference_rows(corpus, 'train', 'full_sentences')
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
  first = pipeline.eval_batches(config, corpus['tokenizer'])
  second = pipeline.eval_batches(config, corpus['tokenizer'])
  assert len(first) == 3
  _assert_same_batches(first, second)
  # Not shuffled: the eval corpus's packed rows, in order.
  got = np.concatenate([_unmask(b) for b in first])
  want = _reference_rows(corpus, 'eval', 'full_sentences')[: 3 * BATCH]
  np.testing.assert_array_equal(got, want)
  assert (np.concatenate([b['masked_weights'] for b in first]) > 0).any()


def test_eval_split_too_small(corpus):
  config = _config(corpus, eval_batches=1000)
  with pytest.raises(ValueError, match='data.eval_batches'):
    pipeline.eval_batches(config, corpus['tokenizer'])


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
      _config(corpus), corpus['tokenizer'], process_count=3
    )


def test_corpus_too_small_for_a_batch(corpus, tmp_path):
  tiny = tmp_path / 'tiny.txt'
  tiny.write_text('just a few words\n')
  config = _config(corpus, source=str(tiny))
  with pytest.raises(ValueError, match='tiny.txt'):
    pipeline.train_dataset(config, corpus['tokenizer'])
