r"""Raw text -> tokenized, packed ArrayRecord shards + manifest (Apache Beam).

  python -m pretrain_lm.data.prepare --config=configs/bert.py:size=tiny \
      --output=/tmp/wiki_prepared [--config.data.seq_len=256] \
      [--range_mb=128] [--tfds_pieces=64] [--overwrite] \
      [--beam_pipeline_options='--direct_num_workers=4']

The config's `data` section names the input exactly as training reads it
(data.source, data.eval_source as sources.eval_source reads it,
doc_format, bad_input, max_doc_bytes, tfds_*), and its tokenizer
(data.tokenizer, or one trained on the source as a run would) is resolved
into OUTPUT/tokenizer.model first. The layout
of OUTPUT is pretrain_lm.data.records'; besides it, `stats/` holds one JSON
sidecar per input range (what `manifest.json` is assembled from).

Input ranges are fixed when the pipeline is built, from file sizes alone:
with doc_format 'line' an unsliced file is cut into byte ranges of about
--range_mb MiB (a range owns the lines whose first byte it holds); a
'blank_line' or 'file' file, or a sliced one ('a.txt[:90%]'), is one range;
a 'tfds:' source is --tfds_pieces pieces of its split. Range i of
data.source writes shard i of 'train' and, where there is no eval source,
shard i of 'eval' with every data.eval_holdout_every-th document of the
range (counted within the range). Where data.eval_source is set, its
ranges write the 'eval' shards and data.source's write no eval shard. A
shard's rows are `pipeline.pack` over its range's documents, exactly as the
raw-text pipeline packs them, written one by one as they are made.

Restarts: each shard is written under a temporary name and renamed into
place; then its range's sidecar records the shards' sizes and hashes and a
key (the preparation's fields, the tokenizer's hash, the range). A rerun
skips every range whose sidecar has its key and whose shards have the
recorded sizes, so a preparation killed at any point and rerun ends with
the same bytes as one never interrupted. `manifest.json` is written last,
from the sidecars, only after every range is done; a rerun of a finished
preparation with the same key does nothing.

Engine: Beam's DirectRunner on all local cores by default. Anything in
--beam_pipeline_options overrides that, e.g. Dataflow:

  --beam_pipeline_options='--runner=DataflowRunner --project=P --region=R
    --temp_location=gs://B/tmp --extra_package=dist/pretrain_lm-0.1.0.tar.gz
    --requirements_file=requirements.txt'

Dataflow workers need this package (the repository has no setup.py: build
an sdist with `python -m build --sdist` and pass it as --extra_package, or
use a custom --sdk_container_image with it installed), the same versions
of tensorflow, tensorflow-text and array_record as here, and a gs:// output
and source they can read.
"""

import collections
import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import shlex
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import ml_collections
import numpy as np
import tensorflow as tf
from absl import app, flags, logging
from apache_beam.options.pipeline_options import PipelineOptions

from pretrain_lm import objectives
from pretrain_lm.data import pipeline, records, sources
from pretrain_lm.data import tokenizer as tokenizer_lib

STATS_DIR = 'stats'
# Text is read in blocks of this size; a line is held only up to
# data.max_doc_bytes, so memory stays bounded by one document.
_READ_BYTES = 1 << 22
# Documents per eager tokenizer call: amortises the op's overhead.
_TOKENIZE_DOCS = 256
# Packed rows taken from tf.data at a time: per-element overhead again.
_ROWS_PER_READ = 256
_TMP = '.tmp-'
# What the driver runs Beam with unless --beam_pipeline_options says else.
DEFAULT_BEAM_OPTIONS = (
  '--direct_running_mode=multi_processing',
  '--direct_num_workers=0',
  # Workers log every bundle at INFO; the driver shows progress instead.
  '--default_sdk_harness_log_level=WARNING',
)


