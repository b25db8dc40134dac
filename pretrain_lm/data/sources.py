"""Documents from local/gs:// text files or TFDS, split and sharded by host.

A source string is either comma-separated paths or globs ('a.txt,dir/*.txt')
or 'tfds:name[/config][:version]'. A path or glob may end with a TFDS-style
percent slice, 'a.txt[:90%]', 'a.txt[90%:]' or 'a.txt[10%:20%]': each file it
matches is cut to those characters before it is split into documents, as
nanoGPT's `data[:int(n * 0.9)]` / `data[int(n * 0.9):]`, so '[:90%]' and
'[90%:]' of one file partition it. Every function here returns documents in
a fixed order, so that the packed rows built from them are reproducible.
"""

import re
from collections.abc import Iterator
from typing import NamedTuple

import ml_collections
import tensorflow as tf

TFDS_PREFIX = 'tfds:'
# 'line': a document per line; 'blank_line': blocks of lines between blank
# lines; 'file': each file is one document, kept verbatim.
DOC_FORMATS = ('line', 'blank_line', 'file')
SPLITS = ('train', 'eval')
# A trailing [...] holding ':' or '%' is a slice; any other is a glob's
# character class ('shard[01].txt').
_SLICE_SUFFIX = re.compile(r'(.*)\[([^\[\]]*[:%][^\[\]]*)\]')
_SLICE = re.compile(r'(?:(\d+)%)?:(?:(\d+)%)?')


class _File(NamedTuple):
  """A matched file and the percent range [start, stop) of its characters."""

  path: str
  start: int
  stop: int


def _is_tfds(source: str) -> bool:
  return source.startswith(TFDS_PREFIX)


def _patterns(source: str) -> list[str]:
  return [p.strip() for p in source.split(',') if p.strip()]


def _split_slice(entry: str, field: str) -> tuple[str, int, int]:
  """'a.txt[10%:20%]' -> ('a.txt', 10, 20); no slice gives (entry, 0, 100)."""
  suffix = _SLICE_SUFFIX.fullmatch(entry)
  if not suffix:
    return entry, 0, 100
  pattern, spec = suffix.groups()
  bounds = _SLICE.fullmatch(spec.replace(' ', ''))
  start, stop = -1, -1  # malformed unless the slice parses
  if bounds:
    start = int(bounds[1] or 0)
    stop = int(bounds[2] or 100)
  if not 0 <= start < stop <= 100:
    raise ValueError(
      f'{field}: {entry!r} has a malformed slice [{spec}]; use '
      "'path[:P%]', 'path[P%:]' or 'path[P%:Q%]' with whole percents "
      '0 <= P < Q <= 100.'
    )
  return pattern, start, stop


def _match_files(source: str, field: str) -> list[_File]:
  """The files `source` names, in the given order, each glob sorted."""
  files = []
  for entry in _patterns(source):
    pattern, start, stop = _split_slice(entry, field)
    matches = sorted(tf.io.gfile.glob(pattern))
    if not matches:
      raise FileNotFoundError(f'{field}: no file matches {pattern!r}.')
    for path in matches:
      if tf.io.gfile.isdir(path):
        raise IsADirectoryError(
          f'{field}: {path!r} is a directory; name its files, e.g. '
          f"'{path.rstrip('/')}/*.txt'."
        )
    files.extend(_File(path, start, stop) for path in matches)
  return files


def _check_not_blank(path: str, field: str) -> None:
  """Raises unless the file holds some non-whitespace text."""
  with tf.io.gfile.GFile(path, 'rb') as f:
    # Reads only up to the first text, so large files cost one chunk.
    while chunk := f.read(1 << 20):
      if chunk.strip():
        return
  raise ValueError(f'{field}: {path!r} is empty or only whitespace.')


