"""Tests for pretrain_lm.data.sources."""

import os

import ml_collections
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from pretrain_lm import configlib
from pretrain_lm.data import pipeline, sources
from pretrain_lm.data.sources import sampling, scan


def _data_config(source, eval_source='', **overrides):
  config = configlib.base_config().data
  config.source = str(source)
  config.eval_source = str(eval_source)
  config.update(overrides)
  return config


def _docs(config, split='train', process_index=0, process_count=1):
  ds = sources.documents(
    config,
    split=split,
    process_index=process_index,
    process_count=process_count,
  )
  return [d.decode('utf-8') for d in ds.as_numpy_iterator()]


@pytest.fixture
def numbered(tmp_path):
  """A file of 25 one-line documents 'doc 0' ... 'doc 24', with blanks."""
  path = tmp_path / 'numbered.txt'
  lines = []
  for i in range(25):
    lines += [f' doc {i} ', ''] if i % 3 else [f'doc {i}']
  path.write_text('\n'.join(lines) + '\n')
  return path


def test_missing_path_names_pattern_and_field(tmp_path):
  missing = str(tmp_path / 'missing.txt')
  with pytest.raises(FileNotFoundError, match=f"data.source: .*'{missing}'"):
    sources.check_source(missing, 'data.source')


def test_missing_glob_among_several(numbered, tmp_path):
  pattern = str(tmp_path / 'shards' / '*.txt')
  with pytest.raises(FileNotFoundError) as e:
    sources.check_source(f'{numbered},{pattern}', 'data.eval_source')
  assert 'data.eval_source' in str(e.value)
  assert pattern in str(e.value)


@pytest.mark.parametrize('content', ['', '  \n\n\t \n'])
def test_blank_file_is_skipped_or_fails_naming_file(
  numbered, tmp_path, content
):
  blank = tmp_path / 'blank.txt'
  blank.write_text(content)
  source = f'{numbered},{blank}'
  config = _data_config(source, eval_source='x')
  sources.check_source(source, 'data.source', data_config=config)
  assert sources.skipped_input(config)['data/skipped_empty_file'] == 1
  config.bad_input = 'fail'
  with pytest.raises(ValueError) as e:
    sources.check_source(source, 'data.source', data_config=config)
  assert f"data.source: '{blank}' at byte 0" in str(e.value)
  # Alone, it is a source with no usable text, whatever the policy.
  with pytest.raises(ValueError, match='no usable text.*1 empty_file'):
    sources.check_source(str(blank), 'data.source')


def test_directory_is_an_error(tmp_path):
  with pytest.raises(IsADirectoryError, match='data.source'):
    sources.check_source(str(tmp_path), 'data.source')


def test_good_sources_pass(numbered):
  sources.check_source(str(numbered), 'data.source')
  sources.check_source(configlib.base_config().data.source, 'data.source')


def test_check_sources(numbered, tmp_path):
  sources.check_sources(_data_config(numbered, eval_source=numbered))
  sources.check_sources(_data_config(numbered))  # eval held out of source
  missing = str(tmp_path / 'missing.txt')
  with pytest.raises(FileNotFoundError, match='data.eval_source'):
    sources.check_sources(_data_config(numbered, eval_source=missing))
  with pytest.raises(ValueError, match='data.doc_format'):
    sources.check_sources(_data_config(numbered, doc_format='lines'))


def test_line_format(numbered):
  config = _data_config(numbered, eval_source=numbered)
  assert _docs(config) == [f'doc {i}' for i in range(25)]


def test_blank_line_format(tmp_path):
  (tmp_path / 'a.txt').write_text('a1\n a2 \n\n\n  \na3\n\n')
  # No final newline, and blocks never run on into the next file.
  (tmp_path / 'b.txt').write_text('b1\nb2')
  (tmp_path / 'c.txt').write_text('\nc1\n')
  config = _data_config(
    str(tmp_path / '*.txt'), eval_source='x', doc_format='blank_line'
  )
  assert _docs(config) == ['a1\n a2', 'a3', 'b1\nb2', 'c1']
  config.doc_format = 'line'
  assert _docs(config) == ['a1', 'a2', 'a3', 'b1', 'b2', 'c1']


