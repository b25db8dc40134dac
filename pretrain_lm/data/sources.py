"""Documents from local/gs:// text files or TFDS, split and sharded by host.

A source string is either comma-separated paths or globs ('a.txt,dir/*.txt')
or 'tfds:name[/config][:version]'. A path or glob may end with a TFDS-style
percent slice, 'a.txt[:90%]', 'a.txt[90%:]' or 'a.txt[10%:20%]': each file it
matches is cut to those characters before it is split into documents, as
nanoGPT's `data[:int(n * 0.9)]` / `data[int(n * 0.9):]`, so '[:90%]' and
'[90%:]' of one file partition it. Every function here returns documents in
a fixed order, so that the packed rows built from them are reproducible.

Local files are scanned once per process before they are read: empty
files, binary data, invalid UTF-8 and documents over data.max_doc_bytes are
skipped and counted (data.bad_input='skip') or fail with the file and byte
offset ('fail'); a source with no usable text fails either way. TFDS
datasets are left to TFDS' own checks.
"""

import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging

from pretrain_lm import configlib


def no_autograph(fn):
  """`fn` as tf.data should trace it: as written, without AutoGraph.

  Every function this package hands to tf.data (map, filter, scan,
  flat_map) expresses data-dependent control flow with TF ops (tf.cond,
  tf.where) and uses Python only for what is static, so AutoGraph's source
  rewrite would change nothing, yet it cost most of the time it takes to
  build a pretraining pipeline (tests/pipeline_test.py checks that none of
  our functions is converted).
  """
  return tf.autograph.experimental.do_not_convert(fn)


TFDS_PREFIX = 'tfds:'
# 'line': a document per line; 'blank_line': blocks of lines between blank
# lines; 'file': each file is one document, kept verbatim.
DOC_FORMATS = ('line', 'blank_line', 'file')
SPLITS = ('train', 'eval')
BAD_INPUT_POLICIES = ('skip', 'fail')
# What the scan skips, counted in documents (a line, block or file) and
# reported in the metrics as 'data/skipped_<category>'. Whitespace-only
# lines are counted but never fatal: many corpora use ' ' lines as
# separators (WikiText has a thousand per file).
BAD_INPUT = (
  'empty_file',
  'binary',
  'invalid_utf8',
  'too_long',
  'whitespace_only',
)
_FATAL = BAD_INPUT[:-1]
_DESCRIBE = {
  'empty_file': 'an empty or whitespace-only file',
  'binary': 'binary data (a NUL byte, or mostly control characters)',
  'invalid_utf8': 'invalid UTF-8',
  'too_long': 'a document longer than data.max_doc_bytes={max_doc_bytes}',
  'whitespace_only': 'a whitespace-only line',
}
# Bytes that are not text: C0 controls but tab, LF, VT, FF and CR; and DEL.
_CONTROL = bytes([*range(9), *range(14, 32), 127])
# A NUL in a file's first 8 KiB marks the whole file binary (as git and GNU
# grep decide) when that head is no text either: an image or archive a glob
# caught is skipped whole, not split into thousands of bad lines.
_SNIFF_BYTES = 8192
_CHUNK_BYTES = 1 << 23
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


class _Scan(NamedTuple):
  """One file's (or slice's) bad input, from _scan_file."""

  counts: dict[str, int]  # category -> documents skipped
  faults: list[tuple[int, str]]  # (byte offset, category), file order
  usable: bool  # holds at least one good document


def _fault(doc: bytes, max_doc_bytes: int) -> tuple[int, str] | None:
  """(offset in `doc`, category) of why a non-blank `doc` is bad, or None.

  _is_text is the same test in TF ops; the two must agree.
  """
  if len(doc) > max_doc_bytes:
    return 0, 'too_long'
  nul = doc.find(b'\0')
  if nul >= 0:
    return nul, 'binary'
  try:
    doc.decode('utf-8')
  except UnicodeDecodeError as e:
    return e.start, 'invalid_utf8'
  if 2 * (len(doc) - len(doc.translate(None, _CONTROL))) > len(doc):
    return 0, 'binary'
  return None


def _is_text(doc: tf.Tensor, max_doc_bytes: int) -> tf.Tensor:
  """False where _fault finds bad input; blank documents pass (separators)."""
  size = tf.strings.length(doc)
  raw = tf.io.decode_raw(doc, tf.uint8)
  control = (raw < 9) | ((raw >= 14) & (raw < 32)) | (raw == 127)
  num_control = tf.reduce_sum(tf.cast(control, tf.int32))
  # Transcoding drops invalid sequences, so only valid UTF-8 keeps its size.
  valid = size == tf.strings.length(
    tf.strings.unicode_transcode(doc, 'UTF-8', 'UTF-8', errors='ignore')
  )
  good = (
    (size <= max_doc_bytes)
    & ~tf.reduce_any(raw == 0)
    & valid
    & (2 * num_control <= size)
  )
  return good | (tf.strings.length(tf.strings.strip(doc)) == 0)


