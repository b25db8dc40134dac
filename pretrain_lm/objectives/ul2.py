"""UL2's mixture of denoisers (Tay et al. 2022, section 3.1), drawn per row.

`objective.denoisers` lists 'mode:mean_span:density:weight' entries. Each
row picks one with probability proportional to its weight, then:

- R (regular) and X (extreme) denoisers are T5 span corruption
  (pretrain_lm.objectives.span_corruption) with that mean span length and
  noise density;
- an S (sequential) denoiser is a prefix LM: the row's n text tokens split
  into inputs (the prefix) and targets (the rest). The target length is
  uniform over {1, ..., m}, m = round(2 * density * n) - 1 clipped to
  [1, n - 1], so the target is on average `density` of the row (density
  must be <= 0.5) and at least one token is always input. `mean_span` is
  not used.

The inputs start with the paradigm token of the mode: [NLU] for R, [S2S]
for S, [NLG] for X, ids tokenizer.vocab_size + num_sentinels + (0, 1, 2),
after the sentinels (num_reserved_ids = num_sentinels + 3).

Two objectives share this file:

- `ul2` (this module), encoder-decoder: the encoder reads
  [mode] inputs [SEP] (data.seq_len, padded), the decoder predicts
  targets [SEP]. Rows hold the largest number of raw tokens R for which
  every denoiser's inputs fit data.seq_len (the S denoiser, whose inputs
  can be all but one token, sets R = data.seq_len - 1); the decoder length
  is the longest target any denoiser gives on R tokens.
- `ul2_decoder` (DECODER), decoder-only, UL2's causal variant with a
  bidirectional prefix: one sequence [mode] inputs [SEP] targets [SEP],
  data.seq_len long, with `prefix_mask` 1 on [mode] inputs [SEP]; each
  token predicts the next, weighted only where the next is a target.
  Rows hold data.seq_len + 1 tokens (as clm's), so that the transform knows
  the sequence length; each denoiser uses the longest start of the row whose
  sequence fits (its own build-time count: all but three tokens for S, about
  three quarters of the row for X with mean span 3 and density 0.5) and
  leaves the rest of the row unused, so that no denoiser wastes compute on
  padding.
"""

import types
from typing import NamedTuple

import ml_collections
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import clm, span_corruption

FAMILIES = ('encoder_decoder',)
MODES = ('R', 'S', 'X')  # paradigm tokens [NLU], [S2S], [NLG], in this order
_FORMAT = (
  "comma-separated 'mode:mean_span:density:weight' entries, mode R, S or X, "
  "e.g. 'R:3:0.15:1,S:0:0.25:1,X:32:0.5:1'"
)


class Denoiser(NamedTuple):
  """One entry of objective.denoisers."""

  mode: str
  mean_span: float
  density: float
  weight: float


def parse_denoisers(spec: str) -> tuple[Denoiser, ...]:
  """Parses objective.denoisers; a ValueError names what is wrong."""

  def bad(why):
    return ValueError(
      f'objective.denoisers={spec!r}: {why}; expected {_FORMAT}.'
    )

  denoisers = []
  for entry in spec.split(','):
    fields = entry.strip().split(':')
    if len(fields) != 4:
      raise bad(f'{entry!r} does not have 4 fields')
    mode = fields[0].strip().upper()
    if mode not in MODES:
      raise bad(f'{entry!r} has mode {fields[0]!r}')
    try:
      mean_span, density, weight = map(float, fields[1:])
    except ValueError:
      raise bad(f'{entry!r} has a field that is not a number') from None
    if not weight > 0:
      raise bad(f'{entry!r} has a weight that is not > 0')
    if mode == 'S' and not 0 < density <= 0.5:
      raise bad(f'{entry!r}: an S density (target fraction) is in (0, 0.5]')
    if mode != 'S' and not (0 < density < 1 and mean_span >= 1):
      raise bad(f'{entry!r}: needs density in (0, 1) and mean_span >= 1')
    denoisers.append(Denoiser(mode, mean_span, density, weight))
  return tuple(denoisers)


def num_reserved_ids(config: ml_collections.ConfigDict) -> int:
  """The sentinels, then the three paradigm tokens."""
  return config.num_sentinels + len(MODES)


def _max_target(n: int, density: float) -> int:
  """m: an S denoiser's target length on n >= 2 tokens is uniform 1..m."""
  return min(max(round(2 * density * n) - 1, 1), n - 1)