def test_unknown_doc_format(numbered):
  config = _data_config(numbered, doc_format='paragraph')
  with pytest.raises(ValueError, match='data.doc_format'):
    _docs(config)


def test_files_in_given_order_globs_sorted(tmp_path):
  for name in ('b', 'a', 'c'):
    (tmp_path / f'{name}.txt').write_text(f'{name}\n')
  config = _data_config(
    f'{tmp_path / "c.txt"},{tmp_path / "[ab].txt"}', eval_source='x'
  )
  assert _docs(config) == ['c', 'a', 'b']


def test_holdout_split(numbered):
  config = _data_config(numbered, eval_holdout_every=4)
  train, held_out = _docs(config, 'train'), _docs(config, 'eval')
  assert held_out == [f'doc {i}' for i in (3, 7, 11, 15, 19, 23)]
  assert train == [f'doc {i}' for i in range(25) if (i + 1) % 4]


def test_eval_source_replaces_holdout(numbered, tmp_path):
  other = tmp_path / 'other.txt'
  other.write_text('x\ny\n')
  config = _data_config(numbered, eval_source=other)
  assert _docs(config, 'eval') == ['x', 'y']
  assert len(_docs(config, 'train')) == 25


def test_the_bundled_eval_file_goes_with_the_bundled_source_only(numbered):
  # Another source with the default eval_source holds out of that source
  # instead of evaluating on WikiText-2's test file.
  config = _data_config(
    numbered, eval_source=configlib.BUNDLED_EVAL, eval_holdout_every=4
  )
  assert sources.eval_source(config) == ''
  assert _docs(config, 'eval') == [f'doc {i}' for i in (3, 7, 11, 15, 19, 23)]
  default = configlib.base_config().data
  assert sources.eval_source(default) == configlib.BUNDLED_EVAL
  explicit = _data_config(numbered, eval_source=numbered)
  assert sources.eval_source(explicit) == str(numbered)


def test_holdout_every_must_leave_training_data(numbered):
  with pytest.raises(ValueError, match='data.eval_holdout_every'):
    _docs(_data_config(numbered, eval_holdout_every=1))


@pytest.mark.parametrize('split', ['train', 'eval'])
def test_host_shards_partition_the_split(numbered, split):
  config = _data_config(numbered, eval_holdout_every=3)
  everything = _docs(config, split)
  shards = [_docs(config, split, i, 3) for i in range(3)]
  assert sorted(sum(shards, [])) == sorted(everything)
  assert len(set(sum(shards, []))) == len(everything)
  # Host i gets documents j with j % 3 == i, in order.
  for i, shard in enumerate(shards):
    assert shard == everything[i::3]


def test_iter_texts_samples_the_whole_training_split(numbered):
  config = _data_config(numbered, eval_holdout_every=5)
  train = _docs(config, 'train')
  texts = list(sources.iter_texts(config, limit=6))
  # Training documents only, in stream order, not the first six.
  assert len(set(texts)) == 6 and set(texts) <= set(train)
  assert texts == sorted(texts, key=train.index)
  assert texts != train[:6]
  assert list(sources.iter_texts(config, limit=6)) == texts  # seeded
  config.seed = 1
  assert list(sources.iter_texts(config, limit=6)) != texts
  assert list(sources.iter_texts(config, limit=100)) == train


def test_iter_texts_reads_windows_of_a_large_source(tmp_path, monkeypatch):
  # Past _SAMPLE_WHOLE_BYTES, documents come from windows at random
  # offsets of every file, not the head of the first.
  monkeypatch.setattr(sampling, '_SAMPLE_WHOLE_BYTES', 1000)
  for name in 'ab':
    lines = [f'{name} line {i} ' + 'x' * 40 for i in range(20000)]
    (tmp_path / f'{name}.txt').write_text('\n'.join(lines) + '\n')
  config = _data_config(f'{tmp_path}/*.txt')
  texts = list(sources.iter_texts(config, limit=500))
  assert len(texts) == 500
  files = {t.split()[0] for t in texts}
  numbers = [int(t.split()[2]) for t in texts]
  assert files == {'a', 'b'} and max(numbers) > 15000 and min(numbers) < 5000
  assert all(t.endswith('x' * 40) for t in texts)  # whole lines only


