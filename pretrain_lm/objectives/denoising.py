"""BART denoising (Lewis et al. 2020): rebuild a row from a noised copy.

A packed row ([CLS] d1 [SEP] d2 [SEP] ... [PAD]*, data.packing
'full_sentences') is one sample, as the paper's complete-document blocks.
The encoder reads it corrupted by the noises of the paper's section 2.2,
each off at rate 0 and applied in this order:

- sentence permutation: round(permute_sentences * S) of the row's S
  sentences, chosen at random, trade places in a uniformly random order. A
  sentence ends after a token whose text ends with '.', '!' or '?', and at
  each [SEP]; an interior [SEP] travels with the sentence it ends.
- token masking: each text token becomes [MASK] with token_mask_rate.
- token deletion: each text token is removed with delete_rate.
- text infilling: spans with lengths ~ Poisson(poisson_lambda) cover
  round(infill_rate * m) of the row's m text tokens; each span becomes one
  [MASK], or with infill_random_rate one random text token, so that a
  zero-length span inserts one. A span stops at an interior [SEP].
- document rotation: with rotate_rate the row starts at a uniformly random
  token.

Text tokens are all but [PAD], [CLS], [SEP] and [MASK]: noise never
touches the others, and the leading [CLS] and final [SEP] keep their
places. The decoder reads the original row and predicts every token after
[CLS]: one segment over the row's real tokens, positions 0..n-1, so it
attends across the row's documents. base_config's defaults are
BART-large's setting (section 5.1: infill 30%, permute all sentences),
with the released recipe's lambda = 3.5 (section 2.2's text says 3) and
10% random span tokens.
"""

import math

import ml_collections
import numpy as np
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import clm

FAMILIES = ('encoder_decoder',)

_SENTENCE_END = ('.', '!', '?')
_RATES = (
  'permute_sentences',
  'token_mask_rate',
  'delete_rate',
  'infill_rate',
  'infill_random_rate',
  'rotate_rate',
)


def sentence_end_table(piece_texts: list[str]) -> np.ndarray:
  """bool[vocab]: the piece's text ends a sentence."""
  return np.array(
    [text.rstrip().endswith(_SENTENCE_END) for text in piece_texts], bool
  )


def check_config(config: ml_collections.ConfigDict) -> None:
  """Fails fast (pretrain_lm.validate) on bad rates or [CLS]-less rows."""
  _check(config.objective)
  # The row's [CLS] is the decoder's start token; 'concat' rows have none.
  if config.data.packing not in ('full_sentences', 'doc_sentences'):
    raise ValueError(
      f'data.packing={config.data.packing!r}: denoising needs rows that '
      "start with [CLS], 'full_sentences' (BART) or 'doc_sentences'."
    )


def _check(config: ml_collections.ConfigDict) -> None:
  for name in _RATES:
    if not 0 <= config[name] <= 1:
      raise ValueError(f'objective.{name}={config[name]} must be in [0, 1].')
  if config.infill_rate > 0 and config.poisson_lambda < 0:
    raise ValueError(
      f'objective.poisson_lambda={config.poisson_lambda} must be >= 0.'
    )


def _poisson_cdf(lam: float) -> np.ndarray:
  """P(L <= k), k = 0, 1, ..., for L ~ Poisson(lam), up to 1 - 1e-15."""
  if lam == 0:
    return np.ones([1])
  k = np.arange(int(lam + 12 * math.sqrt(lam) + 30))
  log_pmf = k * math.log(lam) - lam - np.array([math.lgamma(x + 1) for x in k])
  return np.cumsum(np.exp(log_pmf))


def _scatter(values, dest, valid, size: int, fill: int):
  """out[dest[i]] = values[i] where valid; `fill` elsewhere; int32[size]."""
  # Invalid entries land on an extra slot, then dropped.
  index = tf.where(valid, dest, size)[:, None]
  out = tf.fill([size + 1], tf.constant(fill, tf.int32))
  return tf.tensor_scatter_nd_update(out, index, values)[:size]


def _round(rate: float, count):
  """round(rate * count) in float64 (round half to even), as int32."""
  return tf.cast(tf.round(tf.cast(count, tf.float64) * rate), tf.int32)


