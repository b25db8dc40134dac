"""Which files a host reads, checked against data.bad_input up front.

A source with no usable text fails, and under data.bad_input='fail' so
does any bad input, before anything compiles; under 'skip' the skipped
documents are counted for the metrics. TFDS datasets are left to TFDS' own
checks.
"""

from typing import NamedTuple

import ml_collections
from absl import logging

from pretrain_lm import configlib
from pretrain_lm.data.sources.scan import (
  BAD_INPUT,
  BAD_INPUT_POLICIES,
  FATAL,
  _cached_scan,
  bad_input_error,
)
from pretrain_lm.data.sources.spec import (
  DOC_FORMATS,
  _File,
  is_tfds,
  match_files,
)
from pretrain_lm.data.sources.tfds_source import _tfds_builder


class _Checked(NamedTuple):
  """A file source after its scan: what to read, and what was skipped."""

  files: list[_File]  # those with a good document, in order
  counts: dict[str, int]
  filter_docs: bool  # some kept file holds bad documents to drop
  max_doc_bytes: int
  by_file: bool  # the hosts share the files, not the documents (host_files)


def count_summary(counts: dict[str, int]) -> str:
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
    match_files(source, field), process_index, process_count
  )
  for file in files:
    scan = _cached_scan(file, data_config.doc_format, limit)
    fatal = [(o, k) for o, k in scan.faults if k in FATAL]
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
      f'gave only bad input ({count_summary(counts)}).'
    )
  return _Checked(kept, counts, filter_docs, limit, by_file)


_WARNED: set[tuple] = set()


def _warn_skipped(checked: _Checked, field: str) -> None:
  """Says once per process what `field`'s scan skipped (bar blank lines)."""
  fatal = {k: n for k, n in checked.counts.items() if k in FATAL and n}
  key = (field, tuple(checked.files), tuple(fatal.items()))
  if fatal and key not in _WARNED:
    _WARNED.add(key)
    logging.warning(
      "%s: data.bad_input='skip' skipped bad input (documents per kind): %s.",
      field,
      count_summary(fatal),
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
  if is_tfds(data_config.source):
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
    source: a source string (see spec.py).
    field: the config field it came from, named in errors.
    tfds_data_dir: where TFDS datasets are prepared ('' for TFDS' default).
    data_config: the `data` section whose doc_format, bad_input and
      max_doc_bytes apply to local files (default: base_config's).
    process_index: this host: only its files are scanned (host_files).
    process_count: the number of hosts.
  """
  if not source.strip():
    raise ValueError(f'{field} is empty; name text files or a TFDS dataset.')
  if is_tfds(source):
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
