"""Tests for reading prepared corpora by index (pretrain_lm.data.prepared).

The corpora here are written directly in the records.py layout from
pipeline.pack's rows, so these tests do not depend on the Beam preparation
(tests/prepare_test.py covers that).
"""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
from array_record.python import array_record_module

from pretrain_lm import configlib, objectives
from pretrain_lm.data import pipeline, prepared, records
from pretrain_lm.data import tokenizer as tokenizer_lib

CORPUS = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')
SEQ_LEN = 32
BATCH = 8


def _lines():
  with open(CORPUS, encoding='utf-8') as f:
    return [line.strip() for line in f if line.strip()]


def write_corpus(directory, docs, tokenizer, *, shards=3, eval_docs=()):
  """A prepared corpus of `docs` in `shards` shards, as prepare lays it out.

  Returns the train rows' input_ids in stored order, [N, SEQ_LEN].
  """
  os.makedirs(directory, exist_ok=True)
  shutil.copy(tokenizer.path, os.path.join(directory, records.TOKENIZER_FILE))
  splits, stored = {}, {}
  for split, texts in (('train', docs), ('eval', eval_docs)):
    pieces = np.array_split(np.arange(len(texts)), shards)
    infos, all_rows = [], []
    for i, piece in enumerate(pieces):
      ids = [tokenizer.encode(texts[j]) for j in piece]
      ds = pipeline.pack(
        tf.data.Dataset.from_generator(
          lambda ids=ids: iter(ids),
          output_signature=tf.TensorSpec([None], tf.int32),
        ),
        row_len=SEQ_LEN,
        packing='full_sentences',
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
        pad_id=tokenizer.pad_id,
      )
      rows = [r['input_ids'] for r in ds.as_numpy_iterator()]
      name = records.shard_name(split, i, shards)
      path = os.path.join(directory, name)
      writer = array_record_module.ArrayRecordWriter(
        path, records.WRITER_OPTIONS
      )
      for r in rows:
        writer.write(records.encode_row(r, [0]))
      writer.close()
      all_rows += rows
      infos.append(
        {
          'file': name,
          'rows': len(rows),
          'bytes': os.path.getsize(path),
          'sha256': records.file_sha256(path),
        }
      )
    splits[split] = {'rows': len(all_rows), 'shards': infos}
    stored[split] = np.array(all_rows).reshape(-1, SEQ_LEN)
  manifest = {
    'format': records.FORMAT,
    'version': records.VERSION,
    'row_length': SEQ_LEN,
    'seq_len': SEQ_LEN,
    'packing': 'full_sentences',
    'tokenizer': {
      'file': records.TOKENIZER_FILE,
      'sha256': records.tokenizer_meta(tokenizer)['sha256'],
    },
    'splits': splits,
    'key': hashlib.sha256(str(directory).encode()).hexdigest()[:16],
    'bad_input_counts': {'invalid_utf8': 2},
  }
  records.write_json_atomic(os.path.join(directory, records.MANIFEST), manifest)
  return stored['train']


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp('prepared')
  lines = _lines()
  tok = tokenizer_lib.train_tokenizer(
    lines[:300], str(root / 'tok.model'), vocab_size=400, model_type='bpe'
  )
  a = write_corpus(root / 'a', lines[:60], tok, eval_docs=lines[300:400])
  b = write_corpus(
    root / 'b', lines[60:200], tok, shards=2, eval_docs=lines[400:500]
  )
  return {'root': root, 'tokenizer': tok, 'a': a, 'b': b}


def _config(source, **data):
  config = configlib.base_config()
  config.data.source = source
  config.data.seq_len = SEQ_LEN
  config.data.batch_size = BATCH
  config.data.eval_batches = 2
  config.data.update(data)
  return config


def _batches(config, tok, num, **kwargs):
  ds = pipeline.train_dataset(
    config, tok, objectives.row_transform(config), **kwargs
  )
  return list(ds.take(num).as_numpy_iterator())


def _global(config, tok, num, start, hosts):
  """Global batches `start..start+num` read by `hosts` processes, joined."""
  per_host = [
    _batches(
      config,
      tok,
      num,
      start_batch=start,
      process_index=h,
      process_count=hosts,
    )
    for h in range(hosts)
  ]
  return [
    {k: np.concatenate([p[i][k] for p in per_host]) for k in per_host[0][i]}
    for i in range(num)
  ]


def _assert_same(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want, strict=True):
    assert g.keys() == w.keys()
    for k in g:
      np.testing.assert_array_equal(g[k], w[k], err_msg=k)


@pytest.mark.parametrize('n', [1, 2, 3, 17, 64, 1000, 4097])
def test_permute_is_a_bijection_that_depends_on_its_key(n):
  index = tf.range(n, dtype=tf.int64)
  one = prepared.permute(index, n, 0, 1, 0).numpy()
  np.testing.assert_array_equal(np.sort(one), np.arange(n))
  if n >= 17:
    other = prepared.permute(index, n, 0, 1, 1).numpy()
    assert (one != other).mean() > 0.8
    # Not a rotation or a stride: neighbours land far apart.
    assert np.median(np.abs(np.diff(one))) > n / 20