def _permute_sentences(ids, start, stop, u, *, rate, ends, sep_id):
  """Shuffles round(rate * S) random sentences of the body [start, stop).

  `u`: R uniform numbers, as every noise below takes its share of one draw.
  """
  R = ids.shape[0]
  j = tf.range(R)
  in_body = (j >= start) & (j < stop)
  # A sentence-final piece right before a [SEP] leaves the [SEP] in its
  # sentence rather than a sentence of its own.
  next_is_sep = tf.concat([ids[1:] == sep_id, [False]], 0)
  is_end = in_body & (
    (ids == sep_id) | (tf.gather(ends, ids) & ~next_is_sep) | (j == stop - 1)
  )
  sentence = tf.cumsum(tf.cast(is_end, tf.int32), exclusive=True)
  sentence = tf.where(in_body, sentence, 0)
  num = tf.reduce_sum(tf.cast(is_end, tf.int32))
  lengths = tf.math.unsorted_segment_sum(
    tf.cast(in_body, tf.int32), sentence, R
  )
  # Slot s holds sentence s. The first k of a random order of the S slots
  # are a uniformly random k-subset in uniformly random order: dealt back to
  # the same slots in ascending order, they permute the chosen sentences.
  k = _round(rate, num)
  shuffled = tf.argsort(tf.where(j < num, u, 2.0))
  chosen = tf.math.invert_permutation(shuffled) < k
  # The chosen slots ascending, then the rest ascending.
  slots = tf.argsort(tf.where(chosen, j, R + j))
  order = tf.scatter_nd(slots[:, None], tf.where(j < k, shuffled, slots), [R])
  # order[s]: the sentence now in slot s; its tokens move by the change of
  # its start.
  new_start = tf.scatter_nd(
    order[:, None], tf.cumsum(tf.gather(lengths, order), exclusive=True), [R]
  )
  shift = new_start - tf.cumsum(lengths, exclusive=True)
  dest = tf.where(in_body, j + tf.gather(shift, sentence), j)
  return tf.scatter_nd(dest[:, None], ids, [R])


def _delete(ids, n, u, *, rate, is_text, pad_id):
  """Removes each text token with probability `rate`; returns (ids, n)."""
  R = ids.shape[0]
  drop = is_text & (u < rate)
  keep = (tf.range(R) < n) & ~drop
  keep_int = tf.cast(keep, tf.int32)
  dest = tf.cumsum(keep_int, exclusive=True)
  return _scatter(ids, dest, keep, R, pad_id), tf.reduce_sum(keep_int)


def _infill(ids, n, u, *, config, tokenizer, is_text):
  """Text infilling; returns (ids, n, spans) with the spans for tests.

  Span lengths are drawn until they cover num_noise = round(infill_rate * m)
  of the m text tokens, the last cut to fit. The spans and the m - num_noise
  untouched text tokens are laid out in a uniformly random order over the
  text tokens (specials skipped), so spans never overlap and each length
  stays Poisson. A span that runs into a special token (an interior [SEP])
  stops there: a [MASK] never hides tokens on both sides of a boundary.
  `u`: 5R + 1 uniform numbers.
  """
  R = ids.shape[0]
  m = tf.reduce_sum(tf.cast(is_text, tf.int32))
  spans = _sample_spans(
    u[: 3 * R + 1], m, rate=config.infill_rate, lam=config.poisson_lambda
  )
  # Each span's token: [MASK], or a random text token with
  # infill_random_rate.
  num_normal = tokenizer.vocab_size - tokenizer.first_normal_id
  random_ids = tokenizer.first_normal_id + tf.minimum(
    tf.cast(u[3 * R + 1 : 4 * R + 1] * num_normal, tf.int32), num_normal - 1
  )
  fill = tf.where(
    u[4 * R + 1 :] < config.infill_random_rate, random_ids, tokenizer.mask_id
  )
  out, new_n = _replace_spans(ids, n, is_text, m, spans, fill, tokenizer.pad_id)
  # Infilling adds num_spans tokens and removes num_noise, so a full row
  # grows only if zero-length spans outnumber the tokens of longer spans
  # beyond their first: at lambda 3.5, only in a row of a few text tokens.
  # None of the tests' 2000 rows of 128 does, nor any of the bundled
  # corpus's rows of 64 or 512 (every one shrank, by 3+ and 43+ tokens). A
  # grown row keeps its first R - 1 tokens and its last.
  overflow = new_n > R
  last = out[tf.maximum(new_n - 1, 0)]
  out = tf.where(overflow & (tf.range(R) == R - 1), last, out[:R])
  return out, tf.minimum(new_n, R), {**spans, 'overflow': overflow}