def _tfds_builder(source: str, field: str, data_dir: str):
  """The prepared TFDS builder that `source` names."""
  # Imported here: it takes about a second and most runs read text files.
  import tensorflow_datasets as tfds

  name = source[len(TFDS_PREFIX) :]
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
  except ValueError as e:  # tfds' DatasetNotFoundError lists ~1000 names.
    first_line = str(e).split('\n', 1)[0]
    raise ValueError(
      f'{field}: unknown TFDS dataset {name!r} ({first_line}).'
    ) from None
  if not builder.is_prepared():
    raise FileNotFoundError(
      f'{field}: TFDS dataset {name!r} is not prepared in '
      f'{builder.data_dir!r}. Prepare it where there is network access '
      f'(`tfds build {name} --data_dir=DIR`) and set '
      '--config.data.tfds_data_dir=DIR; runs never download.'
    )
  return builder


def check_source(source: str, field: str, *, tfds_data_dir: str = '') -> None:
  """Fails fast, before any compilation, if `source` cannot give documents.

  Args:
    source: a source string (see the module docstring).
    field: the config field it came from, named in errors.
    tfds_data_dir: where TFDS datasets are prepared ('' for TFDS' default).
  """
  if not source.strip():
    raise ValueError(f'{field} is empty; name text files or a TFDS dataset.')
  if _is_tfds(source):
    _tfds_builder(source, field, tfds_data_dir)
    return
  # A slice of a non-blank file may still be blank, but checking would read
  # the whole file; the pipeline then reports too little text instead.
  for file in _match_files(source, field):
    _check_not_blank(file.path, field)


def check_sources(data_config: ml_collections.ConfigDict) -> None:
  """check_source for data.source and, where set, data.eval_source."""
  if data_config.doc_format not in DOC_FORMATS:
    raise ValueError(
      f'data.doc_format={data_config.doc_format!r} is not one of {DOC_FORMATS}.'
    )
  data_dir = data_config.tfds_data_dir
  check_source(data_config.source, 'data.source', tfds_data_dir=data_dir)
  if data_config.eval_source:
    check_source(
      data_config.eval_source, 'data.eval_source', tfds_data_dir=data_dir
    )


def _read_text(path: tf.Tensor, start: tf.Tensor, stop: tf.Tensor):
  """A file's text, cut to characters [start%, stop%) of it."""
  text = tf.io.read_file(path)
  # Integer floor(n * p / 100) of the code points, as nanoGPT's
  # int(n * 0.9) slices a str; UTF8_CHAR never cuts a character in two.
  n = tf.cast(tf.strings.length(text, unit='UTF8_CHAR'), tf.int64)
  begin = n * tf.cast(start, tf.int64) // 100
  end = n * tf.cast(stop, tf.int64) // 100
  return tf.strings.substr(text, begin, end - begin, unit='UTF8_CHAR')


def _file_lines(path: tf.Tensor, start: tf.Tensor, stop: tf.Tensor):
  """The lines of one file's slice, then a blank line."""
  whole = tf.logical_and(start == 0, stop == 100)
  # A whole file streams line by line; a slice needs the file's length, so
  # a sliced file is read at once. Exactly one of the two is non-empty.
  streamed = tf.data.TextLineDataset(tf.boolean_mask([path], [whole]))
  sliced = tf.cond(
    whole,
    lambda: tf.zeros([0], tf.string),
    lambda: tf.strings.split(_read_text(path, start, stop), '\n'),
  )
  # TextLineDataset drops a '\r' before '\n' too.
  sliced = tf.strings.regex_replace(sliced, '\r$', '')
  # The blank line ends the file's last block, so blocks never span files.
  return streamed.concatenate(
    tf.data.Dataset.from_tensor_slices(sliced)
  ).concatenate(tf.data.Dataset.from_tensors(tf.constant('')))


