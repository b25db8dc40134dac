"""Masked-language modelling (BERT, Devlin et al. 2019), masks drawn per epoch.

Of the tokens that are not [PAD]/[CLS]/[SEP]/[MASK] (the candidates), a
budget of round(mask_rate * n) is predicted (at least one), at most
P = ceil(mask_rate * seq_len) per row. `config.masking` picks them:

- 'token' (BERT): exactly the budget, uniformly at random.
- 'whole_word' (BERT's whole-word-masking release): words in random order,
  each taken whole while it fits in what is left of the budget (a word that
  would overshoot is skipped and the next one tried).
- 'span' (SpanBERT, Joshi et al. 2020): spans of whole words, lengths
  ~ Geometric(span_p) truncated to max_span words and renormalised (mean 3.8
  for the paper's 0.2 and 10), each from a uniformly random free word, until
  the budget is spent.

Of the predicted tokens, mask_token_rate become [MASK], random_token_rate a
uniformly random normal token and the rest stay as they are; decided per
token, except in 'span' masking, where all tokens of a span share the
decision (SpanBERT) and a random replacement draws a token per position.
The model predicts only at the chosen positions (`masked_positions`), so its
output is mlm_logits[B, P, V] rather than [B, L, V].

`config.sentence_task` = 'nsp' (BERT) or 'sop' (ALBERT) adds a sentence-pair
classification: see pretrain_lm/objectives/sentence_pairs.py.
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import sentence_pairs
from pretrain_lm.objectives import xent as xent_lib

FAMILIES = ('encoder',)
MASKINGS = ('token', 'whole_word', 'span')
# A salt that keeps the pair's seed apart from the masking seed.
_PAIR_SALT = 0x5E17


def max_predictions(mask_rate: float, seq_len: int) -> int:
  """P: the number of prediction slots per row."""
  return math.ceil(mask_rate * seq_len)


def row_length(config: ml_collections.ConfigDict) -> int:
  """data.seq_len, less the slot a sentence pair's middle [SEP] takes."""
  if config.objective.sentence_task:
    return config.data.seq_len - 1
  return config.data.seq_len