def test_unknown_tfds_dataset(tmp_path):
  with pytest.raises(ValueError, match="unknown TFDS dataset 'no_such_ds_x'"):
    sources.check_source(
      'tfds:no_such_ds_x', 'data.source', tfds_data_dir=str(tmp_path)
    )


def test_unprepared_tfds_dataset(tmp_path):
  with pytest.raises(FileNotFoundError, match='not prepared'):
    sources.check_source(
      'tfds:imdb_reviews/plain_text:1.0.0',
      'data.source',
      tfds_data_dir=str(tmp_path),
    )
  config = _data_config('tfds:imdb_reviews', tfds_data_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError, match='not prepared'):
    _docs(config)


class _FakeBuilder:
  """Stands in for a prepared TFDS builder (preparing needs the network)."""

  def __init__(self, texts_by_split):
    self.texts_by_split = texts_by_split
    self.info = type('Info', (), {'features': {'text': None, 'label': None}})
    self.as_dataset_calls = []

  def is_prepared(self):
    return True

  def as_dataset(self, *, split, shuffle_files, read_config):
    self.as_dataset_calls.append((split, shuffle_files))
    return tf.data.Dataset.from_tensor_slices(
      {'text': self.texts_by_split[str(split)], 'label': [0, 1, 2]}
    )


def test_tfds_documents(monkeypatch):
  shard = tfds.split_for_jax_process('train', process_index=1, process_count=2)
  builder = _FakeBuilder({str(shard): ['a', '  ', ' b ']})
  calls = []

  def fake_builder(name, data_dir):
    calls.append((name, data_dir))
    return builder

  monkeypatch.setattr(tfds, 'builder', fake_builder)
  config = _data_config('tfds:wiki/en:1.0.0', tfds_data_dir='/data/tfds')
  assert _docs(config, 'train', 1, 2) == ['a', 'b']
  assert calls[-1] == ('wiki/en:1.0.0', '/data/tfds')
  assert builder.as_dataset_calls == [(shard, False)]
  config.tfds_text_key = 'content'
  with pytest.raises(KeyError, match='data.tfds_text_key'):
    _docs(config, 'train', 1, 2)


# Multi-byte characters, so slicing by characters differs from bytes.
BOOK = 'First Citizen:\n  Before we proceed — any further, hear me.\n\n' * 9
BOOK += 'Café crème ü ß 漢字\nLast line, no newline'


@pytest.fixture
def book(tmp_path):
  path = tmp_path / 'book.txt'
  path.write_bytes(BOOK.encode('utf-8'))
  return path


@pytest.mark.parametrize('cut', [BOOK, BOOK[:7], BOOK[:1000], BOOK[:517]])
def test_slices_partition_the_file_like_python(tmp_path, cut):
  path = tmp_path / 'book.txt'
  path.write_bytes(cut.encode('utf-8'))
  n = len(cut)
  # nanoGPT's split: data[:int(n * 0.9)] and data[int(n * 0.9):].
  want = {
    '[:90%]': cut[: int(n * 0.9)],
    '[90%:]': cut[int(n * 0.9) :],
    '[10%:20%]': cut[int(n * 0.1) : int(n * 0.2)],
    '[:100%]': cut,
  }
  for suffix, text in want.items():
    source = f'{path}{suffix}'
    sources.check_source(source, 'data.source')
    config = _data_config(source, eval_source='x', doc_format='file')
    assert _docs(config) == ([text] if text.strip() else []), suffix
  halves = [
    _docs(_data_config(f'{path}{s}', eval_source='x', doc_format='file'))
    for s in ('[:90%]', '[90%:]')
  ]
  assert ''.join(sum(halves, [])) == cut


