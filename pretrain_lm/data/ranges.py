"""A preparation's input ranges, and the documents of one with offsets.

Ranges are fixed from file sizes alone (make_ranges; the module docstring
of pretrain_lm.data.prepare says how files are cut). A worker reads its
range's documents as data/sources makes them from the same input, each with
where it starts: its byte offset in the file, or its example index in a
TFDS piece; bad input is raised or counted under data.bad_input
(BadInput) as data/sources decides it.
"""

import concurrent.futures
import math
import os
from collections.abc import Iterator
from typing import Any

import ml_collections
import tensorflow as tf

from pretrain_lm.data import records, sources

# Text is read in blocks of this size; a line is held only up to
# data.max_doc_bytes, so memory stays bounded by one document.
_READ_BYTES = 1 << 22


# ---------------------------------------------------------------------------
# Input ranges, from file sizes alone.


def _stat_sizes(paths: list[str]) -> list[int]:
  # Stats run one by one would take minutes for thousands of gs:// files.
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    return list(pool.map(lambda p: tf.io.gfile.stat(p).length, paths))


def _text_ranges(
  spec: str, field: str, doc_format: str, range_bytes: int
) -> list[dict[str, Any]]:
  """The byte ranges of `spec`'s files, in file order."""
  files = sources.match_files(spec, field)
  sizes = _stat_sizes([f.path for f in files])
  ranges = []
  for file, size in zip(files, sizes, strict=True):
    sliced = (file.start, file.stop) != (0, 100)
    pieces = 1
    if doc_format == 'line' and not sliced:
      pieces = max(1, math.ceil(size / range_bytes))
    for k in range(pieces):
      ranges.append(
        {
          'field': field,
          # Absolute, so that provenance finds the file from any directory.
          'path': file.path
          if '://' in file.path
          else os.path.abspath(file.path),
          'size': size,
          'start': size * k // pieces,
          'stop': size * (k + 1) // pieces,
          'slice': [file.start, file.stop],
          # For the progress bar: a slice's share of the file.
          'bytes': (size * (k + 1) // pieces - size * k // pieces)
          * (file.stop - file.start)
          // 100,
        }
      )
  return ranges


def _tfds_ranges(spec: str, field: str, split: str, pieces: int) -> list[dict]:
  """`pieces` equal pieces of a TFDS split."""
  return [
    {
      'field': field,
      'path': spec,
      'split': split,
      'piece': i,
      'pieces': pieces,
      'bytes': 0,
    }
    for i in range(pieces)
  ]


def make_ranges(
  data: ml_collections.ConfigDict, range_mb: float, tfds_pieces: int
) -> list[dict[str, Any]]:
  """Every input range, each with the shard names it writes and its task.

  data.source's ranges come first, writing 'train' shards (and, with no
  data.eval_source, the held-out 'eval' shard of the same index); then
  data.eval_source's, writing 'eval' shards only.
  """
  range_bytes = max(1, int(range_mb * (1 << 20)))

  def of(spec, field, tfds_split):
    if sources.is_tfds(spec):
      return _tfds_ranges(spec, field, tfds_split, tfds_pieces)
    return _text_ranges(spec, field, data.doc_format, range_bytes)

  train = of(data.source, 'data.source', data.tfds_split)
  evals = []
  eval_spec = sources.eval_source(data)
  if eval_spec:
    evals = of(eval_spec, 'data.eval_source', data.tfds_eval_split)
  out = []
  for i, r in enumerate(train):
    names = {'train': records.shard_name('train', i, len(train))}
    if not eval_spec:
      names['eval'] = records.shard_name('eval', i, len(train))
    out.append(
      {**r, 'shards': names, 'task': names['train'][: -len('.array_record')]}
    )
  for i, r in enumerate(evals):
    name = records.shard_name('eval', i, len(evals))
    out.append(
      {**r, 'shards': {'eval': name}, 'task': name[: -len('.array_record')]}
    )
  return out


# ---------------------------------------------------------------------------
# Documents of one range, with their offsets, under data.bad_input.


class BadInput:
  """Applies data.bad_input to one range's faults: raise, or count."""

  def __init__(self, settings: dict[str, Any], range_: dict[str, Any]):
    self.policy = settings['bad_input']
    self.limit = settings['max_doc_bytes']
    self.range = range_
    self.counts = dict.fromkeys(sources.BAD_INPUT, 0)

  def __call__(self, offset: int, kind: str) -> None:
    if self.policy == 'fail' and kind in sources.FATAL:
      r = self.range
      raise sources.bad_input_error(
        r['field'], r['path'], offset, kind, self.limit
      )
    self.counts[kind] += 1


def _lines(
  path: str, start: int, stop: int, limit: int
) -> Iterator[tuple[int, bytes | None]]:
  """(offset, line) of the lines whose first byte is in [start, stop).

  A line comes without its '\n'. One over `limit` bytes (+1 for a '\r') is
  (offset, None): it is never held whole. Split-text semantics: a range
  starting at a > 0 begins just after the first '\n' at or after a - 1.
  """
  with tf.io.gfile.GFile(path, 'rb') as f:
    pos = max(0, start - 1)  # the file offset of the next chunk
    f.seek(pos)
    begin = None if start > 0 else 0  # where the current line starts
    parts, size = [], 0
    while chunk := f.read(_READ_BYTES):
      pieces = chunk.split(b'\n')
      at = pos
      for piece in pieces[:-1]:
        if begin is not None:
          if size + len(piece) > limit + 1:
            yield begin, None
          else:
            parts.append(piece)
            yield begin, b''.join(parts)
        at += len(piece) + 1
        begin, parts, size = at, [], 0
        if begin >= stop:
          return
      pos += len(chunk)
      if begin is not None and size <= limit + 1:
        parts.append(pieces[-1])
        size += len(pieces[-1])
        if size > limit + 1:
          parts = []  # too long already: drop what is held
    if begin is not None and begin < stop and size:
      yield begin, (b''.join(parts) if size <= limit + 1 else None)


def _line_documents(
  lines: Iterator[tuple[int, bytes | None]],
  doc_format: str,
  bad: BadInput,
  state: dict[str, bool],
) -> Iterator[tuple[int, bytes]]:
  """Lines -> (offset, document), as sources.reading makes them."""
  block, block_start = [], 0
  for offset, line in lines:
    if line is None:
      state['nonblank'] = True
      bad(offset, 'too_long')
      continue
    # TextLineDataset drops the '\r' of a '\r\n'.
    text = line[:-1] if line.endswith(b'\r') else line
    if not text.strip():
      if text and doc_format == 'line':
        bad.counts['whitespace_only'] += 1
      if block:  # a blank line ends a 'blank_line' block
        yield block_start, b'\n'.join(block).strip()
        block = []
      continue
    state['nonblank'] = True
    fault = sources.doc_fault(text, bad.limit)
    if fault is not None:
      bad(offset + fault[0], fault[1])  # a bad line leaves its block's rest
    elif doc_format == 'line':
      yield offset, text.strip()
    else:
      if not block:
        block_start = offset
      block.append(text)
  if block:
    yield block_start, b'\n'.join(block).strip()


def _text_documents(
  r: dict[str, Any], settings: dict[str, Any], bad: BadInput
) -> Iterator[tuple[int, bytes]]:
  """(byte offset in the file, document) of one text range, in order."""
  doc_format, limit = settings['doc_format'], bad.limit
  whole = r['start'] == 0 and r['stop'] == r['size']
  nul = sources.binary_offset(r['path'])
  if nul is not None:  # skipped whole, counted by the file's first range
    if r['start'] == 0:
      bad(nul, 'binary')
    return
  state = {'nonblank': False}
  sliced = r['slice'] != [0, 100]
  if sliced:
    text, begin = sources.slice_bytes(r['path'], *r['slice'])
    r['input'] = {'start': begin, 'stop': begin + len(text)}
  if doc_format == 'file':
    if not sliced:
      with tf.io.gfile.GFile(r['path'], 'rb') as f:
        text = f.read(limit + 1)  # enough to know it is too long
      begin = 0
    if not text.strip():
      bad(0, 'empty_file')
    elif len(text) > limit:
      bad(begin, 'too_long')
    elif (fault := sources.doc_fault(text, limit)) is not None:
      bad(begin + fault[0], fault[1])
    else:
      yield begin, text  # verbatim, as data/sources keeps it
    return
  elif sliced:
    pieces, offsets, at = text.split(b'\n'), [], begin
    for piece in pieces:
      offsets.append(at)
      at += len(piece) + 1
    lines = (
      (o, p if len(p) <= limit + 1 else None)
      for o, p in zip(offsets, pieces, strict=True)
    )
    yield from _line_documents(lines, doc_format, bad, state)
  else:
    lines = _lines(r['path'], r['start'], r['stop'], limit)
    yield from _line_documents(lines, doc_format, bad, state)
  if whole and not state['nonblank']:
    # A blank file is one 'empty_file', not blank lines. (A blank file cut
    # into several ranges counts as blank lines: no range sees it all.)
    bad.counts = dict.fromkeys(sources.BAD_INPUT, 0)
    bad(0, 'empty_file')


def _tfds_documents(
  r: dict[str, Any], settings: dict[str, Any]
) -> Iterator[tuple[int, bytes]]:
  """(example index in the piece, document) of one TFDS piece."""
  texts, part = sources.tfds_texts(
    r['path'],
    r['field'],
    r['split'],
    r['piece'],
    r['pieces'],
    data_dir=settings['tfds_data_dir'],
    text_key=settings['tfds_text_key'],
  )
  n = 0
  for text in texts.as_numpy_iterator():
    doc = text.strip()
    if doc:
      yield n, doc
    n += 1
  r['input'] = {'split': str(part), 'start': 0, 'stop': n}


def documents(
  r: dict[str, Any], settings: dict[str, Any], bad: BadInput
) -> Iterator[tuple[int, bytes]]:
  """(offset, document) of range `r`, in order; notes r['input'] if read.

  The offset is the byte offset in the file, or the example index in a
  TFDS piece. Where the range's input is not its [start, stop) bytes (a
  slice, a TFDS piece), r['input'] says what was read once all is read.
  """
  if sources.is_tfds(r['path']):
    return _tfds_documents(r, settings)
  return _text_documents(r, settings, bad)