def _sample_spans(u, m, *, rate: float, lam: float) -> dict[str, tf.Tensor]:
  """Infilling's spans over m text tokens: their lengths and text starts.

  `u`: 3R + 1 uniform numbers. Returns num_noise, num_spans, the R drawn
  lengths, the lengths cut to cover num_noise, and the spans' starts
  (text indices) and lengths in their left-to-right order; 0 lengths and
  start R past num_spans.
  """
  R = (u.shape[0] - 1) // 3
  i = tf.range(R)
  num_noise = _round(rate, m)

  # Poisson by inverting its CDF: L = #{k : P(L <= k) <= u}. At most R
  # spans: enough unless poisson_lambda is far below infill_rate.
  cdf = tf.constant(_poisson_cdf(lam))
  drawn = tf.searchsorted(cdf, tf.cast(u[:R], tf.float64), side='right')
  ends = tf.cumsum(drawn)
  num_spans = tf.minimum(
    R, tf.reduce_sum(tf.cast(ends < num_noise, tf.int32)) + 1
  )
  num_spans = tf.where(num_noise > 0, num_spans, 0)
  valid = i < num_spans
  lengths = tf.where(valid, tf.minimum(drawn, num_noise - ends + drawn), 0)
  # Left to right the spans take the drawn order rotated at random, so that
  # the cut last span is not always the rightmost.
  turn = tf.cast(u[R] * tf.cast(num_spans, tf.float32), tf.int32)
  placed = tf.gather(lengths, (i + turn) % tf.maximum(num_spans, 1))
  placed = tf.where(valid, placed, 0)

  # A uniformly random num_spans-subset of the num_slots units (spans and
  # untouched tokens) holds the spans: the top random scores.
  num_slots = m - tf.reduce_sum(lengths) + num_spans
  score = tf.where(tf.range(2 * R) < num_slots, u[R + 1 : 3 * R + 1], -1.0)
  slots = tf.sort(tf.where(valid, tf.math.top_k(score, k=R).indices, 2 * R))
  # Span i follows slots[i] - i untouched tokens and the spans before it;
  # the starts (text indices) ascend, a zero-length span before a span
  # starting at the same token.
  starts = tf.where(valid, slots - i + tf.cumsum(placed, exclusive=True), R)
  return {
    'num_noise': num_noise,
    'num_spans': num_spans,
    'drawn': drawn,
    'lengths': lengths,
    'starts': starts,
    'placed': placed,
  }


def _replace_spans(ids, n, is_text, m, spans, fill, pad_id):
  """The row with each span's tokens replaced by its one `fill` token.

  Untouched tokens and each span's first token (replaced) stay; a
  zero-length span inserts its token before text token starts[i] (after
  the last text token when that is m). Returns the row over 2R slots,
  pad_id past its length, and that length.
  """
  R = ids.shape[0]
  i = tf.range(R)  # span index, and position index
  starts, placed = spans['starts'], spans['placed']
  valid = i < spans['num_spans']

  # Each text token's span: the last one starting at or before it.
  tix = tf.cumsum(tf.cast(is_text, tf.int32), exclusive=True)
  text_pos = _scatter(i, tix, is_text, R, 0)
  span = tf.maximum(tf.searchsorted(starts, tix, side='right') - 1, 0)
  start = tf.gather(starts, span)
  from_start = tix - start
  covered = is_text & (from_start >= 0) & (from_start < tf.gather(placed, span))
  # Cut at a special token: it would sit between the start and this token.
  start_pos = tf.gather(text_pos, tf.minimum(start, R - 1))
  covered &= i - start_pos == from_start
  first = covered & (from_start == 0)

  keep = (i < n) & (~covered | first)
  value = tf.where(first, tf.gather(fill, span), ids)
  zero = valid & (placed == 0)
  target = tf.where(
    starts < m,
    tf.gather(text_pos, tf.minimum(starts, R - 1)),
    tf.gather(text_pos, tf.maximum(m - 1, 0)) + 1,
  )
  target = tf.where(zero, target, R)
  # Slot R: after the last token, where a row without a final [SEP] that
  # fills R positions puts an insertion after its last text token.
  inserts = tf.math.unsorted_segment_sum(tf.cast(zero, tf.int32), target, R + 1)
  totals = tf.concat([tf.cast(keep, tf.int32), [0]], 0) + inserts
  out_start = tf.cumsum(totals, exclusive=True)
  new_n = out_start[R] + inserts[R]
  # Zero-length spans at one place are consecutive in i.
  rank = i - tf.searchsorted(starts, starts, side='left')
  out = _scatter(
    tf.concat([value, fill], 0),
    tf.concat(
      [(out_start + inserts)[:R], tf.gather(out_start, target) + rank], 0
    ),
    tf.concat([keep, zero], 0),
    2 * R,
    pad_id,
  )
  return out, new_n


def _rotate(ids, start, stop, u, *, rate):
  """With probability `rate`, body [start, stop) starts at a random token."""
  R = ids.shape[0]
  j = tf.range(R)
  size = tf.maximum(stop - start, 1)
  offset = tf.cast(u[0] * tf.cast(size, tf.float32), tf.int32)
  rotate = u[1] < rate
  offset = tf.where(rotate, tf.minimum(offset, size - 1), 0)
  source = tf.where(
    (j >= start) & (j < stop), start + (j - start + offset) % size, j
  )
  return tf.gather(ids, source)