def _sha256_json(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


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
  files = sources._match_files(spec, field)
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
          'path': file.path,
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
    if sources._is_tfds(spec):
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


class _BadInput:
  """Applies data.bad_input to one range's faults: raise, or count."""

  def __init__(self, settings: dict[str, Any], range_: dict[str, Any]):
    self.policy = settings['bad_input']
    self.limit = settings['max_doc_bytes']
    self.range = range_
    self.counts = dict.fromkeys(sources.BAD_INPUT, 0)

  def __call__(self, offset: int, kind: str) -> None:
    if self.policy == 'fail' and kind in sources._FATAL:
      # The message sources.py gives for the same input.
      r = self.range
      raise ValueError(
        f'{r["field"]}: {r["path"]!r} at byte {offset}: '
        f'{sources._DESCRIBE[kind].format(max_doc_bytes=self.limit)}. Set '
        "data.bad_input='skip' to skip and count such input instead."
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
  bad: _BadInput,
  state: dict[str, bool],
) -> Iterator[tuple[int, bytes]]:
  """Lines -> (offset, document), as sources._file_documents makes them."""
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
    fault = sources._fault(text, bad.limit)
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


def _binary_file(path: str) -> int | None:
  """The offset of the NUL that marks `path` binary as sources.py decides."""
  with tf.io.gfile.GFile(path, 'rb') as f:
    head = f.read(sources._SNIFF_BYTES)
  nul = head.find(b'\0')
  return nul if nul >= 0 and sources._binary_head(head) else None


def _text_documents(
  r: dict[str, Any], settings: dict[str, Any], bad: _BadInput
) -> Iterator[tuple[int, bytes]]:
  """(byte offset in the file, document) of one text range, in order."""
  doc_format, limit = settings['doc_format'], bad.limit
  whole = r['start'] == 0 and r['stop'] == r['size']
  nul = _binary_file(r['path'])
  if nul is not None:  # skipped whole, counted by the file's first range
    if r['start'] == 0:
      bad(nul, 'binary')
    return
  state = {'nonblank': False}
  sliced = r['slice'] != [0, 100]
  if sliced:
    # The slice exactly as the pipeline cuts it (by characters), and its
    # byte offset in the file.
    text = sources._read_text(r['path'], *r['slice']).numpy()
    begin = len(sources._read_text(r['path'], 0, r['slice'][0]).numpy())
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
    elif (fault := sources._fault(text, limit)) is not None:
      bad(begin + fault[0], fault[1])
    else:
      yield begin, text  # verbatim, as sources.py keeps it
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
  import tensorflow_datasets as tfds

  builder = sources._tfds_builder(
    r['path'], r['field'], settings['tfds_data_dir']
  )
  key = settings['tfds_text_key']
  split = tfds.split_for_jax_process(
    r['split'], process_index=r['piece'], process_count=r['pieces']
  )
  ds = builder.as_dataset(
    split=split,
    shuffle_files=False,
    read_config=tfds.ReadConfig(try_autocache=False),
  )
  n = 0
  for example in ds.as_numpy_iterator():
    doc = example[key].strip()
    if doc:
      yield n, doc
    n += 1
  r['input'] = {'split': str(split), 'start': 0, 'stop': n}


# ---------------------------------------------------------------------------
# Tokenize, pack, write.


class _RowEncoder:
  """records.encode_row's bytes, from one reused proto: 40x faster a row."""

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
  tmp = f'{final}{_TMP}{uuid.uuid4().hex[:12]}'
  tf.io.gfile.copy(local, tmp, overwrite=True)
  tf.io.gfile.rename(tmp, final, overwrite=True)
  os.remove(local)


def _sidecar_path(output: str, r: dict[str, Any]) -> str:
  return os.path.join(output, STATS_DIR, f'{r["task"]}.json')


def _read_json(path: str) -> dict[str, Any] | None:
  try:
    with tf.io.gfile.GFile(path) as f:
      return json.load(f)
  except (tf.errors.NotFoundError, json.JSONDecodeError):
    return None


def range_done(output: str, r: dict[str, Any]) -> dict[str, Any] | None:
  """The range's sidecar if it is done: its key, and shards of their size."""
  stats = _read_json(_sidecar_path(output, r))
  if not stats or stats.get('key') != r['key']:
    return None
  for shard in stats['shards'].values():
    path = os.path.join(output, shard['file'])
    if not tf.io.gfile.exists(path) or (
      tf.io.gfile.stat(path).length != shard['bytes']
    ):
      return None
  return stats


class WriteShardFn(beam.DoFn):
  """Writes one input range's shards, then its stats sidecar."""

  def __init__(self, output: str, settings: dict[str, Any]):
    self.output, self.settings = output, settings

  def setup(self):
    # TF is only the reader and packer here: keep it off accelerators.
    with contextlib.suppress(RuntimeError):
      tf.config.set_visible_devices([], 'GPU')
    path = os.path.join(self.output, records.TOKENIZER_FILE)
    self.tokenizer = tokenizer_lib.load_tokenizer(path)
    sha = hashlib.sha256(self.tokenizer.model_bytes()).hexdigest()
    if sha != self.settings['tokenizer_sha256']:
      raise ValueError(f'{path} changed while the preparation ran.')

  def process(self, r: dict[str, Any]):
    if range_done(self.output, r):
      return
    write_range(self.output, r, self.settings, self.tokenizer)
    yield r['task']


def write_range(
  output: str, r: dict[str, Any], settings: dict[str, Any], tokenizer
) -> dict[str, Any]:
  """Reads, packs and writes one range; returns its sidecar."""
  started = time.time()
  r = dict(r)
  bad = _BadInput(settings, r)
  if sources._is_tfds(r['path']):
    docs = _tfds_documents(r, settings)
  else:
    docs = _text_documents(r, settings, bad)
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
    split: os.path.join(scratch, f'{name}{_TMP}{uuid.uuid4().hex[:12]}')
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
    shards = {}
    for split, name in r['shards'].items():
      shards[split] = {
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
  if sources._is_tfds(r['path']):
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
    'shards': shards,
    'bad_input_counts': bad.counts,
    'seconds': round(time.time() - started, 3),
  }
  records.write_json_atomic(_sidecar_path(output, r), sidecar)
  return sidecar


# ---------------------------------------------------------------------------
# The driver.


def _settings(config: ml_collections.ConfigDict, tok_sha: str) -> dict:
  """What the workers need of the config, as plain data."""
  d = config.data
  return {
    'doc_format': d.doc_format,
    'max_doc_bytes': d.max_doc_bytes,
    'bad_input': d.bad_input,
    'eval_holdout_every': 0 if sources.eval_source(d) else d.eval_holdout_every,
    'row_len': pipeline.row_length(config),
    'packing': d.packing,
    'tfds_data_dir': d.tfds_data_dir,
    'tfds_text_key': d.tfds_text_key,
    'tokenizer_sha256': tok_sha,
  }


def _fingerprint(spec: str, split: str) -> str:
  if not spec:
    return ''
  if sources._is_tfds(spec):
    return f'{spec} split {split}'
  from pretrain_lm.data import fingerprint  # imports orbax: driver only

  return fingerprint._files_identity(spec)


def _source_fields(
  config: ml_collections.ConfigDict, range_mb: float, tfds_pieces: int
) -> dict[str, Any]:
  d = config.data
  eval_spec = sources.eval_source(d)
  return {
    'spec': d.source,
    'eval_spec': eval_spec,
    'eval_holdout_every': 0 if eval_spec else d.eval_holdout_every,
    'doc_format': d.doc_format,
    'max_doc_bytes': d.max_doc_bytes,
    'bad_input': d.bad_input,
    'fingerprint': _fingerprint(d.source, d.tfds_split),
    'eval_fingerprint': _fingerprint(eval_spec, d.tfds_eval_split),
    'range_mb': range_mb,
    'tfds_pieces': tfds_pieces,
    'tfds_text_key': d.tfds_text_key,
  }


def key_fields(manifest: dict[str, Any]) -> dict[str, Any]:
  """The manifest fields that decide its shards' bytes, flat."""
  fields = {
    k: manifest[k]
    for k in ('format', 'version', 'row_length', 'seq_len', 'packing')
  }
  fields['objective'] = manifest['objective']
  fields['tokenizer.sha256'] = manifest['tokenizer']['sha256']
  for k, v in manifest['source'].items():
    fields[f'source.{k}'] = v
  # As JSON stores them, so a read-back manifest compares equal.
  return json.loads(json.dumps(fields))


def _check_previous(
  output: str, fields: dict[str, Any], overwrite: bool
) -> dict[str, Any] | None:
  """The finished preparation in `output` if it has these fields.

  A different one fails naming what differs, unless `overwrite`, which
  removes it (saying what it removes).
  """
  path = os.path.join(output, records.MANIFEST)
  if not tf.io.gfile.exists(path):
    return None
  old = records.read_manifest(output)
  old_fields = key_fields(old)
  if old_fields == fields:
    return old
  changed = [
    f'{k}: {old_fields.get(k, "(none)")!r} -> {fields.get(k, "(none)")!r}'
    for k in sorted(set(old_fields) | set(fields))
    if old_fields.get(k, '(none)') != fields.get(k, '(none)')
  ]
  if not overwrite:
    raise ValueError(
      f'{output} holds another preparation ({"; ".join(changed)}). Use '
      'another --output, or pass --overwrite to replace it.'
    )
  doomed = [path, os.path.join(output, records.TOKENIZER_FILE)]
  doomed += tf.io.gfile.glob(os.path.join(output, '*.array_record'))
  doomed += tf.io.gfile.glob(os.path.join(output, STATS_DIR, '*.json'))
  print(
    f'--overwrite: removing the preparation in {output} ({"; ".join(changed)}):'
  )
  for p in doomed:
    if tf.io.gfile.exists(p):
      print(f'  rm {p}')
      tf.io.gfile.remove(p)
  return None


def _tokenizer_sha(config, output: str) -> str | None:
  """The sha256 the tokenizer will have, None if it is yet to be trained."""
  existing = os.path.join(output, records.TOKENIZER_FILE)
  # data.tokenizer first: a run would find the output's and keep it.
  for path in (config.data.tokenizer, existing):
    if path and tf.io.gfile.exists(path):
      return records.file_sha256(path)
  return None


def _check_config(config: ml_collections.ConfigDict) -> None:
  d = config.data
  checks = [
    ('doc_format', d.doc_format, sources.DOC_FORMATS),
    ('bad_input', d.bad_input, sources.BAD_INPUT_POLICIES),
    ('packing', d.packing, pipeline.PACKINGS),
  ]
  for field, value, valid in checks:
    if value not in valid:
      raise ValueError(f'data.{field}={value!r} is not one of {valid}.')
  if not sources.eval_source(d) and d.eval_holdout_every < 2:
    raise ValueError(
      f'data.eval_holdout_every={d.eval_holdout_every} must be >= 2 (or set '
      'data.eval_source), else nothing is left to train on.'
    )
  if not d.source.strip():
    raise ValueError('data.source is empty; name text files or a TFDS dataset.')


class _Progress:
  """Polls the sidecars in a thread and shows shards, MB, MB/s and ETA."""

  def __init__(self, output: str, todo: list[dict[str, Any]], enabled: bool):
    self.output, self.todo, self.enabled = output, todo, enabled
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._run, daemon=True)

  def __enter__(self):
    if self.enabled and self.todo:
      self.thread.start()
    return self

  def __exit__(self, *exc):
    self.stop.set()
    if self.thread.is_alive():
      self.thread.join()

  def _run(self):
    import tqdm

    keys = {r['task']: r for r in self.todo}
    done, docs = set(), 0
    bar = tqdm.tqdm(
      total=sum(r['bytes'] for r in self.todo),
      unit='B',
      unit_scale=True,
      desc='prepare',
      file=sys.stderr,
    )
    with bar:
      while True:
        stopping = self.stop.wait(2.0)
        pattern = os.path.join(self.output, STATS_DIR, '*.json')
        for path in tf.io.gfile.glob(pattern):
          task = os.path.basename(path)[: -len('.json')]
          if task in done or task not in keys:
            continue
          stats = _read_json(path)
          if stats and stats.get('key') == keys[task]['key']:
            done.add(task)
            docs += sum(s['documents'] for s in stats['shards'].values())
            bar.update(keys[task]['bytes'])
        bar.set_postfix_str(f'shards {len(done)}/{len(keys)}, {docs} docs')
        if stopping:
          return


