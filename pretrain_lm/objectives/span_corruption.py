"""T5's span corruption (Raffel et al. 2020, section 3.1.4), noise per epoch.

A packed 'concat' row loses its [SEP]s and trailing [PAD]s (T5 joins
documents without separators), leaving n text tokens. Of those,
num_noise = round(n * noise_density), clipped to [1, n - 1], are noise, in
num_spans = round(num_noise / mean_span_length) (at least 1) spans. The
noise tokens are split into num_spans non-empty spans and the others into
num_spans non-empty spans, each split uniformly at random among the
compositions, and the row reads non-noise, noise, non-noise, noise, ...
The encoder sees each noise span replaced by one sentinel, then [SEP]; the
decoder predicts each sentinel followed by its span, then [SEP]. Sentinel k
(the row's k-th span) is id tokenizer.vocab_size + k: the tokenizer is
trained num_sentinels ids short of model.vocab_size, so these are free.

Rows hold R raw tokens, R the largest length whose corrupted input fits
data.seq_len: T5's 568 raw tokens give 512 inputs and 114 targets.
"""

import ml_collections
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import clm, reconstruct

FAMILIES = ('encoder_decoder',)


def noise_counts(n: int, noise_density: float, mean_span_length: float):
  """(num_noise, num_spans) of n text tokens; (0, 0) below two tokens."""
  if n < 2:
    return 0, 0
  num_noise = min(max(round(n * noise_density), 1), n - 1)
  num_spans = max(round(num_noise / mean_span_length), 1)
  # Every span must be non-empty on both sides (only binds at extreme
  # densities).
  return num_noise, min(num_spans, num_noise, n - num_noise)


def length_limits(raw_length, bodies):
  """Running maxima of bodies(n) over n = 0..raw_length, per entry."""
  limits = bodies(0)
  for n in range(1, raw_length + 1):
    limits = tuple(map(max, limits, bodies(n)))
  return limits


def largest_fitting(fits) -> int:
  """The largest R such that fits(n) for every n <= R."""
  raw = 0
  while fits(raw + 1):
    raw += 1
  return raw


def body_lengths(noise_density, mean_span_length):
  """n -> (inputs, targets, spans) without [SEP]: kept + one per span."""

  def bodies(n):
    num_noise, num_spans = noise_counts(n, noise_density, mean_span_length)
    return n - num_noise + num_spans, num_noise + num_spans, num_spans

  return bodies


def lengths(
  seq_len: int, noise_density: float, mean_span_length: float
) -> tuple[int, int, int]:
  """The raw row length and the static input and target lengths.

  Args:
    seq_len: the encoder length (data.seq_len).
    noise_density: the fraction of tokens that are noise.
    mean_span_length: the mean noise span length.

  Returns:
    (raw_length, inputs_length, targets_length): raw_length is the largest
    row length R whose inputs (kept tokens, a sentinel per span and [SEP])
    fit seq_len for every n <= R text tokens; the lengths are the longest
    inputs and targets (sentinels, spans and [SEP]) such rows give. With
    T5's 512, 0.15 and 3: (568, 512, 114).
  """
  _check(noise_density, mean_span_length)
  bodies = body_lengths(noise_density, mean_span_length)
  raw = largest_fitting(lambda n: bodies(n)[0] + 1 <= seq_len)
  inputs, targets, _ = length_limits(raw, bodies)
  return raw, inputs + 1, targets + 1


def row_length(config: ml_collections.ConfigDict) -> int:
  """Packed row length: the raw tokens whose corruption fits seq_len."""
  o = config.objective
  return lengths(config.data.seq_len, o.noise_density, o.mean_span_length)[0]


def check_config(config: ml_collections.ConfigDict) -> None:
  """Fails fast (pretrain_lm.validate) on bad rates or too few sentinels."""
  o = config.objective
  raw = row_length(config)
  bodies = body_lengths(o.noise_density, o.mean_span_length)
  check_sentinels(
    length_limits(raw, bodies)[2],
    o.num_sentinels,
    f'span_corruption on {raw} tokens',
  )


def num_reserved_ids(config: ml_collections.ConfigDict) -> int:
  """The sentinel ids, after the tokenizer's vocabulary."""
  return config.num_sentinels


