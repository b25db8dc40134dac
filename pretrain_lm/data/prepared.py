"""Training on prepared corpora: rows read by index, in a stateless order.

`data.source='prepared:DIR'` (local or gs://) trains on a corpus that
`python -m pretrain_lm.data.prepare` wrote (layout: records.py);
`'prepared:A:0.7,prepared:B:0.3'` on a weighted mixture of several.

The stream is a pure function of the position p = step * B + j (B the
global batch, j the row in it):

1. Mixture: positions are cut into blocks of MIX_BLOCK; in each block
   source k owns exactly q_k slots (its weight times the block, rounded by
   largest remainder), placed by a stateless permutation of the block. So
   position p maps in O(1) to (source k, n), the n-th row that source k
   gives, and the proportions are exact at every block boundary.
2. Each source has its own epochs: n -> (epoch n // N_k, i = n % N_k) and
   the row is perm(seed, k, epoch)(i), a stateless bijection of [0, N_k)
   (a Feistel network with cycle walking), so any row can land anywhere
   in an epoch and every epoch has another order.
3. Host h of P reads positions [step * B + h * B / P, step * B + (h + 1) *
   B / P): only its slice of the global batch.

Start-up reads the manifests (and stats the shards), never the rows, so a
resume at any step costs what step 0 costs, and the global batches, and the
masks (seeded by (data.seed, k, n)), are the same for every host count that
divides the batch.
"""

import bisect
import concurrent.futures
import dataclasses
import functools
import itertools
import os
from collections.abc import Callable
from typing import Any

import ml_collections
import numpy as np
import tensorflow as tf
from array_record.python import array_record_data_source

from pretrain_lm.data import records
from pretrain_lm.data.sources import no_autograph

# Positions per mixing block: mixture weights are exact to 1 / MIX_BLOCK.
MIX_BLOCK = 4096
# Salts that keep the seeds of the orders, the mixing and the masks apart.
_ORDER_SALT = 0x0DE5
_MIX_SALT = 0x313
_ROW_SALT = 0xA5C
_FEISTEL_ROUNDS = 4
_AUTOTUNE = tf.data.AUTOTUNE


def is_prepared(source: str) -> bool:
  """Whether a data.source string names prepared corpora."""
  return source.strip().startswith(records.PREFIX)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One corpus of a prepared source string and its mixture weight."""

  directory: str
  weight: float
  name: str


def parse_source(source: str, field: str = 'data.source') -> list[Entry]:
  """'prepared:A[:w],prepared:B[:w]' -> entries; weights default to 1.

  A weight is the last ':'-separated part when it parses as a number, so
  'prepared:gs://bucket/c4' has none and 'prepared:gs://bucket/c4:0.7' has
  0.7. Weights are normalised to sum to 1.
  """
  entries = []
  for item in (s.strip() for s in source.split(',')):
    if not item.startswith(records.PREFIX):
      raise ValueError(
        f'{field}={source!r}: {item!r} does not start with '
        f'{records.PREFIX!r}; a mixture lists prepared corpora only, e.g. '
        "'prepared:DIR_A:0.7,prepared:DIR_B:0.3'."
      )
    rest = item[len(records.PREFIX) :]
    directory, weight = rest, 1.0
    head, sep, tail = rest.rpartition(':')
    if sep and '/' not in tail:
      try:
        weight = float(tail)
      except ValueError:
        weight = None
      if weight is None or not weight > 0 or not np.isfinite(weight):
        raise ValueError(
          f'{field}={source!r}: the weight of {item!r} is {tail!r}; a '
          'mixture weight must be a positive number.'
        )
      directory = head
    if not directory:
      raise ValueError(f'{field}={source!r}: {item!r} names no directory.')
    directory = directory.rstrip('/')
    entries.append(Entry(directory, weight, _short_name(directory)))
  names = [e.name for e in entries]
  if len(set(names)) < len(names):
    raise ValueError(
      f'{field}={source!r}: two corpora share the name {names} (the last '
      'path part, used in the metrics); rename a directory.'
    )
  total = sum(e.weight for e in entries)
  return [dataclasses.replace(e, weight=e.weight / total) for e in entries]


def _short_name(directory: str) -> str:
  return os.path.basename(directory.rstrip('/')) or directory


@dataclasses.dataclass(frozen=True)
class _Shard:
  """ArrayRecordDataSource's FileInstruction: a whole shard, no file open."""

  filename: str
  skip: int
  take: int
  examples_in_shard: int


