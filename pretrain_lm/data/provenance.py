"""Which documents made the global batch of a step, on prepared corpora.

A prepared stream's batch is a function of its step (prepared.py), and
every stored row records where each of its segments' documents starts
(records.py), so the text behind a loss spike at step N is found without
running the job:

  from pretrain_lm.data import provenance
  for row in provenance.batch_documents(config, step=N): ...

or `python -m pretrain_lm.data.show_batch --config=... --step=N`.
"""

import functools
from typing import Any

import ml_collections
import numpy as np
import tensorflow as tf

from pretrain_lm.data import pipeline, prepared, records

# The most text shown of one document.
MAX_TEXT_BYTES = 2000


def document_text(
  path: str, offset: int, doc_format: str, limit: int = MAX_TEXT_BYTES
) -> str:
  """The document of a text file that starts at byte `offset`, cut at limit."""
  with tf.io.gfile.GFile(path, 'rb') as f:
    f.seek(offset)
    if doc_format == 'file':
      text = f.read(limit)
    elif doc_format == 'line':
      text = f.readline()[:limit]
    else:  # 'blank_line': lines up to the next blank one
      text, line = b'', f.readline()
      while line.strip() and len(text) < limit:
        text, line = text + line, f.readline()
  return text.decode('utf-8', errors='replace').strip()[:limit]


def batch_documents(
  config: ml_collections.ConfigDict, step: int, row_length: int | None = None
) -> list[dict[str, Any]]:
  """The rows of global batch `step`, each with its documents.

  Returns one dict per row, in batch order (host h of P has rows
  [h * B / P, (h + 1) * B / P)): corpus, row (its index in the corpus'
  train rows), shard, epoch, and documents: [{path, offset, text}] (for a
  TFDS piece, {path, example} and no text). `row_length` is the run's
  (objectives.row_transform(config).row_length), checked against the
  manifests; None takes the corpora's own.
  """
  d = config.data
  if not prepared.is_prepared(d.source):
    raise ValueError(
      f'data.source={d.source!r}: only prepared corpora map a step to its '
      'documents without reading the stream (prepare the corpus).'
    )
  if row_length is None:  # the corpora's own (prepared_stream checks all)
    first = prepared.parse_source(d.source)[0].directory
    row_length = records.read_manifest(first)['row_length']
  stream = pipeline.prepared_stream(config, row_length)
  positions = tf.range(step * d.batch_size, (step + 1) * d.batch_size)
  k, n = stream.source_of(tf.cast(positions, tf.int64))
  epoch, rows = stream.row_of(k, n)
  k, epoch, rows = k.numpy(), epoch.numpy(), rows.numpy()
  out = []
  for source, e, row in zip(k, epoch, rows, strict=True):
    corpus = stream.corpora[int(source)]
    shard = corpus.shard_of('train', int(row))
    record = records.decode_row(corpus.read('train', np.array([row]))[0])
    doc_format = corpus.manifest.get('source', {}).get('doc_format', 'line')
    source_path = shard['input']['path']
    docs = []
    for offset in dict.fromkeys(record['doc_offsets']):  # once, in order
      if source_path.startswith('tfds:'):
        docs.append({'path': source_path, 'example': offset})
      else:
        text = _text(source_path, offset, doc_format)
        docs.append({'path': source_path, 'offset': offset, 'text': text})
    out.append(
      {
        'corpus': corpus.directory,
        'row': int(row),
        'shard': shard['file'],
        'epoch': int(e),
        'documents': docs,
      }
    )
  return out


@functools.lru_cache(maxsize=4096)
def _text(path: str, offset: int, doc_format: str) -> str:
  return document_text(path, offset, doc_format)
