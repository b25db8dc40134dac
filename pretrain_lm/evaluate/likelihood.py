"""Log-likelihoods of token sequences, one way per model family.

Causal (decoders, bilm): `score_continuations`, and whole sequences in
strided windows (`causal_log_likelihoods`); masked families:
pseudo-log-likelihoods (`pseudo_log_likelihoods`); encoder-decoders:
teacher-forced reconstruction (`reconstruction_log_likelihoods`).
"""

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pretrain_lm.evaluate.batching import Item, run_packed

# Families whose loss is a pseudo-log-likelihood over masked tokens.
MASKED_FAMILIES = ('encoder', 'electra', 'plm')


def _target_log_probs(logits_BLV, targets_BL, weights_BL):
  """log p(target) per position (float32 softmax), 0 where weight is 0."""
  log_probs = jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(log_probs, targets_BL[..., None], axis=-1)
  # Padding rows attend to nothing and may hold NaN: select, not multiply.
  return jnp.where(weights_BL > 0, picked[..., 0], 0.0)


# Jitted once per model (flax modules hash by their config) and shapes.
@functools.partial(jax.jit, static_argnums=0, static_argnames='logits_key')
def _causal_log_probs(model, params, batch, *, logits_key: str):
  """log p of each next token [B, W] from a causal model's logits_key."""
  inputs = {k: batch[k] for k in ('input_ids', 'segment_ids', 'positions')}
  outputs = model.apply({'params': params}, inputs, deterministic=True)
  return _target_log_probs(
    outputs[logits_key], batch['target_ids'], batch['weights']
  )


@functools.partial(jax.jit, static_argnums=0, static_argnames='family')
def _masked_log_probs(model, params, batch, *, family: str):
  """log p of each masked token [B, P] from a masked-LM head."""
  names = ('input_ids', 'segment_ids', 'positions', 'masked_positions')
  inputs = {k: batch[k] for k in names}
  if family == 'electra':  # the generator's samples need them
    inputs.update(
      masked_ids=batch['masked_ids'], masked_weights=batch['masked_weights']
    )
  if family == 'plm':
    # The masked token is the only target of the order (rank 0), the rest
    # come first (-1): its query stream sees them all, and no token sees it.
    B, P = batch['masked_positions'].shape
    rank_BL = jnp.full(batch['input_ids'].shape, -1, jnp.int32)
    rows_BP = jnp.broadcast_to(jnp.arange(B)[:, None], (B, P))
    slots_BP = jnp.where(
      batch['masked_weights'] > 0, batch['masked_positions'], rank_BL.shape[1]
    )
    inputs['perm_rank'] = rank_BL.at[rows_BP, slots_BP].set(0, mode='drop')
  outputs = model.apply({'params': params}, inputs, deterministic=True)
  return _target_log_probs(
    outputs['mlm_logits'], batch['masked_ids'], batch['masked_weights']
  )


@functools.partial(jax.jit, static_argnums=0)
def _reconstruction_log_probs(model, params, batch):
  """log p of each decoder target [B, T] of an encoder-decoder."""
  inputs = {
    f'{p}{k}': batch[f'{p}{k}']
    for p in ('encoder_', 'decoder_')
    for k in ('input_ids', 'segment_ids', 'positions')
  }
  outputs = model.apply({'params': params}, inputs, deterministic=True)
  return _target_log_probs(
    outputs['logits'], batch['decoder_target_ids'], batch['decoder_weights']
  )


def _continuation_item(
  context: Sequence[int],
  continuation: Sequence[int],
  max_len: int,
  backward: bool,
) -> Item:
  """One (context, continuation) pair as a causal row's segment."""
  context, continuation = list(context), list(continuation)
  if len(continuation) > max_len:
    raise ValueError(
      f'A continuation of {len(continuation)} tokens does not fit '
      f'max_len={max_len} inputs.'
    )
  # Inputs are the sequence but its last token: keep what fits.
  keep = max_len + 1 - len(continuation)
  context = context[max(0, len(context) - keep) :]
  if not context:
    raise ValueError('score_continuations needs at least one context token.')
  sequence = context + continuation
  weights = [0] * (len(context) - 1) + [1] * len(continuation)
  arrays = {
    'input_ids': sequence[:-1],
    'target_ids': sequence[1:],
    'weights': weights,
  }
  if backward:  # the model reverses the row for its backward stack
    arrays = {k: v[::-1] for k, v in arrays.items()}
  return Item(arrays)