class Corpus:
  """One prepared corpus: its manifest and random access to its rows."""

  def __init__(self, entry: Entry):
    self.entry = entry
    self.directory = entry.directory
    self.manifest = records.read_manifest(entry.directory)

  @staticmethod
  @functools.cache
  def cached(entry: Entry) -> 'Corpus':
    """One Corpus per entry for the process: manifests are read once."""
    return Corpus(entry)

  def split(self, split: str) -> dict[str, Any]:
    splits = self.manifest['splits']
    if split not in splits:
      raise ValueError(
        f'{self.directory}: the prepared corpus has no {split!r} split '
        f'(it has {sorted(splits)}).'
      )
    return splits[split]

  def num_rows(self, split: str) -> int:
    return int(self.split(split)['rows'])

  def shard_paths(self, split: str) -> list[str]:
    return [
      os.path.join(self.directory, s['file'])
      for s in self.split(split)['shards']
    ]

  def check_shards(self, split: str) -> None:
    """Fails naming the first shard that is missing or of the wrong size.

    Stats only (threads, for thousands of gs:// shards). A flipped bit
    inside a shard is caught when its row is read: every ArrayRecord chunk
    carries its own hash; verify_checksums reads and hashes them all.
    """
    shards = self.split(split)['shards']

    def problem(shard):
      path = os.path.join(self.directory, shard['file'])
      try:
        size = tf.io.gfile.stat(path).length
      except tf.errors.NotFoundError:
        return f'{path} is missing'
      if size != shard['bytes']:
        return (
          f'{path} has {size} bytes, the manifest says {shard["bytes"]} '
          '(truncated or rewritten)'
        )
      return None

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
      problems = [p for p in pool.map(problem, shards) if p]
    if problems:
      raise ValueError(
        f'Prepared corpus {self.directory}: {problems[0]}'
        + (f' (and {len(problems) - 1} more)' if len(problems) > 1 else '')
        + '. Prepare it again (the same command resumes and rewrites only '
        'the shards that are not complete).'
      )

  def verify_checksums(self, split: str) -> None:
    """Hashes every shard of `split` against the manifest (reads them all)."""
    for shard, path in zip(
      self.split(split)['shards'], self.shard_paths(split), strict=True
    ):
      digest = records.file_sha256(path)
      if digest != shard['sha256']:
        raise ValueError(
          f'Prepared corpus {self.directory}: {path} has SHA-256 {digest}, '
          f'the manifest says {shard["sha256"]}. Prepare it again.'
        )

  @functools.cache  # noqa: B019 (one per corpus and split, for the run)
  def source(self, split: str):
    """An ArrayRecordDataSource over `split`'s shards (opened lazily)."""
    shards = [
      _Shard(path, 0, s['rows'], s['rows'])
      for path, s in zip(
        self.shard_paths(split), self.split(split)['shards'], strict=True
      )
      if s['rows']
    ]
    return array_record_data_source.ArrayRecordDataSource(shards)

  def shard_of(self, split: str, row: int) -> dict[str, Any]:
    """The manifest entry of the shard that holds row `row` of `split`."""
    shards = [s for s in self.split(split)['shards'] if s['rows']]
    ends = list(itertools.accumulate(s['rows'] for s in shards))
    return shards[bisect.bisect_right(ends, row)]

  def read(self, split: str, indices: np.ndarray) -> list[bytes]:
    """The serialized rows at global row `indices` of `split`."""
    try:
      return self.source(split).__getitems__([int(i) for i in indices])
    except RuntimeError as e:  # Riegeli's hash checks, a vanished file
      files = sorted({self.shard_of(split, int(i))['file'] for i in indices})
      raise ValueError(
        f'Prepared corpus {self.directory}: reading rows from '
        f'{", ".join(files)} failed ({e}). Prepare the corpus again, or '
        'find the shard with --config.data.verify_checksums=True.'
      ) from None