def prepare(
  config: ml_collections.ConfigDict,
  output: str,
  *,
  range_mb: float = 128,
  tfds_pieces: int = 16,
  beam_options: str = '',
  overwrite: bool = False,
  progress: bool = True,
) -> dict[str, Any]:
  """Prepares `config`'s data into `output`; returns the manifest.

  Args:
    config: a run config (uses `data`, `objective` and model.vocab_size).
    output: the directory (local or gs://) to write.
    range_mb: the size of the byte ranges 'line' files are cut into.
    tfds_pieces: the pieces a TFDS split is read in.
    beam_options: Beam flags, shlex-split, over DEFAULT_BEAM_OPTIONS.
    overwrite: replace a finished preparation with another key.
    progress: show a progress bar while the pipeline runs.
  """
  _check_config(config)
  d = config.data
  objective = objectives.OBJECTIVES[config.objective.name]
  row_len = pipeline.row_length(config)
  tf.io.gfile.makedirs(os.path.join(output, STATS_DIR))
  source = _source_fields(config, range_mb, tfds_pieces)

  def fields_for(tok_sha):
    return key_fields(
      {
        'format': records.FORMAT,
        'version': records.VERSION,
        'row_length': row_len,
        'seq_len': d.seq_len,
        'packing': d.packing,
        'objective': config.objective.name,
        'tokenizer': {'sha256': tok_sha or '(to be trained)'},
        'source': source,
      }
    )

  # Before the tokenizer is resolved: a differing OUTPUT/tokenizer.model
  # must not be silently kept (setup_tokenizer would reuse it).
  old = _check_previous(
    output, fields_for(_tokenizer_sha(config, output)), overwrite
  )
  if old is not None:
    print(f'{output} is already prepared with this key ({old["key"]}).')
    return old
  existing = os.path.join(output, records.TOKENIZER_FILE)
  if (
    d.tokenizer
    and tf.io.gfile.exists(existing)
    and records.file_sha256(existing) != records.file_sha256(d.tokenizer)
  ):
    if not overwrite:
      raise ValueError(
        f'{existing} (from an unfinished preparation) is not '
        f'data.tokenizer={d.tokenizer!r}; pass --overwrite to replace it.'
      )
    print(f'--overwrite: rm {existing}')
    tf.io.gfile.remove(existing)
  from pretrain_lm import checkpoint  # imports orbax: driver only

  tok = tokenizer_lib.setup_tokenizer(
    d,
    vocab_size=config.model.vocab_size,
    workdir=output,
    reserved_ids=objectives.num_reserved_ids(objective, config.objective),
  )
  meta = checkpoint.tokenizer_meta(tok)
  fields = fields_for(meta['sha256'])
  key = _sha256_json(fields)[:16]
  ranges = make_ranges(d, range_mb, tfds_pieces)
  for r in ranges:
    r['key'] = _sha256_json({'fields': fields, 'range': r})[:16]
  todo, stale = [], []
  for r in ranges:
    if not range_done(output, r):
      todo.append(r)
      old_stats = _read_json(_sidecar_path(output, r))
      if old_stats and old_stats.get('key') != r['key']:
        stale.append(r['task'])
  if stale:
    # Only an unfinished preparation (no manifest) gets here: say so anyway.
    print(
      f'Rewriting {len(stale)} range(s) an unfinished preparation with '
      f'other settings left (e.g. {stale[0]}).'
    )
  settings = _settings(config, meta['sha256'])
  started = time.time()
  if todo:
    options = PipelineOptions(
      [*DEFAULT_BEAM_OPTIONS, *shlex.split(beam_options)]
    )
    with _Progress(output, todo, progress), beam.Pipeline(options=options) as p:
      _ = (
        p
        | 'Ranges' >> beam.Create(todo)
        | 'Spread' >> beam.Reshuffle()
        | 'Write' >> beam.ParDo(WriteShardFn(output, settings))
      )
  seconds = time.time() - started
  manifest = {
    'format': records.FORMAT,
    'version': records.VERSION,
    'row_length': row_len,
    'seq_len': d.seq_len,
    'packing': d.packing,
    'objective': config.objective.name,
    'tokenizer': {
      'file': records.TOKENIZER_FILE,
      'sha256': meta['sha256'],
      'vocab_size': meta['vocab_size'],
      'special_ids': meta['special_ids'],
    },
    'source': source,
    'bad_input_counts': dict.fromkeys(sources.BAD_INPUT, 0),
    'splits': {
      s: {'rows': 0, 'tokens': 0, 'documents': 0, 'shards': []}
      for s in records.SPLITS
    },
    'key': key,
  }
  for r in ranges:
    stats = range_done(output, r)
    if stats is None:
      raise RuntimeError(
        f'{r["task"]} has no finished shards after the pipeline ran '
        f'({_sidecar_path(output, r)} is missing or stale).'
      )
    for k, n in stats['bad_input_counts'].items():
      manifest['bad_input_counts'][k] += n
    for split, shard in stats['shards'].items():
      total = manifest['splits'][split]
      for k in ('rows', 'tokens', 'documents'):
        total[k] += shard[k]
      total['shards'].append({**shard, 'input': stats['input']})
  if not manifest['splits']['train']['rows']:
    raise ValueError(
      f'data.source={d.source!r} gave no training rows (bad input skipped: '
      f'{sources._summary(manifest["bad_input_counts"])}).'
    )
  manifest['created'] = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())
  records.write_json_atomic(os.path.join(output, records.MANIFEST), manifest)
  # Left by interrupted runs; nothing writes them now the pipeline is done.
  leftovers = tf.io.gfile.glob(os.path.join(output, f'*{_TMP}*'))
  # records.write_json_atomic's, of sidecars.
  leftovers += tf.io.gfile.glob(os.path.join(output, STATS_DIR, '*.tmp-*'))
  for path in leftovers:
    print(f'Removing {path}, left by an interrupted run.')
    tf.io.gfile.remove(path)
  mb = sum(r['bytes'] for r in todo) / 1e6
  train = manifest['splits']['train']
  print(
    f'Prepared {output}: {mb:.1f} MB in {seconds:.1f} s '
    f'({mb / max(seconds, 1e-9):.2f} MB/s), {train["rows"]} train rows, '
    f'{train["tokens"]} tokens; eval {manifest["splits"]["eval"]["rows"]} '
    'rows.'
  )
  return manifest