def needs_partner(config: ml_collections.ConfigDict) -> bool:
  """NSP takes its random second segment from another row."""
  return config.sentence_task == 'nsp'


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field the run config gets wrong."""
  _check(config.objective)
  if config.objective.sentence_task:
    task = config.objective.sentence_task
    if config.data.packing != 'doc_sentences':
      raise ValueError(
        f'objective.sentence_task={task!r} splits one document piece per '
        "row: it needs data.packing='doc_sentences', not "
        f'{config.data.packing!r}.'
      )
    if not config.model.pooler:
      raise ValueError(
        f'objective.sentence_task={task!r} classifies the pooled [CLS]: '
        'set model.pooler=True.'
      )
    if config.data.seq_len < 5:
      raise ValueError(
        f'data.seq_len={config.data.seq_len} leaves no room for '
        f'[CLS] A [SEP] B [SEP] (objective.sentence_task={task!r}).'
      )


def _check(config: ml_collections.ConfigDict) -> None:
  if config.masking not in MASKINGS:
    raise ValueError(
      f'objective.masking={config.masking!r}; valid: {list(MASKINGS)}.'
    )
  if config.sentence_task not in sentence_pairs.TASKS:
    raise ValueError(
      f'objective.sentence_task={config.sentence_task!r}; valid: '
      f'{list(sentence_pairs.TASKS)}.'
    )
  if config.masking == 'span' and not (
    0 < config.span_p <= 1 and config.max_span >= 1
  ):
    raise ValueError(
      f'objective.span_p={config.span_p} must be in (0, 1] and '
      f'objective.max_span={config.max_span} >= 1.'
    )


def word_tables(texts: list[str]) -> dict[str, np.ndarray]:
  """Per-id booleans from piece texts that word boundaries are read from.

  A word is a maximal run of candidate tokens in which no token after the
  first starts with whitespace or follows a token ending with whitespace;
  words never cross a special token. Whitespace-only tokens (the char
  tokenizer's ' ', SentencePiece's lone '▁') join the word they precede, as
  a SentencePiece piece's leading '▁' does, so they are never predicted
  apart from it; only a trailing one before a special token is a word of
  its own. Empty texts ([UNK]) continue the word before them.
  """
  blank = np.array([t != '' and t.isspace() for t in texts])
  return {
    'blank': blank,
    'lead_space': np.array([t[:1].isspace() for t in texts]),
    'trail_space': np.array([t[-1:].isspace() for t in texts]) & ~blank,
  }


def _words(ids, is_candidate, tokenizer):
  """Word index per token (-1 off candidates), and the number of words."""
  tables = word_tables(tokenizer.piece_texts())
  # Ids past the table (none in practice) read its last entry.
  clipped = tf.minimum(ids, len(tables['blank']) - 1)
  lookup = {k: tf.gather(tf.constant(v), clipped) for k, v in tables.items()}
  prev = {k: tf.concat([[False], v[:-1]], 0) for k, v in lookup.items()}
  prev_candidate = tf.concat([[False], is_candidate[:-1]], 0)
  starts = is_candidate & (
    ~prev_candidate
    | (lookup['lead_space'] & ~prev['blank'])
    | prev['trail_space']
  )
  word_id = tf.cumsum(tf.cast(starts, tf.int32)) - 1
  word_id = tf.where(is_candidate, word_id, -1)
  return word_id, tf.reduce_sum(tf.cast(starts, tf.int32))


def _word_lengths(word_id, seq_len):
  """Tokens per word, int32[seq_len] indexed by word (0 past the last)."""
  return tf.math.unsorted_segment_sum(
    tf.cast(word_id >= 0, tf.int32), tf.maximum(word_id, 0), seq_len
  )


def _choose_tokens(is_candidate, budget, seed, num_slots):
  """'token': a uniformly random `budget` candidates, as units 1, 2, ..."""
  seq_len = is_candidate.shape[0]
  # The candidates with the largest random scores (non-candidates score -1
  # and are never reached).
  scores = tf.random.stateless_uniform([seq_len], seed=seed)
  scores = tf.where(is_candidate, scores, -1.0)
  _, top = tf.math.top_k(scores, k=num_slots)
  top = tf.where(tf.range(num_slots) < budget, top, seq_len)
  chosen = tf.scatter_nd(
    top[:, None], tf.ones([num_slots], tf.int32), [seq_len + 1]
  )[:seq_len]
  return tf.where(chosen > 0, tf.range(1, seq_len + 1), 0)


def _choose_whole_words(word_id, num_words, budget, seed):
  """'whole_word': BERT's greedy pass over the words in random order."""
  seq_len = word_id.shape[0]
  is_word = tf.range(seq_len) < num_words
  scores = tf.random.stateless_uniform([seq_len], seed=seed)
  order = tf.argsort(tf.where(is_word, scores, 2.0))
  lengths = tf.gather(_word_lengths(word_id, seq_len), order)

  # Greedy in `order` accepts a word iff it fits in the room left. In rounds:
  # drop the words longer than the room (the room only shrinks, so greedy
  # skips them too), then accept the longest prefix that fits; the word
  # after it overshoots and is dropped next round. Each round accepts a
  # word, and after the first the room is below one word's length, so there
  # are few rounds.
  def cond(undecided, accepted, room):
    del accepted
    return tf.reduce_any(undecided & (lengths <= room))

  def body(undecided, accepted, room):
    undecided &= lengths <= room
    total = tf.cumsum(tf.where(undecided, lengths, 0))
    take = undecided & (total <= room)
    room -= tf.reduce_sum(tf.where(take, lengths, 0))
    return undecided & ~take, accepted | take, room

  _, accepted, _ = tf.while_loop(
    cond,
    body,
    (tf.gather(is_word, order), tf.zeros([seq_len], tf.bool), budget),
  )
  accepted_word = tf.scatter_nd(
    order[:, None], tf.cast(accepted, tf.int32), [seq_len]
  )
  chosen = (word_id >= 0) & (
    tf.gather(accepted_word, tf.maximum(word_id, 0)) > 0
  )
  return tf.where(chosen, word_id + 1, 0)