def _check_compatible(
  corpora: list[Corpus], config: ml_collections.ConfigDict, row_length: int
) -> None:
  """Fails naming the field where a manifest and the run's config differ."""
  d = config.data
  first = corpora[0]
  for corpus in corpora:
    m, path = corpus.manifest, os.path.join(corpus.directory, records.MANIFEST)
    wanted = {'row_length': row_length, 'packing': d.packing}
    for key, value in wanted.items():
      if m[key] != value:
        field = 'data.seq_len' if key == 'row_length' else f'data.{key}'
        raise ValueError(
          f'{path}: {key}={m[key]!r}, but this run needs {value!r} (from '
          f'{field}={d[field.split(".")[1]]!r} and objective.name='
          f'{config.objective.name!r}). Prepare the corpus with this '
          'config, or set the config to match it.'
        )
    sha = m['tokenizer']['sha256']
    if sha != first.manifest['tokenizer']['sha256']:
      raise ValueError(
        f'data.source={d.source!r}: {corpus.directory} was tokenized with '
        f'tokenizer {sha[:12]}, {first.directory} with '
        f'{first.manifest["tokenizer"]["sha256"][:12]}; the corpora of a '
        'mixture must share one tokenizer (prepare them with the same '
        'data.tokenizer).'
      )
  if d.seq_len_schedule:
    raise ValueError(
      f'data.seq_len_schedule={d.seq_len_schedule!r} with prepared data: '
      'a prepared corpus has one row length. Set '
      "--config.data.seq_len_schedule='' and data.seq_len to the corpus' "
      'row length.'
    )


def corpora(
  config: ml_collections.ConfigDict,
  row_length: int,
  *,
  split: str = 'train',
  source: str | None = None,
) -> list[Corpus]:
  """`source`'s corpora (default data.source), checked against the config.

  Reads the manifests and stats the shards of `split`; with
  data.verify_checksums also hashes every shard.
  """
  source = config.data.source if source is None else source
  field = 'data.source' if source == config.data.source else 'data.eval_source'
  out = [Corpus.cached(e) for e in parse_source(source, field)]
  _check_compatible(out, config, row_length)
  for c in out:
    c.check_shards(split)
    if config.data.get('verify_checksums', False):
      c.verify_checksums(split)
    if c.num_rows(split) == 0:
      raise ValueError(f'Prepared corpus {c.directory}: no {split} rows.')
  return out


# The order: stateless bijections of [0, n).


def _mix32(x: tf.Tensor) -> tf.Tensor:
  """A 32-bit integer hash (a murmur3-style finaliser) in int64 arithmetic.

  Multipliers stay below 2**31, so no product of 32-bit values overflows.
  """
  mask = tf.constant(0xFFFFFFFF, tf.int64)
  x = tf.bitwise.bitwise_and(x, mask)
  x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))
  x = tf.bitwise.bitwise_and(x * 0x7FEB352D, mask)
  x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 15))
  x = tf.bitwise.bitwise_and(x * 0x46D1C6B5, mask)
  return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))


def _key(*parts) -> tf.Tensor:
  """A 32-bit key hashed from int64 `parts` (broadcast elementwise)."""
  key = tf.constant(0x2545F491, tf.int64)
  for part in parts:
    key = _mix32(key + _mix32(tf.cast(part, tf.int64)))
  return key


def permute(index, n, *key_parts) -> tf.Tensor:
  """A stateless permutation of [0, n) applied to int64 `index`.

  The permutation is keyed by the integers `key_parts`; everything is
  elementwise, so a batch of indices may each have its own n and key. A
  balanced Feistel network on the smallest even-bit domain 2**(2h) >= n is
  a bijection of that domain; a value that lands at or past n is sent
  through it again (cycle walking), which keeps a bijection of [0, n). The
  domain is under 4n, so fewer than 4 passes are expected.
  """
  index = tf.cast(index, tf.int64)
  n = tf.broadcast_to(tf.cast(n, tf.int64), tf.shape(index))
  bits = tf.cast(
    tf.math.ceil(
      tf.math.log(tf.cast(tf.maximum(n, 2), tf.float64)) / np.log(2.0)
    ),
    tf.int64,
  )
  half = (bits + 1) // 2
  low_mask = tf.bitwise.left_shift(tf.ones_like(half), half) - 1
  keys = [_key(r, *key_parts) for r in range(_FEISTEL_ROUNDS)]

  def feistel(x):
    left = tf.bitwise.right_shift(x, half)
    right = tf.bitwise.bitwise_and(x, low_mask)
    for key in keys:
      f = tf.bitwise.bitwise_and(_mix32(right + key), low_mask)
      left, right = right, tf.bitwise.bitwise_xor(left, f)
    return tf.bitwise.bitwise_or(tf.bitwise.left_shift(left, half), right)

  def walk(x):
    return (tf.where(x >= n, feistel(x), x),)

  (out,) = tf.while_loop(
    lambda x: tf.reduce_any(x >= n), walk, (feistel(index),)
  )
  return out


