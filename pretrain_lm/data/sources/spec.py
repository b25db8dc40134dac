"""Source strings: files, globs and percent slices, or 'tfds:name'.

A source string is either comma-separated paths or globs ('a.txt,dir/*.txt')
or 'tfds:name[/config][:version]'. A path or glob may end with a TFDS-style
percent slice, 'a.txt[:90%]', 'a.txt[90%:]' or 'a.txt[10%:20%]': each file it
matches is cut to those characters before it is split into documents, as
nanoGPT's `data[:int(n * 0.9)]` / `data[int(n * 0.9):]`, so '[:90%]' and
'[90%:]' of one file partition it.
"""

import re
from typing import NamedTuple

import tensorflow as tf

TFDS_PREFIX = 'tfds:'
# 'line': a document per line; 'blank_line': blocks of lines between blank
# lines; 'file': each file is one document, kept verbatim.
DOC_FORMATS = ('line', 'blank_line', 'file')
# A trailing [...] holding ':' or '%' is a slice; any other is a glob's
# character class ('shard[01].txt').
_SLICE_SUFFIX = re.compile(r'(.*)\[([^\[\]]*[:%][^\[\]]*)\]')
_SLICE = re.compile(r'(?:(\d+)%)?:(?:(\d+)%)?')


class _File(NamedTuple):
  """A matched file and the percent range [start, stop) of its characters."""

  path: str
  start: int
  stop: int


def is_tfds(source: str) -> bool:
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


def match_files(source: str, field: str) -> list[_File]:
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


def _read_text(path: tf.Tensor, start: tf.Tensor, stop: tf.Tensor):
  """A file's text, cut to characters [start%, stop%) of it."""
  text = tf.io.read_file(path)
  # Integer floor(n * p / 100) of the code points, as nanoGPT's
  # int(n * 0.9) slices a str; UTF8_CHAR never cuts a character in two.
  n = tf.cast(tf.strings.length(text, unit='UTF8_CHAR'), tf.int64)
  begin = n * tf.cast(start, tf.int64) // 100
  end = n * tf.cast(stop, tf.int64) // 100
  return tf.strings.substr(text, begin, end - begin, unit='UTF8_CHAR')
