"""Documents from local/gs:// text files or TFDS, split and sharded by host.

spec.py parses source strings (files, globs, percent slices, 'tfds:name'),
scan.py finds bad input in local files, checks.py applies data.bad_input
to a host's files before anything compiles, reading.py makes the documents
pipeline (in a fixed order, so that packed rows are reproducible),
tfds_source.py reads prepared TFDS datasets and sampling.py samples
documents for a tokenizer.
"""

# The underscored names are here for the modules of data/ that read files
# exactly as this package does: fingerprint.py, prepare.py, ranges.py and
# shards.py.
from pretrain_lm.data.sources.autograph import no_autograph
from pretrain_lm.data.sources.checks import (
  _summary,  # noqa: F401
  check_source,
  check_sources,
  eval_source,
  host_files,
  skipped_input,
)
from pretrain_lm.data.sources.reading import SPLITS, documents
from pretrain_lm.data.sources.sampling import iter_texts
from pretrain_lm.data.sources.scan import (
  _FATAL,  # noqa: F401
  BAD_INPUT,
  BAD_INPUT_POLICIES,
  _binary_offset,  # noqa: F401
  _fault,  # noqa: F401
  _slice_bytes,  # noqa: F401
  bad_input_error,
)
from pretrain_lm.data.sources.spec import (
  DOC_FORMATS,
  TFDS_PREFIX,
  _is_tfds,  # noqa: F401
  _match_files,  # noqa: F401
)
from pretrain_lm.data.sources.tfds_source import tfds_texts

__all__ = [
  'BAD_INPUT',
  'BAD_INPUT_POLICIES',
  'DOC_FORMATS',
  'SPLITS',
  'TFDS_PREFIX',
  'bad_input_error',
  'check_source',
  'check_sources',
  'documents',
  'eval_source',
  'host_files',
  'iter_texts',
  'no_autograph',
  'skipped_input',
  'tfds_texts',
]
