"""The layout of a prepared corpus: ArrayRecord shards plus a manifest.

`python -m pretrain_lm.data.prepare` writes, into one directory (local or
gs://):

- `manifest.json`, written last and atomically: a directory without it is
  not a prepared corpus. It holds the format and version, row_length,
  seq_len, packing, objective, the tokenizer (file, sha256, vocab_size,
  special_ids), the source (spec, eval_spec, doc_format, bad-input policy,
  fingerprint of the files' names and sizes), bad_input_counts, and per
  split the rows, tokens, documents and shards (file, rows, tokens,
  documents, bytes, sha256, and the input range: path, start, stop), and a
  key hashing what decides the bytes.
- `tokenizer.model`, the tokenizer the rows were made with
  (pretrain_lm.data.tokenizer reads every kind from that one file).
- `{split}-{i:05d}-of-{n:05d}.array_record` for split 'train' and 'eval':
  shard i holds the packed rows of input range i (a byte range of one
  source file, or one piece of a TFDS split), in document order.
- `stats/`: one JSON per input range, written when its shards are done;
  a rerun skips those ranges, and the manifest is assembled from them.

Each record is a serialized `tf.train.Example` with two int64 features:
`input_ids` (exactly `row_length` ids, as `pipeline.pack` makes them, with
[CLS]/[SEP]/[PAD] from the tokenizer) and `doc_offsets` (for each segment of
the row, in order, where its document starts: the byte offset in the
shard's source file, or the example index in a TFDS piece). Segment ids and
positions are not stored: `pipeline.row_features` derives them from the
ids.

Why ArrayRecord: it is a random-access format with an index of records in
every file (read one row by its number, local or gs://), written and read
by a maintained library that Grain, TFDS and MaxText use, so other JAX
stacks read these shards as they are (Grain's `ArrayRecordDataSource`
included). Shards are written with `group_size:1`: one record per chunk,
so any row is read without its neighbours. Example protos keep the rows
self-describing, at about two bytes per token.
"""

import hashlib
import json
import os
from typing import Any

import numpy as np
import tensorflow as tf

MANIFEST = 'manifest.json'
TOKENIZER_FILE = 'tokenizer.model'
FORMAT = 'pretrain_lm.prepared'
VERSION = 1
SPLITS = ('train', 'eval')
# One record per chunk: a random read decodes only its own row.
WRITER_OPTIONS = 'group_size:1'
# What a source string names a prepared corpus with.
PREFIX = 'prepared:'


def shard_name(split: str, index: int, count: int) -> str:
  """The file name of shard `index` of `count` of `split`."""
  return f'{split}-{index:05d}-of-{count:05d}.array_record'


def encode_row(input_ids: np.ndarray, doc_offsets: list[int]) -> bytes:
  """One row as a serialized tf.train.Example (see the module docstring)."""
  feature = {
    'input_ids': tf.train.Feature(
      int64_list=tf.train.Int64List(value=np.asarray(input_ids).tolist())
    ),
    'doc_offsets': tf.train.Feature(
      int64_list=tf.train.Int64List(value=list(doc_offsets))
    ),
  }
  example = tf.train.Example(features=tf.train.Features(feature=feature))
  # Sorted map keys: the default order varies between processes, and
  # shards must be the same bytes however they were made.
  return example.SerializeToString(deterministic=True)


def parse_rows(serialized: tf.Tensor, row_length: int) -> tf.Tensor:
  """Serialized rows [N] -> their input_ids, int32[N, row_length]."""
  parsed = tf.io.parse_example(
    serialized,
    {'input_ids': tf.io.FixedLenFeature([row_length], tf.int64)},
  )
  return tf.cast(parsed['input_ids'], tf.int32)


def decode_row(record: bytes) -> dict[str, list[int]]:
  """One record -> {'input_ids': [...], 'doc_offsets': [...]} (in Python)."""
  example = tf.train.Example.FromString(record)
  features = example.features.feature
  return {
    k: list(features[k].int64_list.value) for k in ('input_ids', 'doc_offsets')
  }


def file_sha256(path: str, chunk_bytes: int = 1 << 22) -> str:
  """The SHA-256 of a file's bytes, read in chunks (local or gs://)."""
  digest = hashlib.sha256()
  with tf.io.gfile.GFile(path, 'rb') as f:
    while chunk := f.read(chunk_bytes):
      digest.update(chunk)
  return digest.hexdigest()


def tokenizer_meta(tokenizer) -> dict[str, Any]:
  """The tokenizer facts a manifest and a checkpoint store.

  Its size, special ids and file hash: a corpus or a checkpoint made with
  another tokenizer means something else by the same ids.
  """
  return {
    'vocab_size': tokenizer.vocab_size,
    'special_ids': tokenizer.special_ids,
    # Every tokenizer kind is one file (pretrain_lm.data.tokenizer).
    'sha256': hashlib.sha256(tokenizer.model_bytes()).hexdigest(),
  }


def write_json_atomic(path: str, value: Any) -> None:
  """Writes JSON to a temporary name, then renames it over `path`.

  A reader sees either no file or the whole of it (a rename is atomic on
  local and GCS-backed filesystems alike for a single object).
  """
  tmp = f'{path}.tmp-{os.getpid()}'
  with tf.io.gfile.GFile(tmp, 'w') as f:
    f.write(json.dumps(value, indent=1, sort_keys=True))
  tf.io.gfile.rename(tmp, path, overwrite=True)


def read_manifest(directory: str) -> dict[str, Any]:
  """The manifest of a prepared corpus, checked for format and version."""
  path = os.path.join(directory, MANIFEST)
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(
      f'{directory!r} is not a prepared corpus: it has no {MANIFEST} (a '
      'preparation that has not finished writes none). Run `python -m '
      f'pretrain_lm.data.prepare --config=... --output={directory}`.'
    )
  with tf.io.gfile.GFile(path) as f:
    try:
      manifest = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}: not valid JSON ({e}).') from None
  if manifest.get('format') != FORMAT or manifest.get('version') != VERSION:
    raise ValueError(
      f'{path}: format {manifest.get("format")!r} version '
      f'{manifest.get("version")!r}; this code reads {FORMAT!r} version '
      f'{VERSION}.'
    )
  return manifest
