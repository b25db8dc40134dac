"""The input pipeline: read -> tokenize -> pack -> objective transform -> batch.

tf.data only; every output is a host-local dict of numpy arrays with static
shapes. The train stream is epoch 0, 1, 2, ... back to back; within an epoch
the packed rows are shuffled with a seed from (data.seed, epoch), and the
objective's random choices (e.g. MLM masks) use a stateless seed from
(data.seed, epoch, row index). So every epoch differs, yet the whole stream is
a pure function of the config and a restart at any batch reproduces it.
"""

import dataclasses
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np
import tensorflow as tf

from pretrain_lm.data import prepared, records, sources
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.data.sources import no_autograph

PACKINGS = ('full_sentences', 'doc_sentences', 'concat')
# Salts that keep the shuffle seeds and the per-row seeds independent.
_SHUFFLE_SALT = 0x5EED
_ROW_SALT = 0xA5C
_PARTNER_SALT = 0x9A1
_AUTOTUNE = tf.data.AUTOTUNE
# The shortest row each packing can put a token in: [CLS] token [SEP], or
# token [SEP] for 'concat'.
_MIN_ROW_LEN = {'full_sentences': 3, 'doc_sentences': 3, 'concat': 2}
# Documents joined into one run per scan step ('full_sentences', 'concat').
_DOCS_PER_RUN = 256


@dataclasses.dataclass(frozen=True)
class RowTransform:
  """The objective's part of the pipeline, resolved by the caller.

  `objectives.row_transform(config)` builds it from config.objective.name,
  so the data layer never looks objectives up itself.
  """

  # (row, seed, *, config, tokenizer[, partner]) -> features: the
  # objective's tf.data map (see pretrain_lm.objectives).
  fn: Callable[..., dict[str, tf.Tensor]]
  # The packed row length: data.seq_len unless the objective says (a
  # causal LM packs data.seq_len + 1 tokens and shifts them).
  row_length: int
  # Whether `fn` takes `partner=`, another packed row of the same epoch.
  partnered: bool = False
  # Ids the objective needs after the tokenizer's vocabulary (prepare.py
  # trains the tokenizer with that many fewer).
  reserved_ids: int = 0


def seq_len_stages(config: ml_collections.ConfigDict) -> list[tuple]:
  """data.seq_len_schedule as [(first step, end step, seq_len)], in order.

  '0.9:128' with data.seq_len=512 and 1000 steps: [(0, 900, 128), (900,
  1000, 512)]. Stages that round to no steps are dropped.
  """
  d, num_steps = config.data, config.train.num_steps
  field = f'data.seq_len_schedule={d.seq_len_schedule!r}'
  stages, start = [], 0
  for item in filter(None, d.seq_len_schedule.replace(' ', '').split(',')):
    fraction, sep, length = item.partition(':')
    try:
      fraction, length = float(fraction), int(length)
    except ValueError:
      raise ValueError(
        f"{field}: {item!r} is not 'fraction:seq_len' (e.g. '0.9:128')."
      ) from None
    end = round(fraction * num_steps)
    if not sep or not 0 < fraction < 1 or not 0 < length <= d.seq_len:
      raise ValueError(
        f'{field}: in {item!r} the fraction must be in (0, 1) and the '
        f'length in [1, data.seq_len={d.seq_len}].'
      )
    if end < start:
      raise ValueError(f'{field}: the fractions must increase.')
    stages.append((start, end, length))
    start = end
  stages.append((start, num_steps, d.seq_len))
  return [s for s in stages if s[1] > s[0]]


def stage_at(
  config: ml_collections.ConfigDict, step: int, data_start_step: int = 0
) -> tuple[int, int, int, int]:
  """The seq-len stage of `step`: (begin, end, seq_len, start batch).

  A stage reads on through the corpus from where the stages before it
  left it, rather than from its start: its stream (rows of its own length)
  begins at the batch that holds as many tokens as those stages read. The
  start batch is that of `step`. `data_start_step` is where the run's
  stream began (data.allow_changed): stages read nothing before it.
  """
  stages = seq_len_stages(config)
  begin, end, seq_len = next(s for s in stages if s[0] <= step < s[1])
  read = sum(
    (e - max(b, data_start_step)) * length
    for b, e, length in stages
    if e <= begin and e > data_start_step
  )
  return (
    begin,
    end,
    seq_len,
    read // seq_len + step - max(begin, data_start_step),
  )