def _binary_head(head: bytes) -> bool:
  """Whether a file starting with `head` (which holds a NUL) is no text.

  A stray NUL or bad sequence in text only spoils its line; in a binary
  file (compressed, an image) over a quarter of the bytes are controls or
  invalid UTF-8.
  """
  valid = len(head.decode('utf-8', errors='ignore').encode('utf-8'))
  control = len(head) - len(head.translate(None, _CONTROL))
  return 4 * (len(head) - valid + control) > len(head)


def _binary_offset(path: str) -> int | None:
  """The offset of a NUL that marks the file binary (_binary_head), or None."""
  with tf.io.gfile.GFile(path, 'rb') as f:
    head = f.read(_SNIFF_BYTES)
  nul = head.find(b'\0')
  return nul if nul >= 0 and _binary_head(head) else None


def _slice_bytes(path: str, start: int, stop: int) -> tuple[bytes, int]:
  """A file's slice exactly as the pipeline cuts it, and its byte offset."""
  # By TF's character count, as _file_lines reads it.
  text = _read_text(path, start, stop).numpy()
  return text, len(_read_text(path, 0, start).numpy())


def bad_input_error(
  field: str, path: str, offset: int, kind: str, max_doc_bytes: int
) -> ValueError:
  """The error data.bad_input='fail' raises for bad input at `offset`."""
  return ValueError(
    f'{field}: {path!r} at byte {offset}: '
    f'{_DESCRIBE[kind].format(max_doc_bytes=max_doc_bytes)}. Set '
    "data.bad_input='skip' to skip and count such input instead."
  )


def _scan_block(block, start, max_doc_bytes, count_blank, counts, faults):
  """Scans whole lines `block` at file offset `start`; True if one is good."""
  lines = block.split(b'\n')
  if block.endswith(b'\n'):
    lines.pop()  # the empty piece after the last newline is no line
  # Fast path for the common clean chunk: C-speed checks of all of it (NUL
  # is one of the _CONTROL bytes).
  clean = len(block.translate(None, _CONTROL)) == len(block)
  if clean:
    try:
      block.decode('utf-8')
    except UnicodeDecodeError:
      clean = False
  if clean and len(block) > max_doc_bytes:
    clean = max(map(len, lines), default=0) <= max_doc_bytes
  usable, offset = False, start
  for line in lines:
    # TextLineDataset drops the '\r' of a '\r\n'.
    text = line[:-1] if line.endswith(b'\r') else line
    if not text.strip():
      if text and count_blank:
        counts['whitespace_only'] += 1
    elif clean or (fault := _fault(text, max_doc_bytes)) is None:
      usable = True
    else:
      counts[fault[1]] += 1
      faults.append((offset + fault[0], fault[1]))
    offset += len(line) + 1
  return usable


def _scan_lines(
  chunks: Iterable[bytes], start: int, max_doc_bytes: int, count_blank: bool
) -> _Scan:
  """Scans a file's lines, read in `chunks` that begin at file offset start."""
  counts, faults = dict.fromkeys(BAD_INPUT, 0), []
  usable = nonblank = skipping = False
  carry, offset = b'', start  # offset: where `carry` begins in the file
  for chunk in chunks:
    nonblank = nonblank or bool(chunk.strip())
    if skipping:  # inside a line already counted too long
      newline = chunk.find(b'\n')
      if newline < 0:
        offset += len(chunk)
        continue
      chunk, offset = chunk[newline + 1 :], offset + newline + 1
      skipping = False
    buf = carry + chunk
    cut = buf.rfind(b'\n') + 1
    usable |= _scan_block(
      buf[:cut], offset, max_doc_bytes, count_blank, counts, faults
    )
    carry, offset = buf[cut:], offset + cut
    if len(carry) > max_doc_bytes:
      # Never hold a line longer than any document may be.
      if carry.strip():
        counts['too_long'] += 1
        faults.append((offset, 'too_long'))
      offset, carry, skipping = offset + len(carry), b'', True
  if carry:
    usable |= _scan_block(
      carry, offset, max_doc_bytes, count_blank, counts, faults
    )
  if not nonblank:
    return _Scan({**dict.fromkeys(BAD_INPUT, 0), 'empty_file': 1}, [], False)
  return _Scan(counts, faults, usable)