def _check(noise_density, mean_span_length):
  if not 0 < noise_density < 1:
    raise ValueError(
      f'objective.noise_density={noise_density} must be in (0, 1).'
    )
  if mean_span_length < 1:
    raise ValueError(
      f'objective.mean_span_length={mean_span_length} must be >= 1.'
    )


def check_sentinels(max_spans: int, num_sentinels: int, what: str) -> None:
  """Raises if a row could need more sentinels than are reserved."""
  if max_spans > num_sentinels:
    raise ValueError(
      f'{what} can give up to {max_spans} noise spans per row, more than '
      f'objective.num_sentinels={num_sentinels}: raise '
      'objective.num_sentinels (and model.vocab_size with it) or shorten '
      'data.seq_len.'
    )


def text_tokens(ids: tf.Tensor, tokenizer) -> tf.Tensor:
  """The row's text tokens, front-compacted: no [PAD]/[CLS]/[SEP]/[MASK]."""
  special = tf.constant(
    [tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id]
  )
  return tf.boolean_mask(ids, tf.reduce_all(ids[:, None] != special, axis=1))


def _composition_ends(total, parts, max_parts: int, size: int, seed):
  """Cumulative ends of a uniformly random composition of `total` items.

  The parts (positive, `parts` of them) end at the cut points, a uniformly
  random (parts - 1)-subset of {1, ..., total - 1}, and at `total`. Returns
  int32[max_parts], sorted; entries from parts - 1 on are `total`.
  """
  # Candidate cut c is slot c - 1; the largest random scores among the
  # valid slots are a uniformly random subset. Invalid slots score -1.
  scores = tf.random.stateless_uniform([size], seed=seed)
  scores = tf.where(tf.range(size) < total - 1, scores, -1.0)
  _, top = tf.math.top_k(scores, k=max_parts)
  is_cut = tf.range(max_parts) < parts - 1
  return tf.sort(tf.where(is_cut, top + 1, total))


def corrupt(
  tokens: tf.Tensor,
  seed: tf.Tensor,
  *,
  noise_density: float | tf.Tensor,
  mean_span_length: float | tf.Tensor,
  max_tokens: int,
  max_spans: int,
  first_sentinel: int,
) -> tuple[tf.Tensor, tf.Tensor]:
  """Span-corrupts `tokens` (int32[n], n <= max_tokens); no [SEP] added.

  Returns the inputs (kept tokens, a sentinel per noise span) and the
  targets (each sentinel followed by its span), both int32[None].
  `max_spans` bounds the spans any n <= max_tokens gives; the rates may be
  float64 scalar tensors (UL2 gathers them per row).
  """
  n = tf.size(tokens)
  # float64 and round-half-to-even, as Python's round in noise_counts.
  num_noise = tf.cast(
    tf.round(tf.cast(n, tf.float64) * noise_density), tf.int32
  )
  num_noise = tf.minimum(tf.maximum(num_noise, 1), n - 1)
  num_spans = tf.cast(
    tf.round(tf.cast(num_noise, tf.float64) / mean_span_length), tf.int32
  )
  num_spans = tf.minimum(
    tf.maximum(num_spans, 1), tf.minimum(num_noise, n - num_noise)
  )
  short = n < 2
  num_noise = tf.where(short, 0, num_noise)
  num_spans = tf.where(short, 0, num_spans)

  seeds = tf.random.experimental.stateless_split(seed, num=2)
  size = max(max_tokens, max_spans, 1)
  noise_ends = _composition_ends(
    num_noise, num_spans, max_spans, size, seeds[0]
  )
  kept_ends = _composition_ends(
    n - num_noise, num_spans, max_spans, size, seeds[1]
  )
  # Noise span i follows kept spans 0..i and noise spans 0..i-1.
  starts = kept_ends + tf.concat([[0], noise_ends[:-1]], axis=0)
  ends = kept_ends + noise_ends
  # Unused spans scatter into an extra, dropped slot.
  is_span = tf.range(max_spans) < num_spans
  starts = tf.where(is_span, starts, max_tokens)[:, None]
  ends = tf.where(is_span, ends, max_tokens)[:, None]
  ones = tf.ones([max_spans], tf.int32)
  slots = tf.zeros([max_tokens + 1], tf.int32)
  delta = tf.tensor_scatter_nd_add(slots, starts, ones)
  is_start = delta[:max_tokens] > 0
  delta = tf.tensor_scatter_nd_sub(delta, ends, ones)
  is_noise = tf.cumsum(delta)[:max_tokens] > 0

  padded = tf.pad(tokens, [[0, max_tokens - n]])
  span_index = tf.cumsum(tf.cast(is_start, tf.int32)) - 1
  sentinel = first_sentinel + span_index
  is_token = tf.range(max_tokens) < n
  keep = tf.logical_and(
    is_token, tf.logical_or(tf.logical_not(is_noise), is_start)
  )
  inputs = tf.boolean_mask(tf.where(is_start, sentinel, padded), keep)
  # Targets interleave [sentinel at a span start] and [noise token]; -1
  # marks what is left out.
  pairs = tf.stack(
    [tf.where(is_start, sentinel, -1), tf.where(is_noise, padded, -1)], axis=1
  )
  pairs = tf.reshape(pairs, [-1])
  return inputs, tf.boolean_mask(pairs, pairs >= 0)