def span_lengths(seed, num, span_p: float, max_span: int) -> tf.Tensor:
  """int32[num] draws of Geometric(span_p) truncated to 1..max_span.

  Truncated and renormalised (SpanBERT's "clipped"; its mean 3.8 for p=0.2
  and 10 is this distribution's), sampled by inverting its CDF
  P(l <= k) = (1 - q^k) / (1 - q^max_span), q = 1 - span_p.
  """
  if span_p >= 1:
    return tf.ones([num], tf.int32)
  u = tf.random.stateless_uniform([num], seed=seed, dtype=tf.float64)
  q = 1.0 - span_p
  k = tf.math.log1p(-u * (1.0 - q**max_span)) / math.log(q)
  return tf.clip_by_value(tf.cast(tf.floor(k), tf.int32) + 1, 1, max_span)


def _choose_spans(is_candidate, word_id, num_words, budget, seed, config):
  """'span': units 1, 2, ... are spans of whole words (SpanBERT)."""
  seq_len = word_id.shape[0]
  num_slots = max_predictions(config.mask_rate, seq_len)
  length_seed, order_seed = tf.unstack(
    tf.random.experimental.stateless_split(seed, num=2)
  )
  span_len = span_lengths(
    length_seed, num_slots, config.span_p, config.max_span
  )
  word_len = _word_lengths(word_id, seq_len)
  # ends[w]: the tokens in words before w, so words a..b-1 hold
  # ends[b] - ends[a].
  ends = tf.concat([[0], tf.cumsum(word_len)], axis=0)
  index = tf.range(seq_len)
  is_word = index < num_words
  # A span stays inside its run of candidates (one document of a packed
  # row): it ends at the run's last word. Runs are numbered by the special
  # tokens before them; a word's run end is the number of words in its run
  # and the runs before it.
  run = tf.cumsum(tf.cast(~is_candidate, tf.int32))
  word_run = tf.math.unsorted_segment_max(
    run, tf.where(is_candidate, word_id, seq_len), seq_len + 1
  )[:seq_len]
  word_run = tf.where(is_word, word_run, seq_len + 1)
  run_end = tf.searchsorted(word_run[None], word_run[None], side='right')[0]
  # The anchor is uniform over the eligible words: free, and short enough
  # for the room left (SpanBERT redraws an anchor already masked; a word
  # too long is redrawn too, as spans are whole words). The eligible set
  # only shrinks, so the first eligible word of one random order is such a
  # uniform draw at every step. Each span adds a word: at most P spans.
  priority = tf.random.stateless_uniform([seq_len], seed=order_seed)

  def cond(k, room, span_of_word, eligible):
    del room, span_of_word
    return (k < num_slots) & tf.reduce_any(eligible)

  def body(k, room, span_of_word, eligible):
    anchor = tf.argmax(tf.where(eligible, priority, -1.0), output_type=tf.int32)
    # Spans are disjoint: a span stops before a word another one took,
    # and the budget clips it to the words that fit.
    taken_after = (span_of_word > 0) & (index > anchor)
    stop = tf.reduce_min(tf.where(taken_after, index, seq_len))
    fit = tf.searchsorted(ends, [ends[anchor] + room], side='right')[0] - 1
    end = tf.reduce_min(
      tf.stack([anchor + span_len[k], run_end[anchor], stop, fit])
    )
    in_span = (index >= anchor) & (index < end)
    room -= ends[end] - ends[anchor]
    eligible &= ~in_span & (word_len <= room)
    return k + 1, room, tf.where(in_span, k + 1, span_of_word), eligible

  _, _, span_of_word, _ = tf.while_loop(
    cond,
    body,
    (
      0,
      budget,
      tf.zeros([seq_len], tf.int32),
      is_word & (word_len <= budget),
    ),
  )
  return tf.where(
    word_id >= 0, tf.gather(span_of_word, tf.maximum(word_id, 0)), 0
  )


def _budget(is_candidate, mask_rate: float, num_slots: int) -> tf.Tensor:
  """The tokens to predict: round(mask_rate * n) of the n candidates, at
  least one (if any), at most the num_slots prediction slots."""
  num_candidates = tf.reduce_sum(tf.cast(is_candidate, tf.int32))
  # float64 and round-half-to-even, so the count equals Python's
  # round(mask_rate * n) exactly.
  budget = tf.cast(
    tf.round(tf.cast(num_candidates, tf.float64) * mask_rate),
    tf.int32,
  )
  budget = tf.maximum(budget, tf.minimum(num_candidates, 1))
  return tf.minimum(budget, num_slots)