def _read_chunks(path: str) -> Iterator[bytes]:
  with tf.io.gfile.GFile(path, 'rb') as f:
    while chunk := f.read(_CHUNK_BYTES):
      yield chunk


def _scan_file(file: _File, doc_format: str, max_doc_bytes: int) -> _Scan:
  """The bad input of one matched file (or slice of it), without TF graphs."""
  nul = _binary_offset(file.path)
  if nul is not None:
    return _Scan(
      {**dict.fromkeys(BAD_INPUT, 0), 'binary': 1}, [(nul, 'binary')], False
    )
  sliced = (file.start, file.stop) != (0, 100)
  if sliced:
    text, begin = _slice_bytes(file.path, file.start, file.stop)
    chunks = [text]
  else:
    chunks, begin = _read_chunks(file.path), 0
  if doc_format != 'file':
    return _scan_lines(chunks, begin, max_doc_bytes, doc_format == 'line')
  # A 'file' document is the whole text: streamed, so a huge one is never
  # held just to be rejected.
  size, nonblank, head = 0, False, b''
  for chunk in chunks:
    size += len(chunk)
    nonblank = nonblank or bool(chunk.strip())
    if size <= max_doc_bytes:
      head += chunk
  counts = dict.fromkeys(BAD_INPUT, 0)
  if not nonblank:
    return _Scan({**counts, 'empty_file': 1}, [], False)
  if size > max_doc_bytes:
    fault = (0, 'too_long')
  else:
    fault = _fault(head, max_doc_bytes)
  if fault is None:
    return _Scan(counts, [], True)
  counts[fault[1]] = 1
  return _Scan(counts, [(begin + fault[0], fault[1])], False)


# _scan_file's results by (file, format, limit, size, mtime): a process
# builds its pipelines several times (tokenizer, stages, eval), scans once.
_SCANS: dict[tuple, _Scan] = {}


def _cached_scan(file: _File, doc_format: str, max_doc_bytes: int) -> _Scan:
  stat = tf.io.gfile.stat(file.path)
  key = (file, doc_format, max_doc_bytes, stat.length, stat.mtime_nsec)
  if key not in _SCANS:
    _SCANS[key] = _scan_file(file, doc_format, max_doc_bytes)
  return _SCANS[key]


class _Checked(NamedTuple):
  """A file source after its scan: what to read, and what was skipped."""

  files: list[_File]  # those with a good document, in order
  counts: dict[str, int]
  filter_docs: bool  # some kept file holds bad documents to drop
  max_doc_bytes: int
  by_file: bool  # the hosts share the files, not the documents (host_files)


def _summary(counts: dict[str, int]) -> str:
  parts = [f'{n} {k}' for k, n in counts.items() if n]
  return ', '.join(parts) or 'nothing'


def host_files(
  files: list, process_index: int, process_count: int
) -> tuple[list, bool]:
  """This host's share of a source's files, and whether it is by file.

  With at least as many files as hosts, host i reads files i, i + P, ...
  and nothing else. With fewer, every host reads every file and keeps
  its share of the documents (`documents`); a corpus too big for that is
  prepared instead (pretrain_lm.data.prepare).
  """
  if process_count > 1 and len(files) >= process_count:
    return files[process_index::process_count], True
  return files, False


def _checked_files(
  data_config: ml_collections.ConfigDict,
  source: str,
  field: str,
  process_index: int = 0,
  process_count: int = 1,
) -> _Checked:
  """Scans this host's files of `source`; applies data.bad_input."""
  # Configs saved before these fields existed (old workdirs) get defaults.
  defaults = configlib.base_config().data
  policy = data_config.get('bad_input', defaults.bad_input)
  limit = data_config.get('max_doc_bytes', defaults.max_doc_bytes)
  if policy not in BAD_INPUT_POLICIES:
    raise ValueError(
      f'data.bad_input={policy!r} is not one of {BAD_INPUT_POLICIES}.'
    )
  if data_config.doc_format not in DOC_FORMATS:
    raise ValueError(
      f'data.doc_format={data_config.doc_format!r} is not one of {DOC_FORMATS}.'
    )
  counts, kept, filter_docs = dict.fromkeys(BAD_INPUT, 0), [], False
  files, by_file = host_files(
    _match_files(source, field), process_index, process_count
  )
  for file in files:
    scan = _cached_scan(file, data_config.doc_format, limit)
    fatal = [(o, k) for o, k in scan.faults if k in _FATAL]
    if scan.counts['empty_file']:
      fatal = [(0, 'empty_file')]
    if policy == 'fail' and fatal:
      raise bad_input_error(field, file.path, *fatal[0], limit)
    for k, n in scan.counts.items():
      counts[k] += n
    if scan.usable:
      kept.append(file)
      filter_docs = filter_docs or bool(fatal)
  if not kept:
    raise ValueError(
      f'{field}={source!r} has no usable text: its {len(files)} file(s) '
      f'gave only bad input ({_summary(counts)}).'
    )
  return _Checked(kept, counts, filter_docs, limit, by_file)