def tokenize(
  docs: tf.data.Dataset, tokenizer: tokenizer_lib.Tokenizer
) -> tf.data.Dataset:
  """Documents -> int32 token-id vectors."""
  tf_tokenizer = tokenizer.tf_tokenizer()
  # Tokenizing a batch per call amortises the op overhead.
  tokens = docs.batch(64).map(
    no_autograph(tf_tokenizer.tokenize),
    num_parallel_calls=_AUTOTUNE,
    deterministic=True,
  )
  return tokens.unbatch()


def _doc_sentences_rows(tokens, row_len, cls_id, sep_id, pad_id):
  """One document -> rows [CLS] piece [SEP] [PAD]*, pieces <= row_len - 2."""
  room = row_len - 2
  n = tf.size(tokens)
  num_rows = (n + room - 1) // room
  lengths = tf.minimum(room, n - tf.range(num_rows) * room)
  pieces = tf.RaggedTensor.from_row_lengths(tokens, lengths)
  cls = tf.fill([num_rows, 1], tf.constant(cls_id, tf.int32))
  sep = tf.fill([num_rows, 1], tf.constant(sep_id, tf.int32))
  rows = tf.concat([cls, pieces, sep], axis=1)
  return rows.to_tensor(default_value=pad_id, shape=[None, row_len])


def _full_sentences_step(row_len, cls_id, sep_id, pad_id):
  """The scan step that appends a run of documents and cuts off its rows.

  A run is doc [SEP] doc [SEP] ... and the end of each [SEP] in it. The
  rows of the stream `buf` + run follow from one rule applied from a row
  start p: at the first document end e >= p + row_len - 2, the row is
  [CLS] stream[p:e] [PAD]* if that fits (e <= p + row_len - 1), else
  [CLS] stream[p:p + row_len - 2] [SEP] (the document goes on in the next
  row). The rule is computed for every p at once and its chain from 0
  followed by pointer doubling: a step costs O(log rows) ops for a whole
  run, not a scan step per document.
  """
  room = row_len - 2  # a row's tokens between [CLS] and its final [SEP]

  def step(buf, run):
    tokens, ends, is_end = run
    # `buf` is the unfinished row without [CLS]: whole documents, each
    # followed by [SEP], fewer than row_len - 2 tokens. The end-of-epoch
    # sentinel (an empty run) makes it the last, padded row.
    stream = tf.concat([buf, tokens], 0)
    n = tf.size(stream)
    ends += tf.size(buf)  # the sentinel's [0]: the end of `buf`
    num_ends = tf.size(ends)
    p = tf.range(n + 1)
    # At the end any rest is a row, however short.
    want = p + tf.where(is_end, 0, room)
    i = tf.searchsorted(ends, want, side='left')
    e = tf.gather(tf.concat([ends, [0]], 0), i)
    found = i < num_ends
    whole = found & (e <= p + room + 1)
    split = found & ~whole
    # The next row's start; p itself where no row starts at p (the rest).
    following = tf.where(whole, e, tf.where(split, p + room, p))
    # Row k starts at following^k(0): doubling gives all k <= max_rows at
    # once, each row taking at least `room` tokens (or the last rest).
    max_rows = n // room + 1
    k = tf.range(max_rows + 1)

    def double(bit, starts, jump):
      take = tf.bitwise.bitwise_and(k, bit) > 0
      starts = tf.where(take, tf.gather(jump, starts), starts)
      return bit * 2, starts, tf.gather(jump, jump)

    _, starts, _ = tf.while_loop(
      lambda bit, *_: bit <= max_rows,
      double,
      (tf.constant(1), tf.zeros_like(k), following),
    )
    num_rows = tf.reduce_sum(tf.cast(starts[1:] > starts[:-1], tf.int32))
    begin, stop = starts[:num_rows], starts[1 : num_rows + 1]
    size = (stop - begin)[:, None]
    j = tf.range(row_len)[None]
    text = tf.gather(
      tf.concat([stream, [pad_id]], 0),
      tf.clip_by_value(begin[:, None] + j - 1, 0, n),
    )
    cut = (j == size + 1) & tf.gather(split, begin)[:, None]
    rows = tf.where(
      j == 0,
      cls_id,
      tf.where(j <= size, text, tf.where(cut, sep_id, pad_id)),
    )
    return stream[starts[max_rows] :], rows

  return step