def _replacements(
  originals, positions, units, action_seed, random_seed, *, config, tokenizer
) -> tf.Tensor:
  """The input token of each prediction slot: [MASK], a random normal
  token, or the original (`originals` at `positions`, of `units`)."""
  num_slots = originals.shape[0]
  # 80% [MASK] / 10% random / 10% unchanged (with the default rates), per
  # slot, or per span (draw k for span k) in 'span' masking.
  action = tf.random.stateless_uniform([num_slots], seed=action_seed)
  if config.masking == 'span':
    span = tf.maximum(tf.gather(units, positions) - 1, 0)
    action = tf.gather(action, span)
  random_ids = tf.random.stateless_uniform(
    [num_slots],
    seed=random_seed,
    minval=tokenizer.first_normal_id,
    maxval=tokenizer.vocab_size,
    dtype=tf.int32,
  )
  return tf.where(
    action < config.mask_token_rate,
    tokenizer.mask_id,
    tf.where(
      action < config.mask_token_rate + config.random_token_rate,
      random_ids,
      originals,
    ),
  )


def mask(
  ids: tf.Tensor,
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
  """Chooses and corrupts the predicted tokens of `ids` (int32[L]).

  Returns the features input_ids (corrupted), masked_positions,
  masked_ids and masked_weights, and int32[L] units: 0 on tokens not
  predicted, else the 1-based index of the token's masking unit (the token
  itself, its word, or its span).
  """
  _check(config)
  if tokenizer.mask_id < 0:  # tokenizer_lib.NO_ID: GPT-2's or T5's
    raise ValueError(
      f'Masked-LM needs a mask token, and tokenizer {tokenizer.path!r} has '
      'none; use an objective that does not mask (e.g. clm, '
      'span_corruption).'
    )
  ids = tf.cast(ids, tf.int32)
  seq_len = ids.shape[0]
  num_slots = max_predictions(config.mask_rate, seq_len)
  seeds = tf.random.experimental.stateless_split(seed, num=4)

  special = tf.constant(
    [tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id]
  )
  is_candidate = tf.reduce_all(ids[:, None] != special, axis=1)
  budget = _budget(is_candidate, config.mask_rate, num_slots)

  if config.masking == 'token':
    units = _choose_tokens(is_candidate, budget, seeds[0], num_slots)
  else:
    word_id, num_words = _words(ids, is_candidate, tokenizer)
    if config.masking == 'whole_word':
      units = _choose_whole_words(word_id, num_words, budget, seeds[0])
    else:
      units = _choose_spans(
        is_candidate, word_id, num_words, budget, seeds[0], config
      )

  # At most `budget` <= P tokens are chosen; sorting puts them first, in
  # order, and the padding slots (seq_len) after.
  positions = tf.sort(tf.where(units > 0, tf.range(seq_len), seq_len))
  positions = positions[:num_slots]
  is_real = positions < seq_len
  positions = tf.where(is_real, positions, 0)
  originals = tf.gather(ids, positions)

  replaced = _replacements(
    originals,
    positions,
    units,
    seeds[1],
    seeds[2],
    config=config,
    tokenizer=tokenizer,
  )
  # Padding slots scatter into an extra, dropped position, so they can never
  # overwrite a real one.
  targets = tf.where(is_real, positions, seq_len)[:, None]
  padded_ids = tf.concat([ids, [0]], axis=0)
  masked_input = tf.tensor_scatter_nd_update(padded_ids, targets, replaced)
  features = {
    'input_ids': tf.ensure_shape(masked_input[:seq_len], [seq_len]),
    'masked_positions': positions,
    'masked_ids': tf.where(is_real, originals, 0),
    'masked_weights': tf.cast(is_real, tf.float32),
  }
  return features, units


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  partner: dict[str, tf.Tensor] | None = None,
) -> dict[str, tf.Tensor]:
  """Masks one packed row; all randomness comes from the stateless `seed`.

  Args:
    row: a packed row, {'input_ids', 'segment_ids', 'positions'} int32[R].
    seed: int32/int64[2], a stateless seed unique to (epoch, row).
    config: the `objective` config section.
    tokenizer: gives the special ids, first_normal_id and vocab_size, and
      piece_texts() for 'whole_word' and 'span' masking.
    partner: with sentence_task 'nsp', another packed row (its NotNext
      second segments come from it).

  Returns:
    input_ids int32[L] (masked); segment_ids and positions int32[L] (the
    row's packed documents, for attention and position embeddings);
    token_type_ids int32[L] (BERT's sentence A/B ids); input_mask int32[L];
    masked_positions int32[P] (ascending, 0-padded), masked_ids int32[P]
    (the original tokens), masked_weights float32[P] (1 real, 0 padding).
    Without a sentence task L = R and the segments, positions and (all 0)
    token types are the row's; with one, L = R + 1 and the features are
    sentence_pairs.make_pair's, with sentence_labels int32[] and
    sentence_weights float32[] added.
  """
  _check(config)
  if config.sentence_task:
    features = sentence_pairs.make_pair(
      row,
      tf.random.experimental.stateless_fold_in(seed, _PAIR_SALT),
      task=config.sentence_task,
      tokenizer=tokenizer,
      partner=partner,
    )
  else:
    seq_len = row['input_ids'].shape[0]
    features = {
      key: tf.ensure_shape(tf.cast(row[key], tf.int32), [seq_len])
      for key in ('input_ids', 'segment_ids', 'positions')
    }
    features['token_type_ids'] = tf.zeros([seq_len], tf.int32)
  ids = features['input_ids']
  masked, _ = mask(ids, seed, config=config, tokenizer=tokenizer)
  return {
    **features,
    **masked,
    'input_mask': tf.cast(ids != tokenizer.pad_id, tf.int32),
  }


