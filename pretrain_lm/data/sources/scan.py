"""Bad input: the scan of local files before they are read, and its TF twin.

Local files are scanned once per process before they are read: empty
files, binary data, invalid UTF-8 and documents over data.max_doc_bytes are
found and counted, with the byte offset of each; `_is_text` is the same test
in TF ops, which the pipeline filters documents with.
"""

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import tensorflow as tf

from pretrain_lm.data.sources.spec import _File, _read_text

# data.bad_input: skip and count bad input, or fail on the first.
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
FATAL = BAD_INPUT[:-1]
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


class _Scan(NamedTuple):
  """One file's (or slice's) bad input, from _scan_file."""

  counts: dict[str, int]  # category -> documents skipped
  faults: list[tuple[int, str]]  # (byte offset, category), file order
  usable: bool  # holds at least one good document


def doc_fault(doc: bytes, max_doc_bytes: int) -> tuple[int, str] | None:
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
  """False where doc_fault finds bad input; blank documents (separators) pass
  the test."""
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


def binary_offset(path: str) -> int | None:
  """The offset of a NUL that marks the file binary (_binary_head), or None."""
  with tf.io.gfile.GFile(path, 'rb') as f:
    head = f.read(_SNIFF_BYTES)
  nul = head.find(b'\0')
  return nul if nul >= 0 and _binary_head(head) else None


def slice_bytes(path: str, start: int, stop: int) -> tuple[bytes, int]:
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
    elif clean or (fault := doc_fault(text, max_doc_bytes)) is None:
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
  nul = binary_offset(file.path)
  if nul is not None:
    return _Scan(
      {**dict.fromkeys(BAD_INPUT, 0), 'binary': 1}, [(nul, 'binary')], False
    )
  sliced = (file.start, file.stop) != (0, 100)
  if sliced:
    text, begin = slice_bytes(file.path, file.start, file.stop)
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
    fault = doc_fault(head, max_doc_bytes)
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