def _concat_step(row_len, pad_id):
  """The scan step that appends a run of tokens and cuts off full rows."""

  def step(buf, chunk):
    tokens, _, is_end = chunk
    # `buf` holds fewer than row_len tokens not yet in a row. The
    # end-of-epoch sentinel pads it to a last row (none if it is empty).
    stream = tf.cond(
      is_end,
      lambda: tf.pad(
        buf, [[0, (-tf.size(buf)) % row_len]], constant_values=pad_id
      ),
      lambda: tf.concat([buf, tokens], 0),
    )
    num_rows = tf.size(stream) // row_len
    rows = tf.reshape(stream[: num_rows * row_len], [num_rows, row_len])
    return stream[num_rows * row_len :], rows

  return step


def _runs(docs: tf.data.Dataset, sep_id: int) -> tf.data.Dataset:
  """Documents -> runs doc [SEP] doc [SEP] ... and where each [SEP] ends.

  One scan step per run of many documents rather than per document: a
  step costs far more than its tokens do when documents are short lines.
  Empty documents are dropped (one would be a [SEP] alone).
  """

  def join(batch):
    if isinstance(batch, tf.Tensor):  # all documents had one static length
      batch = tf.RaggedTensor.from_tensor(batch)
    batch = tf.cast(batch, tf.int32)
    batch = tf.ragged.boolean_mask(batch, batch.row_lengths() > 0)
    seps = tf.fill([batch.nrows(), 1], tf.constant(sep_id, tf.int32))
    batch = tf.concat([batch, seps], axis=1)
    ends = tf.cast(batch.row_splits[1:], tf.int32)
    return batch.flat_values, ends, tf.constant(False)

  return docs.ragged_batch(_DOCS_PER_RUN).map(no_autograph(join))


def row_features(
  rows: tf.Tensor, sep_id: int, pad_id: int
) -> dict[str, tf.Tensor]:
  """Packed rows [N, L] -> input_ids, segment_ids and positions [N, L].

  In every packing a [SEP] ends each document (or piece) that another
  follows in the row, and [PAD] comes only at a row's end; no tokenizer here
  emits [SEP] or [PAD] for text. So the segments follow from the ids: a row
  starts segment 1, and a new one starts after each [SEP].
  """
  num_rows, row_len = tf.shape(rows)[0], rows.shape[1]
  is_pad = rows == pad_id
  is_sep = tf.cast(rows == sep_id, tf.int32)
  segment_ids = 1 + tf.cumsum(is_sep, axis=1, exclusive=True)
  segment_ids = tf.where(is_pad, 0, segment_ids)
  # A token's position is its index minus its segment's first index, found
  # with one segment-min over (row, segment) pairs.
  index = tf.broadcast_to(tf.range(row_len), tf.shape(rows))
  pair = segment_ids + (row_len + 1) * tf.range(num_rows)[:, None]
  starts = tf.math.unsorted_segment_min(
    tf.reshape(index, [-1]),
    tf.reshape(pair, [-1]),
    num_segments=num_rows * (row_len + 1),
  )
  positions = tf.where(is_pad, 0, index - tf.gather(starts, pair))
  return {
    'input_ids': rows,
    'segment_ids': segment_ids,
    'positions': positions,
  }