def _file_documents(files: list[_File], doc_format: str) -> tf.data.Dataset:
  """All documents of `files`, in order, as non-blank strings.

  Documents of the 'line' and 'blank_line' formats are stripped; a 'file'
  document is the file's (sliced) text verbatim, newlines included.
  """
  if doc_format not in DOC_FORMATS:
    raise ValueError(
      f'data.doc_format={doc_format!r} is not one of {DOC_FORMATS}.'
    )
  paths, starts, stops = (list(column) for column in zip(*files, strict=True))
  files_ds = tf.data.Dataset.from_tensor_slices((paths, starts, stops))
  if doc_format == 'file':
    docs = files_ds.map(_read_text)
    return docs.filter(lambda doc: tf.strings.length(tf.strings.strip(doc)) > 0)
  lines = files_ds.flat_map(_file_lines)
  if doc_format == 'line':
    docs = lines
  else:

    def add_line(block, line):
      """Appends `line` to `block`; a blank line emits the block."""
      blank = tf.strings.length(tf.strings.strip(line)) == 0
      joined = tf.where(
        block == '', line, tf.strings.join([block, line], separator='\n')
      )
      return tf.where(blank, '', joined), (blank, block)

    docs = (
      lines.scan(tf.constant(''), add_line)
      .filter(lambda emitted, _: emitted)
      .map(lambda _, block: block)
    )
  docs = docs.map(tf.strings.strip)
  return docs.filter(lambda doc: tf.strings.length(doc) > 0)


def _tfds_documents(
  data_config: ml_collections.ConfigDict,
  source: str,
  field: str,
  split: str,
  process_index: int,
  process_count: int,
) -> tf.data.Dataset:
  """This process's share of a TFDS split, as documents in a fixed order."""
  import tensorflow_datasets as tfds

  builder = _tfds_builder(source, field, data_config.tfds_data_dir)
  key = data_config.tfds_text_key
  if key not in builder.info.features:
    raise KeyError(
      f'data.tfds_text_key={key!r} is not a feature of {source!r}; it has '
      f'{sorted(builder.info.features)}.'
    )
  ds = builder.as_dataset(
    split=tfds.split_for_jax_process(
      split, process_index=process_index, process_count=process_count
    ),
    shuffle_files=False,
    read_config=tfds.ReadConfig(try_autocache=False),
  )
  docs = ds.map(lambda example: tf.strings.strip(example[key]))
  return docs.filter(lambda doc: tf.strings.length(doc) > 0)


def documents(
  data_config: ml_collections.ConfigDict,
  *,
  split: str,
  process_index: int,
  process_count: int,
) -> tf.data.Dataset:
  """This host's documents of `split`, as scalar tf.string, in a fixed order.

  Args:
    data_config: the config's `data` section.
    split: 'train' reads data.source; 'eval' reads data.eval_source, or,
      where that is '', every data.eval_holdout_every-th document of
      data.source (which 'train' then leaves out).
    process_index: this host's index.
    process_count: the number of hosts; host i gets documents j with
      j % process_count == i.

  Returns:
    A finite dataset of documents.
  """
  if split not in SPLITS:
    raise ValueError(f'split={split!r} is not one of {SPLITS}.')
  holdout = not data_config.eval_source
  if split == 'eval' and not holdout:
    source, field = data_config.eval_source, 'data.eval_source'
    tfds_split = data_config.tfds_eval_split
  else:
    source, field = data_config.source, 'data.source'
    tfds_split = data_config.tfds_split
  every = data_config.eval_holdout_every
  if holdout and every < 2:
    raise ValueError(
      f'data.eval_holdout_every={every} must be >= 2 (or set '
      'data.eval_source), else nothing is left to train on.'
    )
  if _is_tfds(source):
    # TFDS shards by host itself (tfds.split_for_jax_process).
    docs = _tfds_documents(
      data_config, source, field, tfds_split, process_index, process_count
    )
    shard = False
  else:
    files = _match_files(source, field)
    docs = _file_documents(files, data_config.doc_format)
    shard = True
  if holdout:
    in_eval = split == 'eval'
    docs = (
      docs.enumerate()
      .filter(lambda i, _: ((i + 1) % every == 0) == in_eval)
      .map(lambda _, doc: doc)
    )
  if shard and process_count > 1:
    # Shard after the holdout, so that hosts get equal shares of the split.
    docs = docs.shard(process_count, process_index)
  return docs


def iter_texts(
  data_config: ml_collections.ConfigDict, *, limit: int
) -> Iterator[str]:
  """Up to `limit` training documents, all hosts' (to train a tokenizer)."""
  docs = documents(data_config, split='train', process_index=0, process_count=1)
  for doc in docs.take(limit).as_numpy_iterator():
    yield doc.decode('utf-8')
