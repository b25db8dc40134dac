"""Tests for pretrain_lm.data.sources."""

import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from pretrain_lm import configlib
from pretrain_lm.data import sources


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
def test_blank_file_names_file_and_field(numbered, tmp_path, content):
  blank = tmp_path / 'blank.txt'
  blank.write_text(content)
  with pytest.raises(ValueError) as e:
    sources.check_source(f'{numbered},{blank}', 'data.source')
  assert str(blank) in str(e.value)
  assert 'data.source' in str(e.value)


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


def test_iter_texts(numbered):
  config = _data_config(numbered, eval_holdout_every=5)
  texts = list(sources.iter_texts(config, limit=6))
  assert texts == ['doc 0', 'doc 1', 'doc 2', 'doc 3', 'doc 5', 'doc 6']


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