def score_continuations(
  model,
  params,
  cfg,
  context_ids: Sequence[Sequence[int]],
  continuation_ids: Sequence[Sequence[int]],
  *,
  max_len: int | None = None,
  batch_size: int = 16,
  backward: bool = False,
) -> list[Any]:
  """log p(continuation token | context, earlier continuation tokens).

  Each (context, continuation) pair is one sequence context + continuation
  whose last len(continuation) tokens are predicted by the causal model
  (decoder family, or bilm's forward direction). The context is cut on the
  left so that the model reads at most `max_len` inputs; sequences are
  packed several to a row (segment ids keep them apart) and run in
  batches of `batch_size` rows, one compilation for all.

  Args:
    model: a DecoderModel (or BiLMModel), as `pretrain_lm.load` gives.
    params: its parameters.
    cfg: its ModelConfig (max_len defaults to cfg.max_len).
    context_ids: per pair, the context token ids (at least one token).
    continuation_ids: per pair, the token ids to score.
    max_len: the most inputs a sequence may have (the training context,
      data.seq_len, is the natural choice).
    batch_size: rows per model call.
    backward: score bilm's backward direction: each pair is given in
      reading order of that direction (right to left), its rows are fed
      reversed and `backward_logits` predict.

  Returns:
    Per pair, float64[len(continuation)] log-probabilities (natural log).

  Example:
    m = pretrain_lm.load('workdirs/gpt_tiny')
    tok = m.tokenizer
    lp = evaluate.score_continuations(
      m.model, m.params, m.model.cfg,
      [tok.encode('ROMEO:')], [tok.encode(' Good morrow')],
    )
    lp[0].sum()  # log p(' Good morrow' | 'ROMEO:')
  """
  max_len = max_len or cfg.max_len
  items = [
    _continuation_item(context, continuation, max_len, backward)
    for context, continuation in zip(context_ids, continuation_ids, strict=True)
  ]
  if not items:
    return []
  width = max(len(item.arrays['input_ids']) for item in items)
  logits_key = 'backward_logits' if backward else 'logits'

  scores = []
  log_prob_fn = functools.partial(
    _causal_log_probs, model, logits_key=logits_key
  )
  for i, log_probs, (_, offsets, _) in run_packed(
    log_prob_fn,
    params,
    items,
    streams={'': width},
    num_predictions=0,
    max_items=width,
    batch_size=batch_size,
  ):
    n = len(continuation_ids[i])
    o = offsets['']
    segment = log_probs[o : o + len(items[i].arrays['input_ids'])]
    if backward:
      segment = segment[::-1]
    scores.append(np.asarray(segment[len(segment) - n :]))
  return scores


def strided_windows(n: int, window: int, stride: int) -> list[tuple]:
  """(start, split, end) per window of a causal sequence of n tokens.

  Window k reads tokens [start, end - 1) (at most `window` inputs, start =
  k * stride) and predicts tokens [split, end), those no earlier window
  predicted: every token but the first is predicted once, with
  window - stride + 1 or more tokens of context (all earlier ones when
  fewer).

  Args:
    n: the sequence length.
    window: the most inputs per window.
    stride: the offset between window starts, in [1, window].

  Returns:
    A list of (start, split, end) index triples.

  Example:
    evaluate.strided_windows(10, window=4, stride=2)
    # [(0, 1, 5), (2, 5, 7), (4, 7, 9), (6, 9, 10)]
  """
  if not 1 <= stride <= window:
    raise ValueError(f'stride={stride} must be in [1, window={window}].')
  windows, done, start = [], 1, 0
  while done < n:
    end = min(start + window + 1, n)
    windows.append((start, done, end))
    done, start = end, start + stride
  return windows


def causal_log_likelihoods(
  model,
  params,
  cfg,
  sequences: Sequence[Sequence[int]],
  *,
  window: int,
  stride: int,
  batch_size: int = 16,
  backward: bool = False,
) -> list[Any]:
  """Per sequence, log p of each token after the first (strided windows).

  With `backward` (bilm), each sequence is read right to left: log p of
  each token but the last given the tokens after it, in reversed order.

  Args:
    model: a DecoderModel (or BiLMModel), as `pretrain_lm.load` gives.
    params: its parameters.
    cfg: its ModelConfig.
    sequences: token ids, framed as training rows (e.g. doc [SEP]).
    window: the most inputs per window (the training context).
    stride: the offset between window starts (see strided_windows).
    batch_size: rows per model call.
    backward: score bilm's backward direction.

  Returns:
    Per sequence, float64[len(sequence) - 1] log-probabilities.

  Example:
    m = pretrain_lm.load('workdirs/gpt_tiny')
    ids = m.tokenizer.encode('To be, or not to be') + [m.tokenizer.sep_id]
    lp = evaluate.causal_log_likelihoods(
      m.model, m.params, m.model.cfg, [ids], window=64, stride=32
    )  # gpt_tiny's context is 64 tokens
  """
  contexts, continuations, owners = [], [], []
  for s, sequence in enumerate(sequences):
    sequence = list(sequence)[::-1] if backward else list(sequence)
    for start, split, end in strided_windows(len(sequence), window, stride):
      contexts.append(sequence[start:split])
      continuations.append(sequence[split:end])
      owners.append(s)
  scores = score_continuations(
    model,
    params,
    cfg,
    contexts,
    continuations,
    max_len=window,
    batch_size=batch_size,
    backward=backward,
  )
  per_sequence = [[] for _ in sequences]
  for s, score in zip(owners, scores, strict=True):
    per_sequence[s].append(score)
  return [np.concatenate(p) if p else np.zeros(0) for p in per_sequence]