def _bodies(denoiser: Denoiser):
  """n -> the longest (inputs, targets, spans) without mode and [SEP]s."""
  if denoiser.mode != 'S':
    return span_corruption.body_lengths(denoiser.density, denoiser.mean_span)

  def bodies(n):
    if n < 2:  # too short to split: all target
      return 0, n, 0
    return n - 1, _max_target(n, denoiser.density), 0

  return bodies


def lengths(seq_len: int, denoisers: str) -> tuple[int, int, int]:
  """Encoder-decoder (raw_length, inputs_length, targets_length).

  raw_length is the largest row length whose [mode] inputs [SEP] fits
  seq_len for every denoiser and every n <= raw_length text tokens;
  inputs_length (= seq_len) and targets_length are the longest such rows
  give.
  """
  parsed = parse_denoisers(denoisers)
  raw = min(
    _largest_fitting(d, lambda inputs, targets: inputs + 2 <= seq_len)
    for d in parsed
  )
  inputs, targets, _ = _limits(raw, parsed)
  return raw, inputs + 2, targets + 1


def _largest_fitting(denoiser: Denoiser, fits) -> int:
  """The most text tokens n such that fits(inputs, targets) up to n."""
  bodies = _bodies(denoiser)
  return span_corruption.largest_fitting(lambda n: fits(*bodies(n)[:2]))


def _limits(raw_length: int, denoisers) -> tuple[int, int, int]:
  """The longest inputs and targets bodies and most spans, any denoiser."""
  limits = [
    span_corruption.length_limits(raw_length, _bodies(d)) for d in denoisers
  ]
  return tuple(map(max, *limits)) if len(limits) > 1 else limits[0]


def row_length(config: ml_collections.ConfigDict) -> int:
  """Encoder-decoder rows: the raw tokens every denoiser's inputs fit."""
  return lengths(config.data.seq_len, config.objective.denoisers)[0]


def _prefix_split(tokens, seed, density):
  """An S denoiser's (inputs, targets): the row cut before its tail."""
  n = tf.size(tokens)
  # float64 and round-half-to-even, as Python's round in _max_target.
  most = tf.cast(tf.round(2 * density * tf.cast(n, tf.float64)), tf.int32) - 1
  most = tf.maximum(tf.minimum(tf.maximum(most, 1), n - 1), 1)
  num_targets = tf.random.stateless_uniform(
    [], seed=seed, minval=1, maxval=most + 1, dtype=tf.int32
  )
  num_targets = tf.where(n < 2, n, num_targets)
  return tokens[: n - num_targets], tokens[n - num_targets :]


def _check_sentinels(denoisers, token_limits, config) -> int:
  """The most spans a row can need; raises if above num_sentinels."""
  max_spans = max(
    span_corruption.length_limits(limit, _bodies(d))[2]
    for d, limit in zip(denoisers, token_limits, strict=True)
  )
  span_corruption.check_sentinels(
    max_spans,
    config.num_sentinels,
    f'objective.denoisers={config.denoisers!r} on up to '
    f'{max(token_limits)} tokens',
  )
  return max_spans


def _mixture(ids, seed, denoisers, token_limits, config, tokenizer):
  """Draws a denoiser and applies it: (mode id, inputs, targets) bodies.

  Denoiser k corrupts the first token_limits[k] text tokens. The span
  denoisers share one graph whose density and mean span are gathered by the
  drawn index, so a row costs one corruption whatever the mixture's size.
  """
  max_spans = _check_sentinels(denoisers, token_limits, config)
  choice_seed, noise_seed = tf.unstack(
    tf.random.experimental.stateless_split(seed, num=2)
  )
  logits = tf.math.log([[d.weight for d in denoisers]])
  choice = tf.random.stateless_categorical(
    logits, 1, seed=choice_seed, dtype=tf.int32
  )[0, 0]
  tokens = span_corruption.text_tokens(ids, tokenizer)
  tokens = tokens[: tf.constant(token_limits)[choice]]
  density = tf.constant([d.density for d in denoisers], tf.float64)[choice]
  mean_span = tf.constant([d.mean_span for d in denoisers], tf.float64)

  def spans():
    return span_corruption.corrupt(
      tokens,
      noise_seed,
      noise_density=density,
      mean_span_length=mean_span[choice],
      max_tokens=max(token_limits),
      max_spans=max(max_spans, 1),
      first_sentinel=tokenizer.vocab_size,
    )

  def prefix():
    return _prefix_split(tokens, noise_seed, density)

  is_prefix = [d.mode == 'S' for d in denoisers]
  if all(is_prefix) or not any(is_prefix):
    inputs, targets = prefix() if all(is_prefix) else spans()
  else:
    inputs, targets = tf.cond(tf.constant(is_prefix)[choice], prefix, spans)
  first_mode = tokenizer.vocab_size + config.num_sentinels
  mode_ids = tf.constant([first_mode + MODES.index(d.mode) for d in denoisers])
  return mode_ids[choice], inputs, targets


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """One row through a randomly drawn denoiser, encoder-decoder features.

  Args:
    row: a packed row, {'input_ids', ...} int32[R], R = row_length.
    seed: int32/int64[2], a stateless seed unique to (epoch, row).
    config: the `objective` section (denoisers, num_sentinels).
    tokenizer: gives the special ids and vocab_size.

  Returns:
    The span_corruption features: encoder_* int32[data.seq_len] with the
    paradigm token first; decoder_*, target_ids int32[T] and
    target_weights float32[T], T the longest target of any denoiser.
  """
  ids = tf.cast(row['input_ids'], tf.int32)
  raw_length = ids.shape[0]
  denoisers = parse_denoisers(config.denoisers)
  inputs_max, targets_max, _ = _limits(raw_length, denoisers)
  mode, inputs, targets = _mixture(
    ids, seed, denoisers, [raw_length] * len(denoisers), config, tokenizer
  )
  eos = [tokenizer.sep_id]
  return span_corruption.seq2seq_features(
    tf.concat([[mode], inputs, eos], axis=0),
    tf.concat([targets, eos], axis=0),
    inputs_max + 2,
    targets_max + 1,
    tokenizer.cls_id,
  )