def test_mixture_positions_map_onto_each_source_without_gaps():
  stream = prepared.Stream.__new__(prepared.Stream)
  stream.corpora = [None] * 3
  stream.seed = 5
  stream.slots = prepared.mixture_slots([0.5, 0.3, 0.2])
  stream.slot_ends = np.cumsum(stream.slots)
  positions = 3 * prepared.MIX_BLOCK + 1000
  k, n = stream.source_of(tf.range(positions, dtype=tf.int64))
  k, n = k.numpy(), n.numpy()
  counts = stream.rows_read(positions)
  full = 3 * prepared.MIX_BLOCK
  for source in range(3):
    # The whole blocks take source k's rows 0 .. 3 q_k - 1, each once; the
    # partial block's are new rows of the next q_k.
    mine = n[k == source]
    assert len(mine) == counts[source] == len(set(mine))
    np.testing.assert_array_equal(
      np.sort(n[:full][k[:full] == source]), np.arange(3 * stream.slots[source])
    )
    assert mine.max() < 4 * stream.slots[source]
  # Exact at block boundaries; within one block's rounding in between.
  np.testing.assert_array_equal(
    stream.rows_read(3 * prepared.MIX_BLOCK), 3 * stream.slots
  )
  weights = np.array([0.5, 0.3, 0.2])
  assert np.abs(counts / positions - weights).max() < 1 / 1000
  # A position's source does not depend on the positions around it.
  k_one, n_one = stream.source_of(tf.constant([12345], tf.int64))
  assert (int(k_one[0]), int(n_one[0])) == (k[12345], n[12345])


def test_an_epoch_reads_every_row_once_in_a_new_order(setup):
  config = _config(f'prepared:{setup["root"] / "a"}')
  stream = pipeline.prepared_stream(
    config, objectives.row_transform(config).row_length
  )
  size = stream.sizes[0]
  k, n = stream.source_of(tf.range(2 * size, dtype=tf.int64))
  epoch, rows = stream.row_of(k, n)
  rows = rows.numpy().reshape(2, size)
  for e in range(2):
    np.testing.assert_array_equal(np.sort(rows[e]), np.arange(size))
  assert (rows[0] != rows[1]).any()
  np.testing.assert_array_equal(epoch.numpy(), np.repeat([0, 1], size))


def _unmasked(batch):
  ids = batch['input_ids'].copy()
  for b in range(len(ids)):
    real = batch['masked_weights'][b] > 0
    ids[b, batch['masked_positions'][b, real]] = batch['masked_ids'][b, real]
  return ids


def test_batches_are_the_stored_rows_in_the_permuted_order(setup):
  tok = setup['tokenizer']
  config = _config(f'prepared:{setup["root"] / "a"}')
  stream = pipeline.prepared_stream(
    config, objectives.row_transform(config).row_length
  )
  got = _batches(config, tok, 3, start_batch=4)
  positions = tf.range(4 * BATCH, 7 * BATCH, dtype=tf.int64)
  _, rows = stream.row_of(*stream.source_of(positions))
  want = setup['a'][rows.numpy()].reshape(3, BATCH, SEQ_LEN)
  for batch, rows_want in zip(got, want, strict=True):
    np.testing.assert_array_equal(_unmasked(batch), rows_want)


@pytest.mark.parametrize('source', ['a', 'a:0.7,b:0.3'], ids=['one', 'mixture'])
def test_resume_equals_the_stream_for_any_host_count(setup, source):
  """Batches and masks, bit for bit: resumed at step k on 1, 2 or 4 hosts
  equals the uninterrupted single-host stream from k (so a run saved on 2
  hosts resumes on 1 or 4 with the same global batches)."""
  tok = setup['tokenizer']
  spec = ','.join(f'prepared:{setup["root"] / s}' for s in source.split(','))
  config = _config(spec)
  full = _batches(config, tok, 9)
  for hosts in (1, 2, 4):
    _assert_same(_global(config, tok, 3, 6, hosts), full[6:9])
  # Past many epochs.
  far = _global(config, tok, 1, 1_000_000, 2)
  _assert_same(far, _batches(config, tok, 1, start_batch=1_000_000))


def test_next_sentence_pairs_are_the_same_for_any_host_count(setup):
  tok = setup['tokenizer']
  # NSP rows leave a slot for the [SEP] between the two sentences.
  config = _config(f'prepared:{setup["root"] / "a"}', seq_len=SEQ_LEN + 1)
  config.objective.sentence_task = 'nsp'
  full = _batches(config, tok, 3)
  _assert_same(_global(config, tok, 2, 1, 4), full[1:3])