def pseudo_log_likelihoods(
  model,
  params,
  family: str,
  tokenizer,
  documents: Sequence[Sequence[int]],
  *,
  max_len: int,
  batch_size: int = 16,
) -> list[Any]:
  """Per document, log p of each token with it masked and the rest seen.

  Salazar et al. (2020)'s pseudo-log-likelihood: one `[CLS] doc [SEP]`
  copy per token with that token replaced by [MASK]; rows pack several
  copies (segment ids keep them apart). A document longer than
  max_len - 2 tokens gives each token the window of max_len - 2 tokens
  centred on it.

  Args:
    model: an EncoderModel, ElectraModel (its generator predicts) or
      PlmModel (the token is the only target of its factorisation order).
    params: its parameters.
    family: 'encoder', 'electra' or 'plm'.
    tokenizer: gives the [CLS], [SEP] and [MASK] ids.
    documents: token ids without specials.
    max_len: the longest row (data.seq_len).
    batch_size: rows per model call.

  Returns:
    Per document, float64[len(document)] log-probabilities.

  Example:
    m = pretrain_lm.load('workdirs/quickstart')  # make quickstart
    docs = [m.tokenizer.encode('The capital of France is Paris.')]
    lp = evaluate.pseudo_log_likelihoods(
      m.model, m.params, m.family, m.tokenizer, docs,
      max_len=m.config.data.seq_len,
    )
  """
  if family not in MASKED_FAMILIES:
    raise ValueError(f'family={family!r} is not one of {MASKED_FAMILIES}.')
  room = max_len - 2
  items, owners = [], []
  for d, doc in enumerate(documents):
    doc, n = list(doc), len(doc)
    for t in range(n):
      start = min(max(0, t - room // 2), max(0, n - room))
      piece = doc[start : start + room]
      # numpy, not lists: a long document makes one copy per token.
      ids = np.asarray([tokenizer.cls_id, *piece, tokenizer.sep_id], np.int32)
      p = 1 + t - start
      masked = ids.copy()
      masked[p] = tokenizer.mask_id
      items.append(Item({'input_ids': masked, 'target_ids': ids}, [p]))
      owners.append(d)
  if not items:
    return [np.zeros(0) for _ in documents]
  width = max(len(item.arrays['input_ids']) for item in items)
  # A copy takes at least 3 slots ([CLS] token [SEP]).
  num_predictions = max(1, width // 3)

  per_doc = [[] for _ in documents]
  log_prob_fn = functools.partial(_masked_log_probs, model, family=family)
  for i, log_probs, (_, _, slot) in run_packed(
    log_prob_fn,
    params,
    items,
    streams={'': width},
    num_predictions=num_predictions,
    max_items=num_predictions,
    batch_size=batch_size,
  ):
    per_doc[owners[i]].append(log_probs[slot])
  return [np.asarray(p, np.float64) for p in per_doc]


def reconstruction_log_likelihoods(
  model,
  params,
  pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
  *,
  start_id: int,
  batch_size: int = 16,
) -> list[Any]:
  """Per (encoder ids, target ids) pair, log p of each target token.

  Teacher forcing: the decoder reads start_id then the targets but the
  last, the encoder the encoder ids; pairs are packed several to a row
  (decoder segment k attends to encoder segment k only).

  Args:
    model: an EncoderDecoderModel, as `pretrain_lm.load` gives.
    params: its parameters.
    pairs: (encoder input ids, decoder target ids) per example.
    start_id: the decoder's first input ([CLS] for every objective here).
    batch_size: rows per model call.

  Returns:
    Per pair, float log-probabilities [len(targets)].

  Example:
    m = pretrain_lm.load('workdirs/t5_tiny')  # configs/t5.py:size=tiny
    tok = m.tokenizer
    ids = tok.encode('The capital of France') + [tok.sep_id]
    lp = evaluate.reconstruction_log_likelihoods(
      m.model, m.params, [(ids, ids)], start_id=tok.cls_id
    )
  """
  items = []
  for encoder_ids, targets in pairs:
    targets = list(targets)
    items.append(
      Item(
        {
          'encoder_input_ids': list(encoder_ids),
          'decoder_input_ids': [start_id, *targets[:-1]],
          'decoder_target_ids': targets,
          'decoder_weights': [1] * len(targets),
        }
      )
    )
  if not items:
    return []
  streams = {
    'encoder_': max(len(i.arrays['encoder_input_ids']) for i in items),
    'decoder_': max(len(i.arrays['decoder_input_ids']) for i in items),
  }

  scores = []
  log_prob_fn = functools.partial(_reconstruction_log_probs, model)
  for i, log_probs, (_, offsets, _) in run_packed(
    log_prob_fn,
    params,
    items,
    streams=streams,
    num_predictions=0,
    max_items=min(streams.values()),
    batch_size=batch_size,
  ):
    o, n = offsets['decoder_'], len(pairs[i][1])
    scores.append(log_probs[o : o + n])
  return scores
