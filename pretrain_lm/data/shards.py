"""One input range's shards and stats sidecar: what a worker writes.

A range's documents (pretrain_lm.data.ranges) are tokenized in batches,
packed by `pipeline.pack` exactly as the raw-text pipeline packs them, and
written row by row, each row with the offsets of its segments' documents.
Shards are written under a temporary name and renamed into place; then the
range's sidecar in STATS_DIR records their sizes and hashes and the range's
key, which is what range_done checks before a rerun skips the range.
"""

import collections
import contextlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from pretrain_lm.data import pipeline, ranges, records, sources

STATS_DIR = 'stats'
# Documents per eager tokenizer call: amortises the op's overhead.
_TOKENIZE_DOCS = 256
# Packed rows taken from tf.data at a time: per-element overhead again.
_ROWS_PER_READ = 256
# Marks a file being written; a finished preparation removes any left.
TMP = '.tmp-'


class _RowEncoder:
  """records.encode_row's bytes, from one reused proto (no proto per row)."""

  def __init__(self):
    self.example = tf.train.Example()
    feature = self.example.features.feature
    self.ids = feature['input_ids'].int64_list.value
    self.offsets = feature['doc_offsets'].int64_list.value

  def __call__(self, input_ids: np.ndarray, doc_offsets: list[int]) -> bytes:
    self.ids[:] = input_ids.tolist()
    self.offsets[:] = doc_offsets
    return self.example.SerializeToString(deterministic=True)


class _Shard:
  """Writes one shard's rows, each with the offsets of its segments' docs."""

  def __init__(self, path: str, tokenizer, settings: dict[str, Any]):
    self.path, self.tokenizer, self.settings = path, tokenizer, settings
    self.specials = np.array(
      [tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id]
    )
    self.stats = {'rows': 0, 'tokens': 0, 'documents': 0}

  def _batches(self, docs, pending):
    """Token ids of `docs` as (flat ids, row splits), a batch at a time.

    Each document with tokens is noted in `pending` before its batch is
    yielded; documents without any are dropped, as pack would drop them.
    """
    tf_tokenizer = self.tokenizer.tf_tokenizer()
    batch = []

    def flush():
      ids = tf_tokenizer.tokenize(tf.constant([d for _, d in batch]))
      if isinstance(ids, tf.Tensor):  # every text of one static length
        ids = tf.RaggedTensor.from_tensor(ids)
      lengths = ids.row_lengths().numpy()
      flat = ids.flat_values.numpy().astype(np.int32)
      for (offset, _), n in zip(batch, lengths, strict=True):
        if n:
          pending.append([offset, int(n)])
      kept = lengths[lengths > 0]
      self.stats['documents'] += len(kept)
      batch.clear()
      return flat, np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)

    for doc in docs:
      batch.append(doc)
      if len(batch) == _TOKENIZE_DOCS:
        yield flush()
    if batch:
      yield flush()

  def write(self, docs: Iterator[tuple[int, bytes]]) -> dict[str, Any]:
    """Packs `docs` ((offset, text), in order) into rows written to path."""
    from array_record.python.array_record_module import ArrayRecordWriter

    tok, s = self.tokenizer, self.settings
    # [doc offset, content tokens not yet seen in a row], in document
    # order: tf.data may run the generator ahead of the rows read here.
    pending = collections.deque()
    error = []

    def generate():
      try:
        yield from self._batches(docs, pending)
      except Exception as e:  # tf.data would keep only its message
        error.append(e)
        raise

    # Batches cross into tf.data: a Python call per document costs more
    # than tokenizing it.
    batches = tf.data.Dataset.from_generator(
      generate,
      output_signature=(
        tf.TensorSpec([None], tf.int32),
        tf.TensorSpec([None], tf.int64),
      ),
    )
    vectors = batches.map(
      sources.no_autograph(tf.RaggedTensor.from_row_splits)
    ).unbatch()
    rows = pipeline.pack(
      vectors,
      row_len=s['row_len'],
      packing=s['packing'],
      cls_id=tok.cls_id,
      sep_id=tok.sep_id,
      pad_id=tok.pad_id,
    )
    encode = _RowEncoder()
    writer = ArrayRecordWriter(self.path, records.WRITER_OPTIONS)
    last = None  # the offset of the last document whose tokens all came
    try:
      for batch in rows.batch(_ROWS_PER_READ).as_numpy_iterator():
        ids, segments = batch['input_ids'], batch['segment_ids']
        # content[r, k]: row r's tokens of segment k that are text.
        keys = np.arange(len(ids))[:, None] * (ids.shape[1] + 1) + segments
        text = ~np.isin(ids, self.specials)
        content = np.bincount(
          keys[text], minlength=len(ids) * (ids.shape[1] + 1)
        ).reshape(len(ids), -1)
        num_segments = segments.max(axis=1)
        for r in range(len(ids)):
          offsets = []
          for n in content[r, 1 : num_segments[r] + 1].tolist():
            if n == 0:
              # Only specials, e.g. 'concat' carrying the last doc's [SEP].
              offsets.append(last)
              continue
            head = pending[0]
            head[1] -= n
            if head[1] < 0:
              raise AssertionError('a segment spans two documents')
            offsets.append(head[0])
            if head[1] == 0:
              last = pending.popleft()[0]
          writer.write(encode(ids[r], offsets))
        self.stats['rows'] += len(ids)
        self.stats['tokens'] += int(np.count_nonzero(ids != tok.pad_id))
    except tf.errors.OpError:
      if error:
        raise error[0] from None
      raise
    finally:
      writer.close()
    return self.stats


