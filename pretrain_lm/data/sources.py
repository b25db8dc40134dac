"""Documents from local/gs:// text files or TFDS, split and sharded by host.

A source string is either comma-separated paths or globs ('a.txt,dir/*.txt')
or 'tfds:name[/config][:version]'. Every function here returns documents in
a fixed order, so that the packed rows built from them are reproducible.
"""

from collections.abc import Iterator

import ml_collections
import tensorflow as tf

TFDS_PREFIX = 'tfds:'
DOC_FORMATS = ('line', 'blank_line')
SPLITS = ('train', 'eval')


def _is_tfds(source: str) -> bool:
  return source.startswith(TFDS_PREFIX)


def _patterns(source: str) -> list[str]:
  return [p.strip() for p in source.split(',') if p.strip()]


def _match_files(source: str, field: str) -> list[str]:
  """The files `source` names, in the given order, each glob sorted."""
  files = []
  for pattern in _patterns(source):
    matches = sorted(tf.io.gfile.glob(pattern))
    if not matches:
      raise FileNotFoundError(f'{field}: no file matches {pattern!r}.')
    for path in matches:
      if tf.io.gfile.isdir(path):
        raise IsADirectoryError(
          f'{field}: {path!r} is a directory; name its files, e.g. '
          f"'{path.rstrip('/')}/*.txt'."
        )
    files.extend(matches)
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
  for path in _match_files(source, field):
    _check_not_blank(path, field)


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


def _file_documents(files: list[str], doc_format: str) -> tf.data.Dataset:
  """All documents of `files`, in order, as stripped non-empty strings."""
  if doc_format not in DOC_FORMATS:
    raise ValueError(
      f'data.doc_format={doc_format!r} is not one of {DOC_FORMATS}.'
    )
  # A blank line after each file ends its last block, so blocks never span
  # files.
  lines = tf.data.Dataset.from_tensor_slices(files).flat_map(
    lambda f: tf.data.TextLineDataset(f).concatenate(
      tf.data.Dataset.from_tensors(tf.constant(''))
    )
  )
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