def test_file_format_keeps_the_text_verbatim(book, tmp_path):
  blank = tmp_path / 'blank.txt'
  blank.write_text(' \n\n')
  other = tmp_path / 'other.txt'
  other.write_text('\n  indented\r\nend\n')
  config = _data_config(
    f'{book},{blank},{other}', eval_source='x', doc_format='file'
  )
  # A blank file is no document.
  assert _docs(config) == [BOOK, '\n  indented\r\nend\n']
  assert 'file' in sources.DOC_FORMATS


def test_line_formats_apply_after_the_slice(book):
  n = len(BOOK)
  head = BOOK[: int(n * 0.5)]
  config = _data_config(f'{book}[:50%]', eval_source='x')
  want = [line.strip() for line in head.split('\n') if line.strip()]
  assert _docs(config) == want
  # A cut inside a line splits it: its start is the head's last document,
  # its end the tail's first.
  tail = BOOK[int(n * 0.5) :]
  config.source = f'{book}[50%:]'
  assert _docs(config) == [
    line.strip() for line in tail.split('\n') if line.strip()
  ]
  config.doc_format = 'blank_line'
  assert _docs(config) == [
    block.strip() for block in tail.split('\n\n') if block.strip()
  ]


def test_slice_applies_to_each_matched_file(tmp_path):
  texts = {'a.txt': 'aaaa\nAAAA\n', 'b.txt': 'bb\nBB\nbb\nBB\n'}
  for name, text in texts.items():
    (tmp_path / name).write_text(text)
  (tmp_path / 'c.txt').write_text('c1\nc2\n')
  source = f'{tmp_path / "*.txt"}[:50%],{tmp_path / "c.txt"}[50%:]'
  config = _data_config(source, eval_source='x', doc_format='file')
  sources.check_source(source, 'data.source')
  # c.txt is matched twice: its first half by the glob, then its second.
  assert _docs(config) == ['aaaa\n', 'bb\nBB\n', 'c1\n', 'c2\n']
  # A glob's character class is no slice.
  config.source = str(tmp_path / '[ab].txt')
  assert _docs(config) == list(texts.values())
  config.source = str(tmp_path / '[ab].txt') + '[50%:]'
  assert _docs(config) == ['AAAA\n', 'bb\nBB\n']


@pytest.mark.parametrize(
  'suffix', ['[:190%]', '[a:b]', '[50%:10%]', '[:90]', '[10%]', '[5%:5%]']
)
def test_malformed_slice(book, suffix):
  source = f'{book}{suffix}'
  with pytest.raises(ValueError) as e:
    sources.check_source(source, 'data.eval_source')
  assert 'data.eval_source' in str(e.value)
  assert source in str(e.value)


def test_missing_file_with_slice(tmp_path):
  missing = str(tmp_path / 'missing.txt')
  with pytest.raises(FileNotFoundError, match=f"'{missing}'"):
    sources.check_source(f'{missing}[:90%]', 'data.source')


# A corpus of bad input around good documents. Byte offsets of the faults
# are found in the bytes themselves, so the test states no magic numbers.
GOOD = b'good one\n  \n\tgood two \r\n'
BAD_UTF8 = b'caf\xc3\xa9 then \xff\xfe junk\n'
CONTROL = b'\x01\x02\x03\x04\x05\x06 ok\n'
NUL_LINE = b'nul\x00in a line\n'
LONG = b'x' * 300 + b'\n'
MIXED = GOOD + BAD_UTF8 + b'good three\n' + CONTROL + LONG + NUL_LINE + b'end'


@pytest.fixture
def corpus(tmp_path):
  """Good documents among every kind of bad input, one kind per file."""
  files = {
    'a_empty.txt': b'',
    'b_mixed.txt': MIXED,
    'c_binary.bin': bytes(range(256)) * 40 + b'\n' + bytes(range(256)),
    'd_spaces.txt': b'  \n\t\n \n',
    'e_good.txt': 'zwölf\n\nlast\n'.encode(),
  }
  for name, data in files.items():
    (tmp_path / name).write_bytes(data)
  return tmp_path


def _bad_config(corpus, **overrides):
  return _data_config(
    str(corpus / '*'),
    **{'eval_holdout_every': 1000, 'max_doc_bytes': 200, **overrides},
  )


