"""A source's documents as a tf.data pipeline, in a fixed order, by host.

Every function here returns documents in a fixed order, so that the packed
rows built from them are reproducible.
"""

import ml_collections
import tensorflow as tf

from pretrain_lm.data.sources.autograph import no_autograph
from pretrain_lm.data.sources.checks import (
  _checked_files,
  _warn_skipped,
  eval_source,
)
from pretrain_lm.data.sources.scan import _is_text
from pretrain_lm.data.sources.spec import (
  DOC_FORMATS,
  _File,
  _read_text,
  is_tfds,
)
from pretrain_lm.data.sources.tfds_source import tfds_texts

SPLITS = ('train', 'eval')


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


def _file_documents(
  files: list[_File], doc_format: str, max_doc_bytes: int | None = None
) -> tf.data.Dataset:
  """All documents of `files`, in order, as non-blank strings.

  Documents of the 'line' and 'blank_line' formats are stripped; a 'file'
  document is the file's (sliced) text verbatim, newlines included. Unless
  max_doc_bytes is None, bad lines (and 'file' documents) are dropped, as
  doc_fault finds them.
  """
  if doc_format not in DOC_FORMATS:
    raise ValueError(
      f'data.doc_format={doc_format!r} is not one of {DOC_FORMATS}.'
    )
  paths, starts, stops = (list(column) for column in zip(*files, strict=True))
  files_ds = tf.data.Dataset.from_tensor_slices((paths, starts, stops))
  if doc_format == 'file':
    docs = files_ds.map(no_autograph(_read_text))
    if max_doc_bytes is not None:
      docs = docs.filter(no_autograph(lambda doc: _is_text(doc, max_doc_bytes)))
    return docs.filter(
      no_autograph(lambda doc: tf.strings.length(tf.strings.strip(doc)) > 0)
    )
  lines = files_ds.flat_map(no_autograph(_file_lines))
  if max_doc_bytes is not None:
    # Before blocks are joined: a bad line leaves the rest of its block.
    lines = lines.filter(
      no_autograph(lambda line: _is_text(line, max_doc_bytes))
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
      lines.scan(tf.constant(''), no_autograph(add_line))
      .filter(no_autograph(lambda emitted, _: emitted))
      .map(no_autograph(lambda _, block: block))
    )
  docs = docs.map(no_autograph(tf.strings.strip))
  return docs.filter(no_autograph(lambda doc: tf.strings.length(doc) > 0))


def _tfds_documents(
  data_config: ml_collections.ConfigDict,
  source: str,
  field: str,
  split: str,
  process_index: int,
  process_count: int,
) -> tf.data.Dataset:
  """This process's share of a TFDS split, as documents in a fixed order."""
  texts, _ = tfds_texts(
    source,
    field,
    split,
    process_index,
    process_count,
    data_dir=data_config.tfds_data_dir,
    text_key=data_config.tfds_text_key,
  )
  docs = texts.map(no_autograph(tf.strings.strip))
  return docs.filter(no_autograph(lambda doc: tf.strings.length(doc) > 0))


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
      where that is '' (see eval_source), every
      data.eval_holdout_every-th document of data.source (which 'train'
      then leaves out).
    process_index: this host's index.
    process_count: the number of hosts; host i reads files i, i + P, ...
      where there are at least P files (host_files), else documents j with
      j % process_count == i.

  Returns:
    A finite dataset of documents.
  """
  if split not in SPLITS:
    raise ValueError(f'split={split!r} is not one of {SPLITS}.')
  holdout = not eval_source(data_config)
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
  if is_tfds(source):
    # TFDS shards by host itself (tfds.split_for_jax_process).
    docs = _tfds_documents(
      data_config, source, field, tfds_split, process_index, process_count
    )
    shard = False
  else:
    checked = _checked_files(
      data_config, source, field, process_index, process_count
    )
    _warn_skipped(checked, field)
    docs = _file_documents(
      checked.files,
      data_config.doc_format,
      checked.max_doc_bytes if checked.filter_docs else None,
    )
    shard = not checked.by_file
  if holdout:
    in_eval = split == 'eval'
    docs = (
      docs.enumerate()
      .filter(no_autograph(lambda i, _: ((i + 1) % every == 0) == in_eval))
      .map(no_autograph(lambda _, doc: doc))
    )
  if shard and process_count > 1:
    # Shard after the holdout, so that hosts get equal shares of the split.
    docs = docs.shard(process_count, process_index)
  return docs