_WARNED: set[tuple] = set()


def _warn_skipped(checked: _Checked, field: str) -> None:
  """Says once per process what `field`'s scan skipped (bar blank lines)."""
  fatal = {k: n for k, n in checked.counts.items() if k in _FATAL and n}
  key = (field, tuple(checked.files), tuple(fatal.items()))
  if fatal and key not in _WARNED:
    _WARNED.add(key)
    logging.warning(
      "%s: data.bad_input='skip' skipped bad input (documents per kind): %s.",
      field,
      _summary(fatal),
    )


def skipped_input(
  data_config: ml_collections.ConfigDict,
  process_index: int = 0,
  process_count: int = 1,
) -> dict[str, int]:
  """data.source's skipped documents per category, for the metrics.

  Per epoch over the files this process reads (process 0 logs them), as
  scanned when the source was first read; {} for a TFDS source.
  """
  if _is_tfds(data_config.source):
    return {}
  # Cached: the loop asks at every log step, and globbing is not free.
  key = (
    *(data_config.get(k) for k in _SKIPPED_KEY),
    process_index,
    process_count,
  )
  if key not in _SKIPPED:
    checked = _checked_files(
      data_config,
      data_config.source,
      'data.source',
      process_index,
      process_count,
    )
    _SKIPPED[key] = {f'data/skipped_{k}': n for k, n in checked.counts.items()}
  return dict(_SKIPPED[key])


_SKIPPED_KEY = ('source', 'doc_format', 'bad_input', 'max_doc_bytes')
_SKIPPED: dict[tuple, dict[str, int]] = {}


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


def check_source(
  source: str,
  field: str,
  *,
  tfds_data_dir: str = '',
  data_config: ml_collections.ConfigDict | None = None,
  process_index: int = 0,
  process_count: int = 1,
) -> None:
  """Fails fast, before any compilation, if `source` cannot give documents.

  Args:
    source: a source string (see the module docstring).
    field: the config field it came from, named in errors.
    tfds_data_dir: where TFDS datasets are prepared ('' for TFDS' default).
    data_config: the `data` section whose doc_format, bad_input and
      max_doc_bytes apply to local files (default: base_config's).
    process_index: this host: only its files are scanned (host_files).
    process_count: the number of hosts.
  """
  if not source.strip():
    raise ValueError(f'{field} is empty; name text files or a TFDS dataset.')
  if _is_tfds(source):
    _tfds_builder(source, field, tfds_data_dir)
    return
  if data_config is None:
    data_config = configlib.base_config().data
  # Scans this host's files once (cached for the pipeline): fails now on
  # bad input under data.bad_input='fail', and on a source with no usable
  # text.
  _checked_files(data_config, source, field, process_index, process_count)


def eval_source(data_config: ml_collections.ConfigDict) -> str:
  """What evaluation reads: data.eval_source, or '' for a hold-out.

  The base config's eval_source, the bundled WikiText-2 test file, goes
  with its bundled source only: with another data.source it stands for ''
  (every data.eval_holdout_every-th document of that source, or a prepared
  corpus' own eval split), never a silent evaluation on WikiText-2.
  """
  if (
    data_config.eval_source == configlib.BUNDLED_EVAL
    and data_config.source != configlib.BUNDLED_SOURCE
  ):
    return ''
  return data_config.eval_source