def test_bad_input_is_skipped_and_counted(corpus):
  config = _bad_config(corpus)
  sources.check_sources(config)
  assert _docs(config) == [
    'good one',
    'good two',
    'good three',
    'end',
    'zwölf',
    'last',
  ]
  assert sources.skipped_input(config) == {
    'data/skipped_empty_file': 2,  # a_empty and d_spaces
    'data/skipped_binary': 3,  # c_binary whole; the control and NUL lines
    'data/skipped_invalid_utf8': 1,
    'data/skipped_too_long': 1,
    'data/skipped_whitespace_only': 1,  # '  ' in b_mixed
  }
  # A bad line leaves the rest of its block.
  config.doc_format = 'blank_line'
  assert _docs(config) == [
    'good one',
    'good two \ngood three\nend',
    'zwölf',
    'last',
  ]


def test_file_format_skips_bad_files_whole(corpus):
  config = _bad_config(corpus, doc_format='file', max_doc_bytes=10_000)
  assert _docs(config) == ['zwölf\n\nlast\n']
  counts = sources.skipped_input(config)
  # c_binary, and b_mixed for its NUL (the first test of doc_fault).
  assert counts['data/skipped_binary'] == 2
  assert counts['data/skipped_empty_file'] == 2
  config.max_doc_bytes = 10
  with pytest.raises(ValueError, match='no usable text.*2 too_long'):
    _docs(config)


@pytest.mark.parametrize(
  'name, data, offset, words',
  [
    ('a.txt', b'', 0, 'empty'),
    ('b.txt', MIXED, MIXED.index(b'\xff'), 'invalid UTF-8'),
    (
      'b.txt',
      MIXED.replace(BAD_UTF8, b''),
      MIXED.index(CONTROL) - len(BAD_UTF8),
      'binary',
    ),
    ('b.txt', GOOD + LONG, len(GOOD), 'longer than data.max_doc_bytes=200'),
    ('b.txt', GOOD + NUL_LINE, len(GOOD) + 3, 'binary'),
    ('c.bin', bytes(range(256)) * 4, 0, 'binary'),
  ],
)
def test_fail_names_file_and_byte_offset(tmp_path, name, data, offset, words):
  (tmp_path / name).write_bytes(data)
  (tmp_path / 'z.txt').write_bytes(b'fine\n')
  config = _bad_config(tmp_path, bad_input='fail')
  with pytest.raises(ValueError) as e:
    sources.check_sources(config)
  message = str(e.value)
  assert f"data.source: '{tmp_path / name}' at byte {offset}:" in message
  assert words in message and "data.bad_input='skip'" in message


def test_whitespace_only_lines_never_fail(tmp_path):
  (tmp_path / 'a.txt').write_bytes(b'one\n \n\t\ntwo\n')
  config = _bad_config(tmp_path, bad_input='fail')
  assert _docs(config) == ['one', 'two']
  # The bundled corpus is clean but for its ' ' separator lines.
  config = _data_config(configlib.base_config().data.source, bad_input='fail')
  sources.check_sources(config)
  counts = sources.skipped_input(config)
  assert counts.pop('data/skipped_whitespace_only') > 0
  assert set(counts.values()) == {0}


def test_all_bad_source_fails_at_check_naming_counts(tmp_path):
  (tmp_path / 'a.txt').write_bytes(b'')
  (tmp_path / 'b.txt').write_bytes(BAD_UTF8 + LONG)
  config = _bad_config(tmp_path)
  with pytest.raises(ValueError) as e:
    sources.check_sources(config)
  message = str(e.value)
  assert f"data.source='{tmp_path / '*'}' has no usable text" in message
  assert '1 empty_file' in message and '1 invalid_utf8' in message
  assert '1 too_long' in message