def loss(
  outputs: dict[str, jax.Array], batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean cross-entropy over the masked positions, and metrics.

  With `sentence_logits` in the outputs (NSP or SOP), the loss is BERT's
  sum of the two means: MLM's over the predicted tokens and the sentence
  task's over the examples with sentence_weights 1.

  Args:
    outputs: {'mlm_logits': float[B, P, V]}, logits at `masked_positions`,
      and optionally 'sentence_logits' float[B, 2].
    batch: the transform's features, batched.

  Returns:
    The scalar loss and {'loss', 'mlm_accuracy', 'num_predictions'}, plus
    'mlm_loss', 'sentence_loss' and 'sentence_accuracy' with a sentence
    task.
  """
  labels = batch['masked_ids']
  weights = batch['masked_weights'].astype(jnp.float32)
  xent, correct = xent_lib.token_xent(outputs['mlm_logits'], labels)
  num_predictions = jnp.sum(weights)
  # A batch with nothing to predict gives 0, not NaN.
  denominator = jnp.maximum(num_predictions, 1e-8)
  mean_loss = jnp.sum(xent * weights) / denominator
  accuracy = jnp.sum(correct * weights) / denominator
  metrics = {
    'loss': mean_loss,
    'mlm_accuracy': accuracy,
    'num_predictions': num_predictions,
  }
  if 'sentence_logits' not in outputs:
    return mean_loss, metrics

  pair_logits = outputs['sentence_logits'].astype(jnp.float32)
  pair_labels = batch['sentence_labels']
  pair_weights = batch['sentence_weights'].astype(jnp.float32)
  pair_xent = optax.softmax_cross_entropy_with_integer_labels(
    pair_logits, pair_labels
  )
  # Unsplittable pieces (weight 0) do not count.
  pair_denominator = jnp.maximum(jnp.sum(pair_weights), 1e-8)
  sentence_loss = jnp.sum(pair_xent * pair_weights) / pair_denominator
  pair_correct = jnp.argmax(pair_logits, axis=-1) == pair_labels
  total = mean_loss + sentence_loss
  metrics.update(
    loss=total,
    mlm_loss=mean_loss,
    sentence_loss=sentence_loss,
    sentence_accuracy=jnp.sum(pair_correct * pair_weights) / pair_denominator,
  )
  return total, metrics