def _define_flags():
  """The CLI's flags (defined only when run: tests import this module)."""
  from ml_collections import config_flags

  config = config_flags.DEFINE_config_file(
    'config',
    None,
    'Config file, e.g. configs/bert.py:size=tiny.',
    lock_config=True,
  )
  output = flags.DEFINE_string('output', None, 'Directory to write (or gs://).')
  flags.DEFINE_string(
    'beam_pipeline_options', '', 'Extra Beam flags, e.g. --runner=...'
  )
  flags.DEFINE_float('range_mb', 128, "MiB per input range of 'line' files.")
  flags.DEFINE_integer('tfds_pieces', 16, 'Pieces a TFDS split is read in.')
  flags.DEFINE_boolean(
    'overwrite', False, 'Replace a finished preparation with another key.'
  )
  flags.mark_flags_as_required(['config', 'output'])
  return config, output


def main(argv, config_flag, output_flag):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  try:
    prepare(
      config_flag.value,
      output_flag.value,
      range_mb=f.range_mb,
      tfds_pieces=f.tfds_pieces,
      beam_options=f.beam_pipeline_options,
      overwrite=f.overwrite,
    )
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None


def _parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with a clear message for a mistyped config field."""
  from pretrain_lm import validate

  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise SystemExit(f'error: {validate.unknown_override(argv) or e}') from None


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  # Beam pickles the DoFn by reference: it must live in the module's real
  # name, not in __main__, for worker processes to import it.
  from pretrain_lm.data import prepare as _module

  _config, _output = _define_flags()
  logging.set_verbosity(logging.WARNING)
  app.run(
    lambda argv: _module.main(argv, _config, _output),
    flags_parser=_parse_flags,
  )