def check_sources(
  data_config: ml_collections.ConfigDict,
  process_index: int = 0,
  process_count: int = 1,
) -> None:
  """check_source for data.source and, where set, data.eval_source."""
  if data_config.doc_format not in DOC_FORMATS:
    raise ValueError(
      f'data.doc_format={data_config.doc_format!r} is not one of {DOC_FORMATS}.'
    )
  data_dir = data_config.tfds_data_dir
  for field in ('source', 'eval_source'):
    if field == 'source' or eval_source(data_config):
      check_source(
        data_config[field],
        f'data.{field}',
        tfds_data_dir=data_dir,
        data_config=data_config,
        process_index=process_index,
        process_count=process_count,
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


def _file_documents(
  files: list[_File], doc_format: str, max_doc_bytes: int | None = None
) -> tf.data.Dataset:
  """All documents of `files`, in order, as non-blank strings.

  Documents of the 'line' and 'blank_line' formats are stripped; a 'file'
  document is the file's (sliced) text verbatim, newlines included. Unless
  max_doc_bytes is None, bad lines (and 'file' documents) are dropped, as
  _fault finds them.
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


def tfds_texts(
  source: str,
  field: str,
  split: str,
  process_index: int,
  process_count: int,
  *,
  data_dir: str,
  text_key: str,
) -> tuple[tf.data.Dataset, Any]:
  """Part `process_index` of a TFDS split's texts, unstripped; and the part."""
  import tensorflow_datasets as tfds

  builder = _tfds_builder(source, field, data_dir)
  if text_key not in builder.info.features:
    raise KeyError(
      f'data.tfds_text_key={text_key!r} is not a feature of {source!r}; it '
      f'has {sorted(builder.info.features)}.'
    )
  part = tfds.split_for_jax_process(
    split, process_index=process_index, process_count=process_count
  )
  ds = builder.as_dataset(
    split=part,
    shuffle_files=False,
    read_config=tfds.ReadConfig(try_autocache=False),
  )
  return ds.map(no_autograph(lambda example: example[text_key])), part


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
  if _is_tfds(source):
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


# Sources up to this size are read whole to sample a tokenizer's documents;
# larger ones are sampled in windows at random offsets.
_SAMPLE_WHOLE_BYTES = 256 << 20
_WINDOW_BYTES = 1 << 16
_DOCS_PER_WINDOW = 64


def iter_texts(
  data_config: ml_collections.ConfigDict, *, limit: int
) -> Iterator[str]:
  """Up to `limit` training documents sampled across all files (tokenizer).

  A sample of the whole source, seeded by data.seed, not its first
  documents in file order: a source up to _SAMPLE_WHOLE_BYTES is read
  whole and `limit` of its training documents drawn (in stream order);
  a larger one is read in windows of _WINDOW_BYTES at random offsets,
  files weighted by size, so that a TB corpus costs a few hundred MB of
  reads. A TFDS source gives its first `limit` documents.
  """
  rng = np.random.default_rng(data_config.seed)
  if _is_tfds(data_config.source):
    docs = documents(
      data_config, split='train', process_index=0, process_count=1
    ).take(limit)
    yield from (d.decode('utf-8') for d in docs.as_numpy_iterator())
    return
  # Sizes only: a large source is never scanned whole for this.
  files = _match_files(data_config.source, 'data.source')
  sizes = [tf.io.gfile.stat(f.path).length for f in files]
  if sum(sizes) > _SAMPLE_WHOLE_BYTES and data_config.doc_format != 'file':
    yield from _window_texts(files, sizes, data_config, limit, rng)
    return
  docs = documents(data_config, split='train', process_index=0, process_count=1)
  texts = [d.decode('utf-8') for d in docs.as_numpy_iterator()]
  if len(texts) > limit:
    keep = np.sort(rng.choice(len(texts), size=limit, replace=False))
    texts = [texts[i] for i in keep]
  yield from texts


def _window_texts(files, sizes, data_config, limit, rng) -> Iterator[str]:
  """`limit` documents from windows at random byte offsets of the files.

  A window drops its first, partial document; its documents pass the same
  bad-input test as the pipeline's (_fault).
  """
  probs = np.asarray(sizes, np.float64) / sum(sizes)
  blank = data_config.doc_format == 'blank_line'
  max_doc_bytes = data_config.max_doc_bytes
  found = 0
  for _ in range(-(-limit // _DOCS_PER_WINDOW) * 4):  # bounded attempts
    i = int(rng.choice(len(sizes), p=probs))
    file, size = files[i], sizes[i]
    lo, hi = size * file.start // 100, size * file.stop // 100
    offset = int(rng.integers(lo, max(lo + 1, hi - _WINDOW_BYTES)))
    with tf.io.gfile.GFile(file.path, 'rb') as f:
      f.seek(offset)
      window = f.read(min(_WINDOW_BYTES, hi - offset))
    separator = b'\n\n' if blank else b'\n'
    pieces = window.split(separator)[1:-1]  # whole documents only
    for piece in pieces[:_DOCS_PER_WINDOW]:
      doc = piece.strip()
      if doc and _fault(doc, max_doc_bytes) is None:
        yield doc.decode('utf-8')
        found += 1
        if found == limit:
          return