def pack(
  docs: tf.data.Dataset,
  *,
  row_len: int,
  packing: str,
  cls_id: int,
  sep_id: int,
  pad_id: int,
) -> tf.data.Dataset:
  """Packs token-id vectors into rows of `row_len` tokens.

  Args:
    docs: int32 token-id vectors, one per document, without specials; empty
      ones are dropped.
    row_len: the row length (see `row_length`).
    packing: 'full_sentences' (RoBERTa): rows of documents back to back,
      [CLS] doc1 [SEP] doc2 [SEP] ..., a document that does not fit split at
      the row end with a [SEP]; rows are full but for the epoch's last (and
      one [PAD] where a single slot is left after a [SEP]).
      'doc_sentences' (BERT-style): a row never crosses a document boundary;
      each document is cut into pieces of <= row_len - 2 tokens, each row
      [CLS] piece [SEP] [PAD]*.
      'concat' (GPT): doc1 [SEP] doc2 [SEP] ... with [SEP] as end-of-text
      and no [CLS], cut into consecutive rows of row_len tokens; documents
      run on across rows, and only the epoch's last row is padded.
    cls_id: id of [CLS].
    sep_id: id of [SEP].
    pad_id: id of [PAD].

  Returns:
    A dataset of rows in document order, each a dict of int32[row_len]:
    input_ids; segment_ids, 1, 2, 3, ... for the documents (pieces) in the
    row, in order, and 0 on [PAD]; positions, each token's index within
    its segment, 0 on [PAD]. A row's [CLS] belongs to its first segment, a
    [SEP] to the document it ends, and a document continued from the row
    before starts a new segment. In 'doc_sentences' a row is one segment.
  """
  if packing not in PACKINGS:
    raise ValueError(f'data.packing={packing!r} is not one of {PACKINGS}.')
  if row_len < _MIN_ROW_LEN[packing]:
    raise ValueError(
      f'Rows of {row_len} tokens (from data.seq_len) leave no room for '
      f'tokens with data.packing={packing!r}; raise data.seq_len.'
    )
  if packing == 'doc_sentences':
    docs = docs.map(no_autograph(lambda ids: tf.cast(ids, tf.int32)))
    # An empty document would give an empty piece: [SEP] alone.
    docs = docs.filter(no_autograph(lambda ids: tf.size(ids) > 0))
    # One map per document makes its rows and their features: per-element
    # overhead dominates for short documents.
    rows = docs.map(
      no_autograph(
        lambda ids: row_features(
          _doc_sentences_rows(ids, row_len, cls_id, sep_id, pad_id),
          sep_id,
          pad_id,
        )
      ),
      num_parallel_calls=_AUTOTUNE,
      deterministic=True,
    )
    return rows.unbatch()
  if packing == 'full_sentences':
    step = _full_sentences_step(row_len, cls_id, sep_id, pad_id)
  else:
    step = _concat_step(row_len, pad_id)
  # An empty run flagged as the end flushes the unfinished row.
  end = (tf.zeros([0], tf.int32), tf.zeros([1], tf.int32), tf.constant(True))
  flagged = _runs(docs, sep_id).concatenate(tf.data.Dataset.from_tensors(end))
  rows = flagged.scan(tf.zeros([0], tf.int32), no_autograph(step))
  rows = rows.map(
    no_autograph(
      lambda r: row_features(
        tf.ensure_shape(r, [None, row_len]), sep_id, pad_id
      )
    ),
    num_parallel_calls=_AUTOTUNE,
    deterministic=True,
  )
  return rows.unbatch()


def _rows(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  split: str,
  process_index: int,
  process_count: int,
) -> tf.data.Dataset:
  """One epoch of this host's packed rows of `split`, unshuffled."""
  docs = sources.documents(
    config.data,
    split=split,
    process_index=process_index,
    process_count=process_count,
  )
  tokens = tokenize(docs, tokenizer)
  if config.data.cache_tokens:
    tokens = tokens.cache()
  return pack(
    tokens,
    row_len=objective.row_length,
    packing=config.data.packing,
    cls_id=tokenizer.cls_id,
    sep_id=tokenizer.sep_id,
    pad_id=tokenizer.pad_id,
  )


def rows_per_epoch(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  process_index: int = 0,
  process_count: int = 1,
) -> int:
  """How many packed training rows one epoch gives this host (reads it all)."""
  rows = _rows(
    config,
    tokenizer,
    objective,
    split='train',
    process_index=process_index,
    process_count=process_count,
  )
  return _count(rows)


def skipped_input(
  config: ml_collections.ConfigDict,
  process_index: int = 0,
  process_count: int = 1,
) -> dict[str, int]:
  """Training documents data.bad_input='skip' dropped, per kind (metrics).

  A prepared source reports what its preparation skipped, summed over its
  corpora.
  """
  if not prepared.is_prepared(config.data.source):
    return sources.skipped_input(config.data, process_index, process_count)
  counts = {}
  for entry in prepared.parse_source(config.data.source):
    manifest = prepared.Corpus.cached(entry).manifest
    for k, n in manifest.get('bad_input_counts', {}).items():
      counts[f'data/skipped_{k}'] = counts.get(f'data/skipped_{k}', 0) + n
  return counts