def noise(ids, n, seed, *, config, tokenizer, ends=None):
  """The noised row: (ids int32[R], n) and the infilled spans (or None)."""
  R = ids.shape[0]
  j = tf.range(R)
  if tokenizer.mask_id < 0 and (
    config.token_mask_rate > 0 or config.infill_rate > 0
  ):
    raise ValueError(
      'objective.token_mask_rate and infill_rate write mask tokens, and '
      f'tokenizer {tokenizer.path!r} has none; set both to 0.'
    )
  special = tf.constant(
    [tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id]
  )

  def text(ids, n):
    return (j < n) & tf.reduce_all(ids[:, None] != special, axis=1)

  def body(ids, n):
    """[start, stop): the tokens between a leading [CLS] and final [SEP]."""
    start = tf.cast(ids[0] == tokenizer.cls_id, tf.int32)
    last = tf.gather(ids, tf.maximum(n - 1, 0))
    stop = n - tf.cast((n > start) & (last == tokenizer.sep_id), tf.int32)
    return start, stop

  # One draw of uniform numbers; each noise that is on takes its share.
  sizes = {
    'permute_sentences': R,
    'token_mask_rate': R,
    'delete_rate': R,
    'infill_rate': 5 * R + 1,
    'rotate_rate': 2,
  }
  total = sum(size for name, size in sizes.items() if config[name] > 0)
  draw = tf.random.stateless_uniform([max(total, 1)], seed=seed)
  u, offset = {}, 0
  for name, size in sizes.items():
    if config[name] > 0:
      u[name], offset = draw[offset : offset + size], offset + size
  spans = None
  if 'permute_sentences' in u:
    ids = _permute_sentences(
      ids,
      *body(ids, n),
      u['permute_sentences'],
      rate=config.permute_sentences,
      ends=ends,
      sep_id=tokenizer.sep_id,
    )
  if 'token_mask_rate' in u:
    masked = text(ids, n) & (u['token_mask_rate'] < config.token_mask_rate)
    ids = tf.where(masked, tokenizer.mask_id, ids)
  if 'delete_rate' in u:
    ids, n = _delete(
      ids,
      n,
      u['delete_rate'],
      rate=config.delete_rate,
      is_text=text(ids, n),
      pad_id=tokenizer.pad_id,
    )
  if 'infill_rate' in u:
    ids, n, spans = _infill(
      ids,
      n,
      u['infill_rate'],
      config=config,
      tokenizer=tokenizer,
      is_text=text(ids, n),
    )
  if 'rotate_rate' in u:
    ids = _rotate(ids, *body(ids, n), u['rotate_rate'], rate=config.rotate_rate)
  return ids, n, spans


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """Noised encoder input and the original row as the decoder's target.

  Args:
    row: a packed row, {'input_ids', 'segment_ids', 'positions'} int32[R].
    seed: int64[2], a stateless seed unique to (data.seed, epoch, row).
    config: the `objective` section (permute_sentences, token_mask_rate,
      delete_rate, infill_rate, poisson_lambda, infill_random_rate,
      rotate_rate).
    tokenizer: the special ids, first_normal_id, vocab_size, and
      piece_texts() when permute_sentences > 0.

  Returns:
    encoder_input_ids (the noised row, padded), encoder_segment_ids (1 on
    its tokens), encoder_positions; decoder_input_ids (the row),
    decoder_segment_ids, decoder_positions; target_ids (the row shifted
    left) int32[R] and target_weights float32[R] (1 on real targets).
  """
  _check(config)
  ends = None
  if config.permute_sentences > 0:
    ends = tf.constant(sentence_end_table(tokenizer.piece_texts()))
  ids = tf.cast(row['input_ids'], tf.int32)
  R = ids.shape[0]
  j = tf.range(R)
  n = tf.reduce_sum(tf.cast(ids != tokenizer.pad_id, tf.int32))
  noised, noised_n, _ = noise(
    ids, n, seed, config=config, tokenizer=tokenizer, ends=ends
  )
  encoder_real = j < noised_n
  real = j < n
  target = tf.concat([ids[1:], [tokenizer.pad_id]], 0)
  return {
    'encoder_input_ids': tf.ensure_shape(noised, [R]),
    'encoder_segment_ids': tf.cast(encoder_real, tf.int32),
    'encoder_positions': tf.where(encoder_real, j, 0),
    'decoder_input_ids': ids,
    'decoder_segment_ids': tf.cast(real, tf.int32),
    'decoder_positions': tf.where(real, j, 0),
    'target_ids': target,
    'target_weights': tf.cast(target != tokenizer.pad_id, tf.float32),
  }


loss = clm.loss