def mixture_slots(weights: list[float]) -> np.ndarray:
  """Each source's slots in a block of MIX_BLOCK (largest remainder)."""
  raw = np.asarray(weights, np.float64) * MIX_BLOCK
  slots = np.floor(raw).astype(np.int64)
  order = np.argsort(-(raw - slots), kind='stable')
  slots[order[: MIX_BLOCK - slots.sum()]] += 1
  if (slots == 0).any():
    k = int(np.argmin(slots))
    raise ValueError(
      f'Mixture weight {weights[k]:.2g} gives source {k} no row in '
      f'{MIX_BLOCK}; raise it or drop the source.'
    )
  return slots


class Stream:
  """Position -> (source, row) for a run's prepared corpora."""

  def __init__(self, corpora: list[Corpus], data_seed: int, split='train'):
    self.corpora = corpora
    self.seed = data_seed
    self.split = split
    self.sizes = np.array([c.num_rows(split) for c in corpora], np.int64)
    self.slots = mixture_slots([c.entry.weight for c in corpora])
    self.slot_ends = np.cumsum(self.slots)

  def source_of(self, position: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Positions -> (source k, n: the row count of k before this one)."""
    position = tf.cast(position, tf.int64)
    if len(self.corpora) == 1:
      return tf.zeros_like(position), position
    block, offset = position // MIX_BLOCK, position % MIX_BLOCK
    # One permutation of the block's slots per block: map each position.
    slot = permute(offset, MIX_BLOCK, self.seed, _MIX_SALT, block)
    ends = tf.constant(self.slot_ends, tf.int64)
    k = tf.searchsorted(ends, slot, side='right')
    begins = tf.gather(tf.concat([[0], ends[:-1]], 0), k)
    n = block * tf.gather(tf.constant(self.slots), k) + slot - begins
    return k, n

  def row_of(self, k: tf.Tensor, n: tf.Tensor) -> tuple[tf.Tensor, ...]:
    """(source k, its n-th row) -> (epoch, global row index in k's shards)."""
    size = tf.gather(tf.constant(self.sizes), k)
    epoch, i = n // size, n % size
    rows = permute(i, size, self.seed, _ORDER_SALT, k, epoch)
    return epoch, rows

  def read(self, k: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Serialized rows, each from its source (a numpy_function body)."""
    out = np.empty(len(rows), object)
    for source in np.unique(k):
      where = np.flatnonzero(k == source)
      got = self.corpora[int(source)].read(self.split, rows[where])
      out[where] = got
    # An object array: numpy's fixed-width bytes would drop trailing NULs.
    return out

  def rows_read(self, positions: int) -> np.ndarray:
    """Rows each source gave in the first `positions` positions (metrics)."""
    counts = (positions // MIX_BLOCK) * self.slots
    if len(self.corpora) == 1:
      return np.array([positions], np.int64)
    rest = positions % MIX_BLOCK
    if rest:
      block = positions // MIX_BLOCK
      slot = permute(
        tf.range(rest, dtype=tf.int64), MIX_BLOCK, self.seed, _MIX_SALT, block
      ).numpy()
      k = np.searchsorted(self.slot_ends, slot, side='right')
      counts = counts + np.bincount(k, minlength=len(self.corpora))
    return counts


def row_seed(data_seed: int, k, n) -> tf.Tensor:
  """The stateless seed of source k's n-th row (the objective's masks)."""
  seed = tf.constant([data_seed, _ROW_SALT], tf.int64)
  seed = tf.random.experimental.stateless_fold_in(seed, k)
  return tf.random.experimental.stateless_fold_in(seed, n)


def host_positions(
  step, *, batch_size: int, process_index: int, process_count: int
) -> tf.Tensor:
  """The stream positions of this host's rows of global batch `step`."""
  per_host = batch_size // process_count
  first = tf.cast(step, tf.int64) * batch_size + process_index * per_host
  return first + tf.range(per_host, dtype=tf.int64)


def dataset(
  stream: Stream,
  *,
  row_length: int,
  features: Callable[[tf.Tensor], dict[str, tf.Tensor]],
  transform: Callable[..., dict[str, tf.Tensor]],
  batch_size: int,
  start_batch: int,
  process_index: int,
  process_count: int,
  partnered: bool,
  num_batches: int | None = None,
  shuffled: bool = True,
) -> tf.data.Dataset:
  """This host's batches from `start_batch` on, endless unless num_batches.

  Args:
    stream: the run's corpora and order.
    row_length: the corpora's row length.
    features: packed ids [N, L] -> the row dicts packing.pack gives.
    transform: (row, seed, partner=None) -> the objective's features.
    batch_size: the global batch.
    start_batch: the first global batch (the step to resume at).
    process_index: this host.
    process_count: the number of hosts.
    partnered: the transform takes a partner row: the row before it in the
      global batch (the first's the last), read by index, so pairs are the
      same for every host count.
    num_batches: stop after this many batches (eval); None: never.
    shuffled: False reads rows in stored order (eval), one epoch at most.
  """
  per_host = batch_size // process_count
  ds = _host_rows(
    stream,
    row_length=row_length,
    features=features,
    batch_size=batch_size,
    start_batch=start_batch,
    process_index=process_index,
    process_count=process_count,
    partnered=partnered,
    num_batches=num_batches,
    shuffled=shuffled,
  )

  def apply(example):
    seed = row_seed(stream.seed, example['k'], example['n'])
    if partnered:
      return transform(example['row'], seed, partner=example['partner'])
    return transform(example['row'], seed)

  ds = ds.map(no_autograph(apply), num_parallel_calls=_AUTOTUNE)
  ds = ds.batch(per_host, drop_remainder=True).prefetch(_AUTOTUNE)
  options = tf.data.Options()
  # Order must never depend on thread timing: a batch is a function of its
  # step.
  options.deterministic = True
  return ds.with_options(options)


def _host_rows(
  stream: Stream,
  *,
  row_length: int,
  features: Callable[[tf.Tensor], dict[str, tf.Tensor]],
  batch_size: int,
  start_batch: int,
  process_index: int,
  process_count: int,
  partnered: bool,
  num_batches: int | None,
  shuffled: bool,
) -> tf.data.Dataset:
  """This host's rows from `start_batch` on, read by index (see dataset).

  Each row comes as {k: its source, n: its index in that source's stream,
  row: its features[, partner: the partner row's features]}.
  """
  steps = tf.data.Dataset.range(start_batch, (1 << 62))
  if num_batches is not None:
    steps = steps.take(num_batches)

  def locate(positions):
    if not shuffled:  # one corpus, in stored order: row n is at n
      return tf.zeros_like(positions), positions, positions
    k, n = stream.source_of(positions)
    _, rows = stream.row_of(k, n)
    return k, n, rows

  def read(k, rows):
    serialized = tf.numpy_function(stream.read, [k, rows], tf.string)
    return features(
      records.parse_rows(tf.reshape(serialized, [-1]), row_length)
    )

  def host_batch(step):
    positions = host_positions(
      step,
      batch_size=batch_size,
      process_index=process_index,
      process_count=process_count,
    )
    k, n, rows = locate(positions)
    out = {'k': k, 'n': n, 'row': read(k, rows)}
    if partnered:
      j = positions - step * batch_size
      partner_pos = step * batch_size + (j - 1) % batch_size
      pk, _, prow = locate(partner_pos)
      out['partner'] = read(pk, prow)
    return out

  ds = steps.map(no_autograph(host_batch), num_parallel_calls=_AUTOTUNE)
  return ds.unbatch()