def _row_seed(data_seed: int, epoch, index) -> tf.Tensor:
  """The stateless seed (shape [2]) of row `index` of `epoch`."""
  seed = tf.constant([data_seed, _ROW_SALT], tf.int64)
  seed = tf.random.experimental.stateless_fold_in(seed, epoch)
  return tf.random.experimental.stateless_fold_in(seed, index)


def _epoch(rows: tf.data.Dataset, data_config, epoch) -> tf.data.Dataset:
  """`rows` shuffled for `epoch`, as (epoch, index in epoch, row)."""
  epoch = tf.cast(epoch, tf.int64)
  shuffle_seed = tf.random.stateless_uniform(
    [],
    seed=tf.stack([tf.constant(data_config.seed, tf.int64), epoch]),
    minval=None,
    maxval=None,
    dtype=tf.int64,
  )
  shuffle_seed = tf.bitwise.bitwise_xor(shuffle_seed, _SHUFFLE_SALT)
  rows = rows.shuffle(
    data_config.shuffle_buffer,
    seed=shuffle_seed,
    reshuffle_each_iteration=False,
  )
  return rows.enumerate().map(no_autograph(lambda i, row: (epoch, i, row)))


def _per_host_batch(data_config, process_count: int) -> int:
  if data_config.batch_size % process_count:
    raise ValueError(
      f'data.batch_size={data_config.batch_size} is not divisible by the '
      f'{process_count} processes.'
    )
  return data_config.batch_size // process_count


def _count(ds: tf.data.Dataset) -> int:
  count = no_autograph(lambda n, _: n + 1)
  return int(ds.reduce(tf.constant(0, tf.int64), count))


def _options() -> tf.data.Options:
  options = tf.data.Options()
  # Order must never depend on thread timing: restarts replay the stream.
  options.deterministic = True
  return options


def train_dataset(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  start_batch: int = 0,
  process_index: int = 0,
  process_count: int = 1,
) -> tf.data.Dataset:
  """This host's endless stream of training batches, from `start_batch` on.

  Args:
    config: the full run config (uses `data` and `objective`).
    tokenizer: the run's tokenizer.
    objective: the objective's transform (objectives.row_transform).
    start_batch: the number of batches already consumed (the train step to
      resume at); the stream equals a fresh one with that many batches
      skipped.
    process_index: this host's index.
    process_count: the number of hosts.

  Returns:
    A dataset of dicts of fixed-shape tensors, each with a leading
    per-host batch dimension of data.batch_size // process_count.
  """
  data_config = config.data
  batch = _per_host_batch(data_config, process_count)
  if prepared.is_prepared(data_config.source):
    return _prepared_dataset(
      config,
      tokenizer,
      objective,
      split='train',
      start_batch=start_batch,
      process_index=process_index,
      process_count=process_count,
    )
  rows = _rows(
    config,
    tokenizer,
    objective,
    split='train',
    process_index=process_index,
    process_count=process_count,
  )
  # Every epoch has the same rows (only their order differs), so checking
  # the first batch's worth is enough, and cheap.
  if _count(rows.take(batch)) < batch:
    raise ValueError(
      f'data.source={data_config.source!r} gives fewer than {batch} rows '
      f'of {objective.row_length} tokens (data.seq_len={data_config.seq_len}) '
      'per epoch on this host, not one full batch: use more text or a '
      'smaller data.batch_size.'
    )
  # Resume: skip whole epochs arithmetically (counting one epoch's rows),
  # then rows within the epoch. Rows are skipped before the objective's
  # transform, so that no skipped row is masked.
  skip = start_batch * batch
  start_epoch = 0
  if skip:
    epoch_rows = _count(rows.take(skip + 1))
    if epoch_rows <= skip:  # the whole epoch, counted
      start_epoch, skip = divmod(skip, epoch_rows)
  stream = tf.data.Dataset.counter(start_epoch).flat_map(
    no_autograph(lambda epoch: _epoch(rows, data_config, epoch))
  )
  stream = stream.skip(skip)
  partnered = objective.partnered
  if partnered:
    if batch < 2:
      raise ValueError(
        f'objective.sentence_task={config.objective.sentence_task!r} pairs '
        'rows within a host batch and needs at least 2 rows per host; '
        f'data.batch_size={data_config.batch_size} gives {batch}.'
      )
    # Each row's partner is the row before it in its batch (the first's
    # the last): a random other row of the shuffled epoch, at no extra
    # tokenizing. Resumes start at a batch boundary, so pairs replay.
    stream = stream.batch(batch, drop_remainder=True).map(
      no_autograph(
        lambda epoch, index, rows: (
          epoch,
          index,
          rows,
          {k: tf.roll(v, 1, axis=0) for k, v in rows.items()},
        )
      )
    )
    stream = stream.unbatch()

  def transform(epoch, index, row, partner=None):
    seed = _row_seed(data_config.seed, epoch, index)
    kwargs = {'partner': partner} if partnered else {}
    return objective.fn(
      row, seed, config=config.objective, tokenizer=tokenizer, **kwargs
    )

  stream = stream.map(
    no_autograph(transform), num_parallel_calls=_AUTOTUNE, deterministic=True
  )
  stream = stream.batch(batch, drop_remainder=True).prefetch(_AUTOTUNE)
  return stream.with_options(_options())


