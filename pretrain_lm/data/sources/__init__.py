"""Documents from local/gs:// text files or TFDS, split and sharded by host.

spec.py parses source strings (files, globs, percent slices, 'tfds:name'),
scan.py finds bad input in local files, checks.py applies data.bad_input
to a host's files before anything compiles, reading.py makes the documents
pipeline (in a fixed order, so that packed rows are reproducible),
tfds_source.py reads prepared TFDS datasets and sampling.py samples
documents for a tokenizer.
"""

from pretrain_lm.data.sources.autograph import no_autograph
from pretrain_lm.data.sources.checks import (
  check_source,
  check_sources,
  count_summary,
  eval_source,
  host_files,
  skipped_input,
)
from pretrain_lm.data.sources.reading import SPLITS, documents
from pretrain_lm.data.sources.sampling import iter_texts
from pretrain_lm.data.sources.scan import (
  BAD_INPUT,
  BAD_INPUT_POLICIES,
  FATAL,
  bad_input_error,
  binary_offset,
  doc_fault,
  slice_bytes,
)
from pretrain_lm.data.sources.spec import (
  DOC_FORMATS,
  TFDS_PREFIX,
  is_tfds,
  match_files,
)
from pretrain_lm.data.sources.tfds_source import tfds_texts

__all__ = [
  'BAD_INPUT',
  'BAD_INPUT_POLICIES',
  'DOC_FORMATS',
  'FATAL',
  'SPLITS',
  'TFDS_PREFIX',
  'bad_input_error',
  'binary_offset',
  'check_source',
  'check_sources',
  'count_summary',
  'doc_fault',
  'documents',
  'eval_source',
  'host_files',
  'is_tfds',
  'iter_texts',
  'match_files',
  'no_autograph',
  'skipped_input',
  'slice_bytes',
  'tfds_texts',
]
