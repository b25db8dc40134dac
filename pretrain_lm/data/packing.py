"""Documents -> token ids -> packed rows, with segment ids and positions.

tf.data only. `pack` is the one packer: the raw-text stream packs a split
with it on the fly, and the Beam preparation (prepare.py, shards.py) packs
each input range with it offline, so both give the same rows.
"""

import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.data.sources import no_autograph

PACKINGS = ('full_sentences', 'doc_sentences', 'concat')
_AUTOTUNE = tf.data.AUTOTUNE
# The shortest row each packing can put a token in: [CLS] token [SEP], or
# token [SEP] for 'concat'.
_MIN_ROW_LEN = {'full_sentences': 3, 'doc_sentences': 3, 'concat': 2}
# Documents joined into one run per scan step ('full_sentences', 'concat').
DOCS_PER_RUN = 256


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


def _runs(
  docs: tf.data.Dataset, sep_id: int, docs_per_run: int
) -> tf.data.Dataset:
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

  return docs.ragged_batch(docs_per_run).map(no_autograph(join))


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
  docs_per_run: int = DOCS_PER_RUN,
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
    docs_per_run: documents joined per scan step ('full_sentences',
      'concat'); the rows do not depend on it.

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
    return _pack_doc_sentences(docs, row_len, cls_id, sep_id, pad_id)
  if packing == 'full_sentences':
    step = _full_sentences_step(row_len, cls_id, sep_id, pad_id)
  else:
    step = _concat_step(row_len, pad_id)
  return _pack_runs(docs, step, row_len, sep_id, pad_id, docs_per_run)


def _pack_doc_sentences(docs, row_len, cls_id, sep_id, pad_id):
  """'doc_sentences': each document's own rows, document by document."""
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


def _pack_runs(docs, step, row_len, sep_id, pad_id, docs_per_run):
  """'full_sentences', 'concat': `step` scanned over runs of documents."""
  # An empty run flagged as the end flushes the unfinished row.
  end = (tf.zeros([0], tf.int32), tf.zeros([1], tf.int32), tf.constant(True))
  flagged = _runs(docs, sep_id, docs_per_run).concatenate(
    tf.data.Dataset.from_tensors(end)
  )
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