def test_mixture_metrics_and_eval_per_corpus(setup):
  tok = setup['tokenizer']
  a, b = setup['root'] / 'a', setup['root'] / 'b'
  config = _config(f'prepared:{a}:0.7,prepared:{b}:0.3')
  shares = pipeline.tokens_per_source(
    config, objectives.row_transform(config).row_length, 1000
  )
  total = 1000 * BATCH * SEQ_LEN
  assert shares.keys() == {'data/tokens_a', 'data/tokens_b'}
  assert sum(shares.values()) == total
  assert abs(shares['data/tokens_a'] / total - 0.7) < 0.01
  evals = pipeline.eval_batches(config, tok, objectives.row_transform(config))
  assert evals.keys() == {'a', 'b'}
  assert all(len(v) == 2 for v in evals.values())
  # Each corpus' eval rows in stored order, each row masked its own way.
  eval_rows = prepared.Corpus.cached(prepared.parse_source(f'prepared:{a}')[0])
  stored = [
    records.decode_row(r)['input_ids']
    for r in eval_rows.read('eval', np.arange(BATCH))
  ]
  np.testing.assert_array_equal(_unmasked(evals['a'][0]), stored)
  masks = {tuple(p) for p in evals['a'][0]['masked_positions']}
  assert len(masks) > BATCH // 2
  # The bundled WikiText-2 file is not the eval set of a prepared source.
  single = pipeline.eval_batches(
    _config(f'prepared:{a}'),
    tok,
    objectives.row_transform(_config(f'prepared:{a}')),
  )
  assert isinstance(single, list) and len(single) == 2
  assert pipeline.skipped_input(config) == {'data/skipped_invalid_utf8': 4}


def test_startup_reads_only_the_manifest(setup, monkeypatch):
  """Building the stream opens no shard (only stats them)."""
  opened = []
  real = array_record_module.ArrayRecordReader
  monkeypatch.setattr(
    array_record_module,
    'ArrayRecordReader',
    lambda *a, **k: opened.append(a) or real(*a, **k),
  )
  config = _config(f'prepared:{setup["root"] / "a"}')
  pipeline.train_dataset(
    config,
    setup['tokenizer'],
    objectives.row_transform(config),
    start_batch=10**6,
  )
  assert opened == []


def _copy(setup, tmp_path, name='a'):
  dst = tmp_path / name
  shutil.copytree(setup['root'] / name, dst)
  prepared.Corpus.cached.cache_clear()
  return dst


def _fails(config, tok, match):
  with pytest.raises((ValueError, FileNotFoundError), match=match):
    pipeline.train_dataset(config, tok, objectives.row_transform(config))


def test_bad_corpora_fail_naming_the_file_or_field(setup, tmp_path):
  tok = setup['tokenizer']
  d = _copy(setup, tmp_path)
  shard = d / records.shard_name('train', 1, 3)
  # A truncated shard.
  data = shard.read_bytes()
  shard.write_bytes(data[:-10])
  _fails(_config(f'prepared:{d}'), tok, 'train-00001-of-00003.*truncated')
  # A missing one.
  shard.unlink()
  _fails(_config(f'prepared:{d}'), tok, 'train-00001-of-00003.* is missing')
  # The same size, other bytes: the checksum finds it when asked.
  flipped = bytearray(data)
  flipped[len(data) // 2] ^= 0xFF
  shard.write_bytes(bytes(flipped))
  pipeline.train_dataset(
    _config(f'prepared:{d}'),
    tok,
    objectives.row_transform(_config(f'prepared:{d}')),
  )
  # Reading the spoilt chunk fails naming the shard (Riegeli's hashes).
  corpus = prepared.Corpus.cached(prepared.parse_source(f'prepared:{d}')[0])
  first = corpus.split('train')['shards'][0]['rows']
  with pytest.raises(ValueError, match='train-00001-of-00003.*hash'):
    for i in range(first, first + corpus.shard_of('train', first)['rows']):
      corpus.read('train', np.array([i]))
  _fails(_config(f'prepared:{d}', verify_checksums=True), tok, '00001.*SHA-256')
  # No manifest: an unfinished preparation.
  (d / records.MANIFEST).unlink()
  prepared.Corpus.cached.cache_clear()  # a new process reads it again
  _fails(_config(f'prepared:{d}'), tok, 'has no manifest.json')


def test_config_mismatches_fail_naming_the_field(setup, tmp_path):
  tok = setup['tokenizer']
  a = setup['root'] / 'a'
  _fails(_config(f'prepared:{a}', seq_len=64), tok, 'row_length=32.*seq_len')
  _fails(_config(f'prepared:{a}', packing='concat'), tok, 'packing=')
  _fails(
    _config(f'prepared:{a}', seq_len_schedule='0.5:16'),
    tok,
    'seq_len_schedule',
  )
  for bad in (f'prepared:{a}:0', f'prepared:{a}:', f'prepared:{a}:x'):
    _fails(_config(bad), tok, 'weight')
  _fails(_config(f'prepared:{a},{CORPUS}'), tok, 'prepared corpora only')
  # Corpora of a mixture must share a tokenizer.
  other = _copy(setup, tmp_path, 'b')
  manifest = json.loads((other / records.MANIFEST).read_text())
  manifest['tokenizer']['sha256'] = '0' * 64
  (other / records.MANIFEST).write_text(json.dumps(manifest))
  _fails(_config(f'prepared:{a},prepared:{other}'), tok, 'one tokenizer')
  # And the run's tokenizer must be the corpus' one.
  _fails(_config(f'prepared:{other}'), tok, 'tokenized with tokenizer 000000')