def test_bad_lines_are_cut_from_a_slice(tmp_path):
  text = b'alpha\n' + BAD_UTF8 + b'beta\n' * 8
  (tmp_path / 'a.txt').write_bytes(text)
  config = _bad_config(tmp_path)
  config.source = f'{tmp_path / "a.txt"}[:50%]'
  docs = _docs(config)  # the cut falls inside a 'beta'
  assert docs[0] == 'alpha' and 2 <= len(docs) <= 4
  assert all(doc in ('beta', 'bet', 'be', 'b') for doc in docs[1:])
  assert sources.skipped_input(config)['data/skipped_invalid_utf8'] == 1
  config.source = f'{tmp_path / "a.txt"}[50%:]'
  assert sources.skipped_input(config)['data/skipped_invalid_utf8'] == 0
  config.bad_input = 'fail'
  config.source = f'{tmp_path / "a.txt"}[:50%]'
  offset = text.index(BAD_UTF8) + BAD_UTF8.index(b'\xff')
  with pytest.raises(ValueError, match=f'at byte {offset}:'):
    sources.check_sources(config)


def test_a_line_longer_than_a_read_chunk(tmp_path, monkeypatch):
  monkeypatch.setattr(scan, '_CHUNK_BYTES', 64)
  text = b'a\n' + b'y' * 1000 + b'\nb\n' + b' ' * 500 + b'\nc'
  (tmp_path / 'a.txt').write_bytes(text)
  config = _bad_config(tmp_path)
  assert _docs(config) == ['a', 'b', 'c']
  counts = sources.skipped_input(config)
  assert counts['data/skipped_too_long'] == 1
  config.bad_input = 'fail'
  with pytest.raises(ValueError, match='at byte 2: a document longer'):
    sources.check_sources(config)


@pytest.mark.parametrize(
  'doc',
  [
    b'plain',
    'café 漢字 😀'.encode(),
    b'\xef\xbb\xbfbom',
    b'a\xffb',
    b'\xe6\x97',
    b'\xed\xa0\x80',  # an encoded surrogate
    b'\xc0\x80',  # overlong
    b'\xf4\x90\x80\x80',  # beyond U+10FFFF
    b'a\x00b',
    b'\x1b[1mbold\x1b[0m',
    b'\x01\x02\x03ab',
    b'\x01\x02ab',
    b'z' * 201,
    b'z' * 200,
  ],
)
def test_python_scan_and_tf_filter_agree(doc):
  want = scan.doc_fault(doc, 200) is None
  assert bool(scan._is_text(tf.constant(doc), 200)) == want


def test_hosts_scan_and_read_only_their_own_files(corpus, monkeypatch):
  # 5 files, 2 hosts: host i has files i, i + 2, ... and scans no other.
  config = _bad_config(corpus)
  everything = _docs(config)
  names = sorted(p.name for p in corpus.iterdir())
  scanned = []
  real_scan = scan._scan_file
  monkeypatch.setattr(
    scan,
    '_scan_file',
    lambda file, *a: scanned.append(file.path) or real_scan(file, *a),
  )
  scan._SCANS.clear()
  shards = []
  for i in range(2):
    scanned.clear()
    sources.check_sources(config, process_index=i, process_count=2)
    mine = names[i::2]
    assert sorted(os.path.basename(p) for p in scanned) == mine
    shards.append(_docs(config, 'train', i, 2))
    alone = _bad_config(corpus)
    alone.source = ','.join(str(corpus / n) for n in mine)
    assert shards[-1] == _docs(alone)
  assert sorted(sum(shards, [])) == sorted(everything)


def test_bad_input_skipped_before_host_sharding(corpus):
  # One file, fewer than the hosts: the hosts share its documents.
  config = _bad_config(corpus)
  config.source = str(corpus / 'b_mixed.txt')
  everything = _docs(config)
  shards = [_docs(config, 'train', i, 2) for i in range(2)]
  assert shards == [everything[0::2], everything[1::2]]


def test_configs_saved_before_the_fields_get_defaults(corpus):
  config = _bad_config(corpus).to_dict()
  del config['bad_input'], config['max_doc_bytes']
  old = ml_collections.ConfigDict(config)
  assert _docs(old)[:3] == ['good one', 'good two', 'good three']


def test_skipped_input_is_in_the_pipeline_metrics(corpus):
  config = configlib.base_config()
  config.data = _bad_config(corpus)
  skipped = pipeline.skipped_input(config)
  assert skipped == sources.skipped_input(config.data)
  assert skipped['data/skipped_invalid_utf8'] == 1
