"""Tests for pretrain_lm.data.prepare (and its ranges and shards modules)."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from array_record.python.array_record_module import ArrayRecordReader
from conftest import REPO, load_config

from pretrain_lm import configlib, objectives
from pretrain_lm.data import pipeline, prepare, ranges, records, shards
from pretrain_lm.data import rows as rows_lib
from pretrain_lm.data import tokenizer as tokenizer_lib

WIKI = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')
EVERY = 7
SEQ_LEN = 64
IN_MEMORY = '--direct_running_mode=in_memory'


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """The first ~100 KB of WikiText-2 (whole lines), with a '\\r\\n' line."""
  with open(WIKI, 'rb') as f:
    text = f.read(100_000)
  text = text[: text.rindex(b'\n') + 1] + b'a last line, CRLF\r\n'
  path = tmp_path_factory.mktemp('corpus') / 'wiki.txt'
  path.write_bytes(text)
  return str(path)


def _config(tokenizer_path, source, packing='full_sentences', **data):
  c = load_config('bert', 'size=tiny')
  c.model.vocab_size = 512
  c.data.update(
    source=source,
    eval_source='',
    eval_holdout_every=EVERY,
    seq_len=SEQ_LEN,
    packing=packing,
    tokenizer=tokenizer_path,
    **data,
  )
  return c


def _prepare(config, output, **kwargs):
  kwargs.setdefault('beam_options', IN_MEMORY)
  return prepare.prepare(
    config,
    str(output),
    objectives.row_transform(config),
    progress=False,
    **kwargs,
  )


def _rows(path):
  reader = ArrayRecordReader(str(path))
  rows = [records.decode_row(r) for r in reader.read_all()]
  reader.close()
  return rows


def _line_docs(path, start, stop):
  """{offset: text} of the documents whose line starts in [start, stop)."""
  with open(path, 'rb') as f:
    data = f.read()
  docs, offset = {}, 0
  for line in data.split(b'\n'):
    if start <= offset < stop and line.strip():
      docs[offset] = line.strip()
    offset += len(line) + 1
  return docs


def _packed(texts, tokenizer, packing):
  """pipeline.pack over `texts`, as the raw-text pipeline tokenizes them."""
  docs = tf.data.Dataset.from_tensor_slices(tf.constant(texts, tf.string))
  rows = pipeline.pack(
    pipeline.tokenize(docs, tokenizer),
    row_len=SEQ_LEN,
    packing=packing,
    cls_id=tokenizer.cls_id,
    sep_id=tokenizer.sep_id,
    pad_id=tokenizer.pad_id,
  )
  return [r['input_ids'].tolist() for r in rows.as_numpy_iterator()]


def _is_run_of(part, whole):
  n = len(part)
  return any(whole[i : i + n] == part for i in range(len(whole) - n + 1))


@pytest.mark.parametrize('packing', pipeline.PACKINGS)
def test_rows_are_pack_of_each_range_with_provenance(
  corpus, tokenizer_path, tmp_path, packing
):
  config = _config(tokenizer_path, corpus, packing)
  manifest = _prepare(config, tmp_path, range_mb=0.02)
  tok = tokenizer_lib.load_tokenizer(str(tmp_path / records.TOKENIZER_FILE))
  specials = {tok.cls_id, tok.sep_id, tok.pad_id}
  train, held = manifest['splits']['train'], manifest['splits']['eval']
  assert len(train['shards']) == len(held['shards']) == 5
  stops = [s['input']['stop'] for s in train['shards']]
  assert stops[-1] == os.path.getsize(corpus)
  for i, (shard, eval_shard) in enumerate(
    zip(train['shards'], held['shards'], strict=True)
  ):
    assert shard['file'] == records.shard_name('train', i, 5)
    assert eval_shard['file'] == records.shard_name('eval', i, 5)
    docs = _line_docs(corpus, shard['input']['start'], shard['input']['stop'])
    offsets = list(docs)
    # Every EVERY-th document of the range, counted within it, is eval's.
    eval_offsets = offsets[EVERY - 1 :: EVERY]
    train_offsets = [o for o in offsets if o not in set(eval_offsets)]
    for split_shard, split_offsets in (
      (shard, train_offsets),
      (eval_shard, eval_offsets),
    ):
      rows = _rows(tmp_path / split_shard['file'])
      expected = _packed([docs[o] for o in split_offsets], tok, packing)
      assert [r['input_ids'] for r in rows] == expected
      seen = []
      for row in rows:
        ids = np.array(row['input_ids'])
        segments = pipeline.row_features(ids[None], tok.sep_id, tok.pad_id)[
          'segment_ids'
        ].numpy()[0]
        assert len(row['doc_offsets']) == segments.max()
        for s, offset in enumerate(row['doc_offsets'], 1):
          content = [t for t in ids[segments == s] if t not in specials]
          # Each segment's text is a run of its document's tokens.
          text = docs[offset].decode('utf-8')
          assert _is_run_of(content, tok.encode(text)), (offset, s)
          seen.append(offset)
      assert sorted(set(seen)) == split_offsets
      assert split_shard['documents'] == len(split_offsets)
  # The manifest's counts and checksums are the files'.
  for split in records.SPLITS:
    shards = manifest['splits'][split]['shards']
    for shard in shards:
      path = tmp_path / shard['file']
      rows = _rows(path)
      assert shard['rows'] == len(rows)
      assert shard['tokens'] == sum(
        sum(t != tok.pad_id for t in r['input_ids']) for r in rows
      )
      assert shard['bytes'] == os.path.getsize(path)
      assert shard['sha256'] == records.file_sha256(str(path))
    for k in ('rows', 'tokens', 'documents'):
      assert manifest['splits'][split][k] == sum(s[k] for s in shards)
  assert manifest == records.read_manifest(str(tmp_path))
  assert manifest['row_length'] == SEQ_LEN
  assert manifest['source']['eval_holdout_every'] == EVERY
  assert manifest['tokenizer']['sha256'] == records.file_sha256(tokenizer_path)


def test_one_range_is_the_raw_text_pipeline(corpus, tokenizer_path, tmp_path):
  config = _config(tokenizer_path, corpus, 'concat')
  manifest = _prepare(config, tmp_path)
  tok = tokenizer_lib.load_tokenizer(tokenizer_path)
  for split in records.SPLITS:
    (shard,) = manifest['splits'][split]['shards']
    raw = rows_lib.packed_rows(
      config,
      tok,
      objectives.row_transform(config),
      split=split,
      process_index=0,
      process_count=1,
    )
    expected = [r['input_ids'].tolist() for r in raw.as_numpy_iterator()]
    assert [r['input_ids'] for r in _rows(tmp_path / shard['file'])] == expected


@pytest.mark.parametrize('size', [1, 2, 5, 13, 40])
def test_byte_ranges_partition_the_lines(tmp_path, monkeypatch, size):
  # Small reads, so that lines and range starts cross read blocks.
  monkeypatch.setattr(ranges, '_READ_BYTES', size)
  lines = [b'', b'a', b'bb\r', b'', b'x' * 30, b'c', b'', b'', b'dd', b'end']
  data = b'\n'.join(lines)  # no final newline
  path = tmp_path / 'lines.txt'
  path.write_bytes(data)
  want, offset = [], 0
  for line in lines:
    if offset < len(data):
      want.append((offset, line if len(line) <= 21 else None))
    offset += len(line) + 1
  for cuts in ([], [1], [3, 4], [5, 9, 10, 11], list(range(1, len(data)))):
    bounds = [0, *cuts, len(data)]
    got = []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
      got += list(ranges._lines(str(path), start, stop, limit=20))
    assert got == want, cuts


BAD_UTF8 = b'caf\xc3\xa9 then \xff\xfe junk\n'


def test_bad_input_fails_naming_file_and_offset_or_is_counted(
  corpus, tokenizer_path, tmp_path
):
  bad = tmp_path / 'bad.txt'
  bad.write_bytes(b'good one\n  \n' + BAD_UTF8 + b'good two\n')
  config = _config(tokenizer_path, f'{corpus},{bad}', bad_input='fail')
  offset = 12 + BAD_UTF8.index(b'\xff')
  with pytest.raises(ValueError, match=f"'{bad}' at byte {offset}: invalid"):
    _prepare(config, tmp_path / 'fail', range_mb=0.05)
  assert not (tmp_path / 'fail' / records.MANIFEST).exists()
  config.data.bad_input = 'skip'
  manifest = _prepare(config, tmp_path / 'skip', range_mb=0.05)
  counts = manifest['bad_input_counts']
  with open(corpus, 'rb') as f:
    blank = [
      x for x in f.read().split(b'\n') if x.rstrip(b'\r') and not x.strip()
    ]
  assert counts['invalid_utf8'] == 1
  assert counts['whitespace_only'] == len(blank) + 1
  (last,) = [
    s
    for s in manifest['splits']['train']['shards']
    if s['input']['path'] == str(bad)
  ]
  assert last['documents'] == 2  # 'good one', 'good two'


def test_rerun_is_a_no_op_and_another_key_needs_overwrite(
  corpus, tokenizer_path, tmp_path, capsys
):
  config = _config(tokenizer_path, corpus)
  first = _prepare(config, tmp_path, range_mb=0.05)
  assert _prepare(config, tmp_path, range_mb=0.05) == first
  assert 'already prepared' in capsys.readouterr().out
  config.data.packing = 'concat'
  with pytest.raises(ValueError, match="packing: 'full_sentences' -> 'concat'"):
    _prepare(config, tmp_path, range_mb=0.05)
  assert records.read_manifest(str(tmp_path)) == first  # untouched
  second = _prepare(config, tmp_path, range_mb=0.05, overwrite=True)
  assert second['packing'] == 'concat' and second['key'] != first['key']


def _cli(output, source, tokenizer_path, *extra):
  return [
    sys.executable,
    '-m',
    'pretrain_lm.data.prepare',
    '--config=configs/bert.py:size=tiny',
    f'--output={output}',
    f'--config.data.source={source}',
    '--config.data.eval_source=',
    f'--config.data.eval_holdout_every={EVERY}',
    f'--config.data.seq_len={SEQ_LEN}',
    f'--config.data.tokenizer={tokenizer_path}',
    '--config.model.vocab_size=512',
    *extra,
  ]


def test_killed_prepare_resumes_to_the_same_bytes(
  corpus, tokenizer_path, tmp_path
):
  # Many small ranges, so that the kill lands between two of them.
  killed, whole = tmp_path / 'killed', tmp_path / 'whole'
  args = ['--range_mb=0.01', f'--beam_pipeline_options={IN_MEMORY}']
  cmd = _cli(killed, corpus, tokenizer_path, *args)
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'}
  log = open(tmp_path / 'killed.log', 'w+')  # noqa: SIM115
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
  stats = killed / shards.STATS_DIR
  deadline = time.time() + 120
  while not (stats.exists() and any(stats.glob('*.json'))):
    if proc.poll() is not None or time.time() > deadline:
      log.seek(0)
      pytest.fail(
        f'no shard done before exit or timeout:\n{log.read()[-3000:]}'
      )
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (killed / records.MANIFEST).exists()
  done = len(list(stats.glob('*.json')))
  assert 0 < done < 10, done  # stopped part-way
  run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-3000:]
  # The uninterrupted run on Beam's multi-process runner (all cores).
  cmd = _cli(whole, corpus, tokenizer_path, '--range_mb=0.01')
  run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'MB/s' in run.stdout
  manifests = [records.read_manifest(str(d)) for d in (killed, whole)]
  assert manifests[0]['splits'] == manifests[1]['splits']
  assert manifests[0]['key'] == manifests[1]['key']
  names = sorted(p.name for p in killed.iterdir())
  assert names == sorted(p.name for p in whole.iterdir())  # no leftovers
  for name in names:
    if name.endswith('.array_record'):
      assert (killed / name).read_bytes() == (whole / name).read_bytes()
  assert len(manifests[1]['splits']['train']['shards']) == 10


def test_row_encoder_writes_records_encode_row_bytes():
  encode = shards._RowEncoder()
  rng = np.random.default_rng(0)
  for n in (1, 3, 0):
    ids = rng.integers(0, 1 << 20, size=SEQ_LEN)
    offsets = rng.integers(0, 1 << 40, size=n).tolist()
    assert encode(ids, offsets) == records.encode_row(ids, offsets)


class _FakeBuilder:
  """A prepared TFDS builder of given texts (preparing needs the network)."""

  def __init__(self, texts_by_split):
    self.texts_by_split = texts_by_split
    self.info = type('Info', (), {'features': {'text': None}})

  def is_prepared(self):
    return True

  def as_dataset(self, *, split, shuffle_files, read_config):
    return tf.data.Dataset.from_tensor_slices(
      {'text': self.texts_by_split[str(split)]}
    )


def test_tfds_pieces(tokenizer_path, tmp_path, monkeypatch):
  import tensorflow_datasets as tfds

  pieces = [
    str(tfds.split_for_jax_process('train', process_index=i, process_count=2))
    for i in range(2)
  ]
  texts = {
    pieces[0]: ['the first text.', '  ', ' of piece zero '] * 3,
    pieces[1]: ['piece one says this', 'and that'],
  }
  monkeypatch.setattr(
    tfds, 'builder', lambda name, data_dir: _FakeBuilder(texts)
  )
  config = _config(tokenizer_path, 'tfds:fake', 'doc_sentences')
  config.data.eval_holdout_every = 2
  manifest = _prepare(config, tmp_path, tfds_pieces=2)
  tok = tokenizer_lib.load_tokenizer(tokenizer_path)
  for i, piece in enumerate(pieces):
    docs = [(n, t.strip()) for n, t in enumerate(texts[piece]) if t.strip()]
    for split, held in (('train', False), ('eval', True)):
      shard = manifest['splits'][split]['shards'][i]
      assert shard['input'] == {
        'path': 'tfds:fake',
        'split': piece,
        'start': 0,
        'stop': len(texts[piece]),
      }
      mine = [d for k, d in enumerate(docs) if ((k + 1) % 2 == 0) == held]
      rows = _rows(tmp_path / shard['file'])
      assert [r['input_ids'] for r in rows] == _packed(
        [t for _, t in mine], tok, 'doc_sentences'
      )
      # Example indices in the piece: one document per 'doc_sentences' row.
      assert [r['doc_offsets'] for r in rows] == [[n] for n, _ in mine]
