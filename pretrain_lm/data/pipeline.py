"""The input pipeline: read -> tokenize -> pack -> objective transform -> batch.

tf.data only; every output is a host-local dict of numpy arrays with static
shapes. Its stages, one module each:

  packing.py         documents -> token ids -> packed rows and their features
  rows.py            a host's packed rows of a split; RowTransform, row seeds
  train_stream.py    the endless training stream and where it resumes
  eval_stream.py     the fixed evaluation batches
  prepared_input.py  the same streams read by index from prepared corpora
  stages.py          data.seq_len_schedule's sequence-length stages

This module names them all in one place, so a caller imports one module:
`pipeline.train_dataset(...)`, `pipeline.pack(...)`.
"""

from pretrain_lm.data.eval_stream import eval_batches
from pretrain_lm.data.packing import PACKINGS, pack, row_features, tokenize
from pretrain_lm.data.prepared_input import (
  prepared_stream,
  skipped_input,
  tokens_per_source,
)
from pretrain_lm.data.rows import RowTransform, rows_per_epoch
from pretrain_lm.data.stages import seq_len_stages, stage_at
from pretrain_lm.data.train_stream import train_dataset, train_iterator

__all__ = [
  'PACKINGS',
  'RowTransform',
  'eval_batches',
  'pack',
  'prepared_stream',
  'row_features',
  'rows_per_epoch',
  'seq_len_stages',
  'skipped_input',
  'stage_at',
  'tokenize',
  'tokens_per_source',
  'train_dataset',
  'train_iterator',
]
