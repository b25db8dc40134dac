"""A sample of a source's documents across all its files (tokenizers)."""

from collections.abc import Iterator

import ml_collections
import numpy as np
import tensorflow as tf

from pretrain_lm.data.sources.reading import documents
from pretrain_lm.data.sources.scan import doc_fault
from pretrain_lm.data.sources.spec import is_tfds, match_files

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
  if is_tfds(data_config.source):
    docs = documents(
      data_config, split='train', process_index=0, process_count=1
    ).take(limit)
    yield from (d.decode('utf-8') for d in docs.as_numpy_iterator())
    return
  # Sizes only: a large source is never scanned whole for this.
  files = match_files(data_config.source, 'data.source')
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
  bad-input test as the pipeline's (doc_fault).
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
      if doc and doc_fault(doc, max_doc_bytes) is None:
        yield doc.decode('utf-8')
        found += 1
        if found == limit:
          return