def pad_to(ids, length: int):
  """ids padded with 0 to `length`; an error, not a cut, if longer."""
  return tf.ensure_shape(tf.pad(ids, [[0, length - tf.size(ids)]]), [length])


def seq2seq_features(
  inputs: tf.Tensor,
  targets: tf.Tensor,
  inputs_length: int,
  targets_length: int,
  start_id: int,
) -> dict[str, tf.Tensor]:
  """Encoder-decoder features of one example: one segment each, padded."""
  features = {}
  for prefix, ids, length in (
    ('encoder_', inputs, inputs_length),
    ('decoder_', targets, targets_length),
  ):
    is_real = tf.range(length) < tf.size(ids)
    features[f'{prefix}segment_ids'] = tf.cast(is_real, tf.int32)
    features[f'{prefix}positions'] = tf.where(is_real, tf.range(length), 0)
  target_ids = pad_to(targets, targets_length)
  segments = features['decoder_segment_ids']
  decoder_input = reconstruct.shift_right(target_ids, segments, start_id)
  features['encoder_input_ids'] = pad_to(inputs, inputs_length)
  features['decoder_input_ids'] = tf.where(segments != 0, decoder_input, 0)
  features['target_ids'] = target_ids
  features['target_weights'] = tf.cast(segments, tf.float32)
  return features


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """Span-corrupts one packed row; all randomness comes from `seed`.

  Args:
    row: a packed row, {'input_ids', ...} int32[R], R = row_length.
    seed: int32/int64[2], a stateless seed unique to (epoch, row).
    config: the `objective` section (noise_density, mean_span_length,
      num_sentinels).
    tokenizer: gives the special ids and vocab_size (the first sentinel).

  Returns:
    encoder_input_ids, encoder_segment_ids, encoder_positions int32[S]
    (S = data.seq_len); decoder_input_ids (the targets shifted right after
    [CLS]), decoder_segment_ids, decoder_positions, target_ids int32[T] and
    target_weights float32[T] (1 on the targets, 0 on padding).
  """
  ids = tf.cast(row['input_ids'], tf.int32)
  raw_length = ids.shape[0]
  bodies = body_lengths(config.noise_density, config.mean_span_length)
  _check(config.noise_density, config.mean_span_length)
  inputs_max, targets_max, spans_max = length_limits(raw_length, bodies)
  check_sentinels(
    spans_max, config.num_sentinels, f'span_corruption on {raw_length} tokens'
  )
  inputs, targets = corrupt(
    text_tokens(ids, tokenizer),
    seed,
    noise_density=config.noise_density,
    mean_span_length=config.mean_span_length,
    max_tokens=raw_length,
    max_spans=max(spans_max, 1),
    first_sentinel=tokenizer.vocab_size,
  )
  eos = [tokenizer.sep_id]
  return seq2seq_features(
    tf.concat([inputs, eos], axis=0),
    tf.concat([targets, eos], axis=0),
    inputs_max + 1,
    targets_max + 1,
    tokenizer.cls_id,
  )


loss = clm.loss