def _is_local(path: str) -> bool:
  return '://' not in path


def _publish(local: str, final: str) -> None:
  """Moves a finished local file to `final` (local or remote) atomically."""
  if _is_local(final):
    os.replace(local, final)
    return
  # ArrayRecord writes local files: copy, then rename in place.
  tmp = f'{final}{TMP}{uuid.uuid4().hex[:12]}'
  tf.io.gfile.copy(local, tmp, overwrite=True)
  tf.io.gfile.rename(tmp, final, overwrite=True)
  os.remove(local)


def sidecar_path(output: str, r: dict[str, Any]) -> str:
  """Where range `r`'s stats sidecar is written."""
  return os.path.join(output, STATS_DIR, f'{r["task"]}.json')


def read_json(path: str) -> dict[str, Any] | None:
  """The JSON at `path`, or None where it is missing or half-written."""
  try:
    with tf.io.gfile.GFile(path) as f:
      return json.load(f)
  except (tf.errors.NotFoundError, json.JSONDecodeError):
    return None


def range_done(output: str, r: dict[str, Any]) -> dict[str, Any] | None:
  """The range's sidecar if it is done: its key, and shards of their size."""
  stats = read_json(sidecar_path(output, r))
  if not stats or stats.get('key') != r['key']:
    return None
  for shard in stats['shards'].values():
    path = os.path.join(output, shard['file'])
    if not tf.io.gfile.exists(path) or (
      tf.io.gfile.stat(path).length != shard['bytes']
    ):
      return None
  return stats


def write_range(
  output: str, r: dict[str, Any], settings: dict[str, Any], tokenizer
) -> dict[str, Any]:
  """Reads, packs and writes one range; returns its sidecar."""
  started = time.time()
  r = dict(r)
  bad = ranges.BadInput(settings, r)
  docs = ranges.documents(r, settings, bad)
  every = settings['eval_holdout_every']
  held_out = []  # every-th documents: at most half a range, never a corpus
  main_split = 'train' if 'train' in r['shards'] else 'eval'

  def kept():
    for i, doc in enumerate(docs):
      if every and (i + 1) % every == 0:
        held_out.append(doc)
      else:
        yield doc

  scratch = output if _is_local(output) else tempfile.gettempdir()
  tmp = {
    split: os.path.join(scratch, f'{name}{TMP}{uuid.uuid4().hex[:12]}')
    for split, name in r['shards'].items()
  }
  try:
    stats = {
      main_split: _Shard(tmp[main_split], tokenizer, settings).write(kept())
    }
    if 'eval' in r['shards'] and main_split == 'train':
      stats['eval'] = _Shard(tmp['eval'], tokenizer, settings).write(
        iter(held_out)
      )
    written = {}
    for split, name in r['shards'].items():
      written[split] = {
        'file': name,
        **stats[split],
        'bytes': os.path.getsize(tmp[split]),
        'sha256': records.file_sha256(tmp[split]),
      }
    for split, name in r['shards'].items():
      _publish(tmp[split], os.path.join(output, name))
  finally:
    for path in tmp.values():
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
  if sources.is_tfds(r['path']):
    source_input = {'path': r['path'], **r['input']}
  else:
    span = r.get('input', {'start': r['start'], 'stop': r['stop']})
    source_input = {'path': r['path'], **span}
    if r['slice'] != [0, 100]:
      source_input['slice'] = r['slice']
  sidecar = {
    'key': r['key'],
    'task': r['task'],
    'input': source_input,
    'input_bytes': r['bytes'],
    'shards': written,
    'bad_input_counts': bad.counts,
    'seconds': round(time.time() - started, 3),
  }
  records.write_json_atomic(sidecar_path(output, r), sidecar)
  return sidecar