def check_config(config: ml_collections.ConfigDict) -> None:
  """Fails fast (pretrain_lm.validate) on bad denoisers or sentinels."""
  denoisers = parse_denoisers(config.objective.denoisers)
  raw = row_length(config)
  _check_sentinels(denoisers, [raw] * len(denoisers), config.objective)


def decoder_row_length(config: ml_collections.ConfigDict) -> int:
  """Decoder-only rows: data.seq_len inputs plus the last one's target."""
  return config.data.seq_len + 1


def decoder_check_config(config: ml_collections.ConfigDict) -> None:
  """check_config of the decoder-only variant."""
  denoisers = parse_denoisers(config.objective.denoisers)
  limits = decoder_token_limits(config.data.seq_len, denoisers)
  _check_sentinels(denoisers, limits, config.objective)


def decoder_token_limits(sequence_length: int, denoisers) -> list[int]:
  """Per denoiser, the most text tokens whose sequence fits.

  [mode] inputs [SEP] targets [SEP] must fit sequence_length + 1 tokens
  (the inputs and the last input's target).
  """
  return [
    _largest_fitting(
      d, lambda inputs, targets: inputs + targets + 3 <= sequence_length + 1
    )
    for d in denoisers
  ]


def decoder_transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """One row through a randomly drawn denoiser, as one causal sequence.

  Returns input_ids, segment_ids (1 on the example, 0 on padding),
  positions, prefix_mask (1 on [mode] inputs [SEP]: attended
  bidirectionally), target_ids int32[L] and target_weights float32[L]
  (1 where the next token is a target or the final [SEP]), L = the row
  length - 1 = data.seq_len.
  """
  ids = tf.cast(row['input_ids'], tf.int32)
  total_length = ids.shape[0]
  length = total_length - 1
  denoisers = parse_denoisers(config.denoisers)
  mode, inputs, targets = _mixture(
    ids,
    seed,
    denoisers,
    decoder_token_limits(length, denoisers),
    config,
    tokenizer,
  )
  eos = [tokenizer.sep_id]
  prefix = tf.concat([[mode], inputs, eos], axis=0)
  sequence = tf.concat([prefix, targets, eos], axis=0)
  index = tf.range(total_length)
  is_real = index < tf.size(sequence)
  is_target = tf.logical_and(is_real, index >= tf.size(prefix))
  sequence = span_corruption.pad_to(sequence, total_length)
  return {
    'input_ids': sequence[:-1],
    'segment_ids': tf.cast(is_real[:-1], tf.int32),
    'positions': tf.where(is_real[:-1], index[:-1], 0),
    'prefix_mask': tf.cast(index[:-1] < tf.size(prefix), tf.int32),
    'target_ids': sequence[1:],
    'target_weights': tf.cast(is_target[1:], tf.float32),
  }


loss = clm.loss

# The decoder-only variant, registered as 'ul2_decoder': the same interface
# as an objective module.
DECODER = types.SimpleNamespace(
  FAMILIES=('decoder',),
  transform=decoder_transform,
  loss=clm.loss,
  row_length=decoder_row_length,
  check_config=decoder_check_config,
  num_reserved_ids=num_reserved_ids,
)