def train_iterator(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  start_batch: int = 0,
  process_index: int = 0,
  process_count: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
  """train_dataset as an iterator of numpy dicts."""
  return train_dataset(
    config,
    tokenizer,
    objective,
    start_batch=start_batch,
    process_index=process_index,
    process_count=process_count,
  ).as_numpy_iterator()


def eval_batches(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  process_index: int = 0,
  process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
  """The data.eval_batches evaluation batches: unshuffled, fixed masks."""
  data_config = config.data
  batch = _per_host_batch(data_config, process_count)
  if _eval_is_prepared(data_config):
    return _prepared_eval(
      config, tokenizer, objective, process_index, process_count
    )
  rows = _rows(
    config,
    tokenizer,
    objective,
    split='eval',
    process_index=process_index,
    process_count=process_count,
  )

  partnered = objective.partnered

  def transform(index, row, partner=None):
    seed = _row_seed(data_config.seed, 0, index)
    kwargs = {'partner': partner} if partnered else {}
    return objective.fn(
      row, seed, config=config.objective, tokenizer=tokenizer, **kwargs
    )

  ds = rows.enumerate()
  if partnered:
    # Eval rows are in document order, so a neighbour would be the same
    # document: partners come from a fixed shuffle of the split instead.
    partners = rows.shuffle(
      data_config.shuffle_buffer,
      seed=data_config.seed ^ _PARTNER_SALT,
      reshuffle_each_iteration=False,
    )
    ds = tf.data.Dataset.zip(ds, partners).map(
      no_autograph(lambda indexed, partner: (*indexed, partner))
    )
  ds = ds.map(
    no_autograph(transform), num_parallel_calls=_AUTOTUNE, deterministic=True
  )
  ds = ds.batch(batch, drop_remainder=True).take(data_config.eval_batches)
  batches = list(ds.with_options(_options()).as_numpy_iterator())
  if len(batches) < data_config.eval_batches:
    # Every host must run the same number of eval steps, so a short eval
    # split is an error rather than fewer batches.
    source = sources.eval_source(data_config) or data_config.source
    raise ValueError(
      f'The eval split ({source!r}) gives {len(batches)} batches of '
      f'{batch} rows on this host, fewer than data.eval_batches='
      f'{data_config.eval_batches}: lower data.eval_batches or use more '
      'eval text.'
    )
  return batches


def _eval_is_prepared(data_config) -> bool:
  source = sources.eval_source(data_config) or data_config.source
  return prepared.is_prepared(source)


def prepared_stream(
  config: ml_collections.ConfigDict, row_length: int, split: str = 'train'
) -> prepared.Stream:
  """The run's prepared corpora (data.source) as a stream, checked.

  For 'eval', data.eval_source's corpora where it names prepared ones,
  and each must hold data.eval_batches full batches (every host runs the
  same eval steps).
  """
  d = config.data
  source = d.source
  if split == 'eval' and sources.eval_source(d):
    source = d.eval_source
  corpora = prepared.corpora(config, row_length, split=split, source=source)
  for corpus in corpora if split == 'eval' else ():
    rows = corpus.num_rows('eval')
    if rows < d.eval_batches * d.batch_size:
      raise ValueError(
        f'Prepared corpus {corpus.directory}: its eval split has {rows} '
        f'rows, fewer than data.eval_batches={d.eval_batches} x '
        f'data.batch_size={d.batch_size}: lower data.eval_batches, or '
        'prepare it with a data.eval_source.'
      )
  return prepared.Stream(corpora, d.seed, split=split)


def _prepared_dataset(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  split: str,
  start_batch: int = 0,
  process_index: int = 0,
  process_count: int = 1,
  stream: prepared.Stream | None = None,
  num_batches: int | None = None,
) -> tf.data.Dataset:
  """train_dataset (or an eval split) of prepared corpora, read by index."""
  stream = stream or prepared_stream(config, objective.row_length, split)
  _check_prepared_tokenizer(stream, tokenizer)
  partnered = objective.partnered
  if partnered and config.data.batch_size < 2:
    raise ValueError(
      f'objective.sentence_task={config.objective.sentence_task!r} pairs '
      'rows within a batch and needs data.batch_size >= 2.'
    )

  def transform(row, seed, partner=None):
    kwargs = {'partner': partner} if partnered else {}
    return objective.fn(
      row, seed, config=config.objective, tokenizer=tokenizer, **kwargs
    )

  return prepared.dataset(
    stream,
    row_length=objective.row_length,
    features=lambda ids: row_features(ids, tokenizer.sep_id, tokenizer.pad_id),
    transform=transform,
    batch_size=config.data.batch_size,
    start_batch=start_batch,
    process_index=process_index,
    process_count=process_count,
    partnered=partnered,
    num_batches=num_batches,
    shuffled=split == 'train',
  )


def _check_prepared_tokenizer(stream: prepared.Stream, tokenizer) -> None:
  """The run's tokenizer must be the one the rows were made with."""
  sha = records.tokenizer_meta(tokenizer)['sha256']
  for corpus in stream.corpora:
    if corpus.manifest['tokenizer']['sha256'] != sha:
      raise ValueError(
        f'Prepared corpus {corpus.directory} was tokenized with tokenizer '
        f'{corpus.manifest["tokenizer"]["sha256"][:12]}, but this run '
        f'uses {tokenizer.path} ({sha[:12]}). Leave data.tokenizer empty '
        "to use the corpus' own, or prepare the corpus with this one."
      )


def _prepared_eval(config, tokenizer, objective, process_index, process_count):
  """Eval batches of prepared corpora: {name: batches} per corpus.

  Each corpus' eval split is read in stored order from its start: the
  same rows and masks on every host count.
  """
  d = config.data
  stream = prepared_stream(config, objective.row_length, 'eval')
  sets = {}
  for corpus in stream.corpora:
    one = prepared.Stream([corpus], d.seed, split='eval')
    ds = _prepared_dataset(
      config,
      tokenizer,
      objective,
      split='eval',
      process_index=process_index,
      process_count=process_count,
      stream=one,
      num_batches=d.eval_batches,
    )
    sets[corpus.entry.name] = list(ds.as_numpy_iterator())
  if len(sets) == 1:
    return next(iter(sets.values()))
  return sets


def tokens_per_source(
  config: ml_collections.ConfigDict, row_length: int, step: int
) -> dict[str, int]:
  """Row tokens each prepared corpus gave in steps [0, step) (metrics).

  data/tokens_<name>: rows x row length, [PAD] included; {} for a raw
  source, whose single stream is train/tokens already.
  """
  if not prepared.is_prepared(config.data.source):
    return {}
  entries = prepared.parse_source(config.data.source)
  stream = prepared.Stream(
    [prepared.Corpus.cached(e) for e in entries], config.data.seed
  )
  rows = stream.rows_read(step * config.data.batch_size)
  return {
    f'data/tokens_{e.name}': int(n) * row_length
    for e, n in zip(entries, rows, strict=True)
  }
