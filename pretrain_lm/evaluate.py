r"""Held-out loss and perplexity of a trained workdir on text.

  python -m pretrain_lm.evaluate --workdir=workdirs/gpt_tiny \
      --data='pretrain_lm/data/corpora/tinyshakespeare/input.txt[90%:]'

--data takes local (or gs://) files, globs and percent slices, the syntax
of config.data.source; the text is split into documents by the workdir's
data.doc_format (or --doc_format) and tokenized with the workdir's
tokenizer. What is scored depends on the model family:

- decoder (GPT; also prefix_lm- and ul2_decoder-trained decoders, scored
  as plain causal LMs): each document is read as the training packing
  writes it (`doc [SEP]` for 'concat', `[CLS] doc [SEP]` otherwise) and
  every token after the first, the closing [SEP] (end of text) included,
  is predicted from the ones before it. A 'concat' document's first token
  is never predicted: with no [CLS] nothing marks a document's start, and
  training never predicts it either. A document longer than the context
  (--seq_len, default data.seq_len) is scored with strided windows, as in
  the Hugging Face perplexity guide: windows of seq_len inputs start every
  --stride tokens (default seq_len // 2) and each predicts only the tokens
  no earlier window did, so every token is predicted exactly once, with
  at least seq_len - stride + 1 tokens of left context (all the tokens
  before it when fewer).
- bilm (ELMo): the forward direction as a decoder, and the backward one
  mirrored (each document token predicted from the tokens after it and
  the closing [SEP]); `loss` is the mean of the two directions' losses,
  with each direction's own numbers under forward_* and backward_*.
- encoder (BERT, RoBERTa, ALBERT), electra (its MLM generator) and plm
  (XLNet): pseudo-log-likelihood (Salazar et al. 2020, "Masked Language
  Model Scoring"): each text token in turn is replaced by [MASK] in
  `[CLS] doc [SEP]` (one row per token) and log p of the true token is
  summed; for plm the token is the only prediction target, so its query
  stream sees every other token and its content stream is seen by none. A
  document longer than seq_len - 2 tokens gives each token the window of
  seq_len - 2 tokens centred on it (cut at the document's ends).
- encoder_decoder (T5, BART): reconstruction. The encoder reads the
  document (as the training packing writes it) and the decoder, fed
  [CLS] doc (teacher forcing; [CLS] is the start token every
  encoder-decoder objective here uses), predicts `doc [SEP]`. Longer
  documents are cut into pieces that fit seq_len, reconstructed one by
  one. T5 and UL2 were pretrained on corrupted inputs (and UL2's with a
  mode token, left out here), so for them this is a proxy.

Reported: `loss`, the mean negative log-likelihood in nats per predicted
token; `perplexity` = exp(loss) (pseudo-perplexity for the masked
families); and `word_perplexity` = exp(total NLL / number of words), words
being the whitespace-separated words of the raw documents. With a
character tokenizer `perplexity` is per character.
"""

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf
from absl import app, flags, logging

from pretrain_lm import pretrained
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import sources

# Families whose loss is a pseudo-log-likelihood over masked tokens.
MASKED_FAMILIES = ('encoder', 'electra', 'plm')
FAMILIES = ('decoder', 'bilm', 'encoder_decoder', *MASKED_FAMILIES)
# How each kind of score is named in the printed table.
KIND_NAMES = {
  'causal': 'perplexity',
  'pseudo': 'pseudo-perplexity',
  'reconstruction': 'reconstruction perplexity',
}


@dataclasses.dataclass
class _Item:
  """One packed segment: its arrays, each a list of its length."""

  arrays: dict[str, list[int]]
  # Positions (within the segment) of its masked-LM predictions.
  predictions: list[int] = dataclasses.field(default_factory=list)


def _pack(
  lengths: Sequence[tuple[int, ...]], widths: tuple[int, ...], max_items: int
) -> list[list[int]]:
  """Next-fit packing: rows of consecutive item indices that fit `widths`.

  Item i takes lengths[i][j] slots of a row's j-th stream (encoder and
  decoder for an encoder-decoder); a row holds at most max_items items.
  """
  rows, row, used = [], [], [0] * len(widths)
  for i, item_lengths in enumerate(lengths):
    fits = len(row) < max_items and all(
      u + n <= w for u, n, w in zip(used, item_lengths, widths, strict=True)
    )
    if row and not fits:
      rows.append(row)
      row, used = [], [0] * len(widths)
    row.append(i)
    used = [u + n for u, n in zip(used, item_lengths, strict=True)]
  if row:
    rows.append(row)
  return rows


def _batches(
  items: Sequence[_Item],
  rows: list[list[int]],
  *,
  streams: dict[str, int],
  num_predictions: int,
  batch_size: int,
):
  """Yields (numpy batch, placements) per batch of `batch_size` rows.

  `streams` maps a feature prefix ('' or 'encoder_', 'decoder_') to its row
  width; each stream gets segment_ids (1, 2, ... per item) and positions.
  A placement (row, offset per stream, prediction slot) locates an item.
  Missing rows of the last batch are all padding (segment 0).
  """
  names = {name for item in items for name in item.arrays}
  for start in range(0, len(rows), batch_size):
    batch = {}
    for name in names:
      width = streams[_prefix(name, streams)]
      batch[name] = np.zeros((batch_size, width), np.int32)
    for prefix, width in streams.items():
      for field in ('segment_ids', 'positions'):
        batch[prefix + field] = np.zeros((batch_size, width), np.int32)
    if num_predictions:
      for field in ('masked_positions', 'masked_ids'):
        batch[field] = np.zeros((batch_size, num_predictions), np.int32)
      batch['masked_weights'] = np.zeros(
        (batch_size, num_predictions), np.float32
      )
    placements = {}
    for b, row in enumerate(rows[start : start + batch_size]):
      offsets = dict.fromkeys(streams, 0)
      slot = 0
      for segment, i in enumerate(row, 1):
        item = items[i]
        here = dict(offsets)
        for name, values in item.arrays.items():
          prefix = _prefix(name, streams)
          o = offsets[prefix]
          batch[name][b, o : o + len(values)] = values
        for prefix in streams:
          n = _stream_length(item, prefix, streams)
          o = offsets[prefix]
          batch[prefix + 'segment_ids'][b, o : o + n] = segment
          batch[prefix + 'positions'][b, o : o + n] = np.arange(n)
          offsets[prefix] = o + n
        for p in item.predictions:
          batch['masked_positions'][b, slot] = here[''] + p
          batch['masked_ids'][b, slot] = item.arrays['target_ids'][p]
          batch['masked_weights'][b, slot] = 1.0
          slot += 1
        placements[i] = (b, here, slot - len(item.predictions))
    yield batch, placements


def _prefix(name: str, streams: dict[str, int]) -> str:
  """The stream a feature belongs to: its longest matching prefix."""
  return max((p for p in streams if name.startswith(p)), key=len)


def _stream_length(item: _Item, prefix: str, streams: dict[str, int]) -> int:
  """The slots an item takes in one stream (its arrays there agree)."""
  for name, values in item.arrays.items():
    if _prefix(name, streams) == prefix:
      return len(values)
  return 0


def _run(
  log_prob_fn: Callable,
  params,
  items: Sequence[_Item],
  *,
  streams: dict[str, int],
  num_predictions: int,
  max_items: int,
  batch_size: int,
):
  """Packs `items`, runs log_prob_fn on every batch; yields per-item output.

  log_prob_fn(params, batch) returns log-probs [B, W] (per target of the
  '' or 'decoder_' stream) or [B, P] (per masked-LM prediction slot).
  Yields (item index, row of that output, placement) in item order.
  """
  lengths = [
    tuple(_stream_length(item, p, streams) for p in streams) for item in items
  ]
  rows = _pack(lengths, tuple(streams.values()), max_items)
  results = []
  for batch, placements in _batches(
    items,
    rows,
    streams=streams,
    num_predictions=num_predictions,
    batch_size=batch_size,
  ):
    # Dispatched now, read after every batch is queued.
    results.append((log_prob_fn(params, batch), placements))
  out = {}
  for log_probs, placements in results:
    log_probs = np.asarray(jax.device_get(log_probs), np.float64)
    for i, placement in placements.items():
      out[i] = (log_probs[placement[0]], placement)
  for i in range(len(items)):
    yield i, *out[i]


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
  items = []
  for context, continuation in zip(context_ids, continuation_ids, strict=True):
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
    items.append(_Item(arrays))
  if not items:
    return []
  width = max(len(item.arrays['input_ids']) for item in items)
  logits_key = 'backward_logits' if backward else 'logits'

  scores = []
  log_prob_fn = functools.partial(
    _causal_log_probs, model, logits_key=logits_key
  )
  for i, log_probs, (_, offsets, _) in _run(
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
      items.append(_Item({'input_ids': masked, 'target_ids': ids}, [p]))
      owners.append(d)
  if not items:
    return [np.zeros(0) for _ in documents]
  width = max(len(item.arrays['input_ids']) for item in items)
  # A copy takes at least 3 slots ([CLS] token [SEP]).
  num_predictions = max(1, width // 3)

  per_doc = [[] for _ in documents]
  log_prob_fn = functools.partial(_masked_log_probs, model, family=family)
  for i, log_probs, (_, _, slot) in _run(
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
      _Item(
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
  for i, log_probs, (_, offsets, _) in _run(
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


def _stats(log_probs: Sequence[Any], num_words: int) -> dict[str, float]:
  """loss, perplexity, word_perplexity and counts of per-doc log-probs."""
  total = -float(sum(lp.sum() for lp in log_probs))
  tokens = int(sum(lp.size for lp in log_probs))
  loss = total / tokens if tokens else float('nan')
  return {
    'loss': loss,
    'perplexity': math.exp(loss) if tokens else float('nan'),
    'word_perplexity': math.exp(total / num_words) if num_words else None,
    'num_tokens': tokens,
    'total_nll': total,
  }


def context_length(loaded: pretrained.Pretrained, seq_len: int = 0) -> int:
  """seq_len, or the run's data.seq_len for 0, checked against the model.

  Args:
    loaded: a `pretrain_lm.load` result.
    seq_len: the context wanted; 0 for the run's data.seq_len.

  Returns:
    The context length; ValueError if it exceeds a learned position table.
  """
  cfg = loaded.model.cfg
  seq_len = seq_len or loaded.config.data.seq_len
  if cfg.position == 'learned' and seq_len > cfg.max_len:
    raise ValueError(
      f'--seq_len={seq_len} exceeds model.max_len={cfg.max_len}, the size '
      'of the learned position table.'
    )
  return seq_len


def start_ids(config: ml_collections.ConfigDict, tokenizer) -> list[int]:
  """What a training row puts before a document: [CLS] unless 'concat'.

  Args:
    config: the run's config (data.packing).
    tokenizer: the run's tokenizer (cls_id).

  Returns:
    [] or [tokenizer.cls_id].
  """
  return [] if config.data.packing == 'concat' else [tokenizer.cls_id]


def _bilm_stats(forward, backward, num_words: int) -> dict[str, Any]:
  """Both directions' numbers, and their mean as loss / perplexity."""
  directions = {
    'forward': _stats(forward, num_words),
    'backward': _stats(backward, num_words),
  }
  result = {}
  for name, stats in directions.items():
    for key in ('loss', 'perplexity', 'word_perplexity'):
      result[f'{name}_{key}'] = stats[key]
  # ELMo's objective: the two directions' mean losses, averaged.
  loss = (result['forward_loss'] + result['backward_loss']) / 2
  total = sum(stats['total_nll'] for stats in directions.values())
  result.update(
    loss=loss,
    perplexity=math.exp(loss),
    word_perplexity=math.exp(total / 2 / num_words) if num_words else None,
    num_tokens=sum(stats['num_tokens'] for stats in directions.values()),
    total_nll=total,
  )
  return result


def evaluate_texts(
  loaded: pretrained.Pretrained,
  texts: Sequence[str],
  *,
  seq_len: int = 0,
  stride: int = 0,
  batch_size: int = 16,
) -> dict[str, Any]:
  """The loss and perplexities of a loaded model on documents `texts`.

  Args:
    loaded: a `pretrain_lm.load` result.
    texts: the documents.
    seq_len: the context / row length (default: the run's data.seq_len).
    stride: decoders' window stride (default seq_len // 2).
    batch_size: rows per model call.

  Returns:
    A JSON-serialisable dict; see the module docstring.

  Example:
    from pretrain_lm import evaluate
    m = pretrain_lm.load('workdirs/gpt_tiny')
    result = evaluate.evaluate_texts(m, ['To be, or not to be.'])
    result['loss'], result['perplexity']
  """
  config, tok = loaded.config, loaded.tokenizer
  model, params = loaded.model, loaded.params
  cfg = model.cfg
  if cfg.family not in FAMILIES:
    raise ValueError(
      f'pretrain_lm.evaluate does not support model.family={cfg.family!r}; '
      f'it scores {list(FAMILIES)}.'
    )
  seq_len = context_length(loaded, seq_len)
  stride = stride or max(1, seq_len // 2)
  docs = [tok.encode(t) for t in texts]
  cls = start_ids(config, tok)
  num_words = sum(len(t.split()) for t in texts)
  result = {
    'family': cfg.family,
    'objective': config.objective.name,
    'num_docs': len(texts),
    'num_words': num_words,
    'seq_len': seq_len,
  }
  if cfg.family in ('decoder', 'bilm'):
    sequences = [cls + d + [tok.sep_id] for d in docs]
    common = dict(window=seq_len, stride=stride, batch_size=batch_size)
    forward = causal_log_likelihoods(model, params, cfg, sequences, **common)
    result.update(kind='causal', stride=stride)
    if cfg.family == 'decoder':
      result.update(_stats(forward, num_words))
    else:
      backward = causal_log_likelihoods(
        model, params, cfg, sequences, backward=True, **common
      )
      result.update(_bilm_stats(forward, backward, num_words))
  elif cfg.family in MASKED_FAMILIES:
    scores = pseudo_log_likelihoods(
      model,
      params,
      cfg.family,
      tok,
      docs,
      max_len=seq_len,
      batch_size=batch_size,
    )
    result.update(kind='pseudo', **_stats(scores, num_words))
  else:
    # Pieces that fit the encoder with the packing's [CLS] and a [SEP].
    room = seq_len - len(cls) - 1
    pairs = []
    for d in docs:
      for start in range(0, len(d), room):
        piece = d[start : start + room]
        pairs.append((cls + piece + [tok.sep_id], piece + [tok.sep_id]))
    scores = reconstruction_log_likelihoods(
      model, params, pairs, start_id=tok.cls_id, batch_size=batch_size
    )
    result.update(kind='reconstruction', **_stats(scores, num_words))
  return result


def read_documents(
  config, data: str, *, doc_format: str = '', max_docs: int = 0
) -> list[str]:
  """The documents of `data` (config.data.source syntax), in file order.

  Args:
    config: the run's config (its data section: doc_format, TFDS dir).
    data: local or gs:// files, globs and percent slices, or 'tfds:...'.
    doc_format: 'line', 'blank_line' or 'file'; '' for the run's.
    max_docs: keep only the first max_docs documents (0: all).

  Returns:
    The documents' texts.

  Example:
    m = pretrain_lm.load('workdirs/quickstart')  # make quickstart
    texts = evaluate.read_documents(
      m.config, 'pretrain_lm/data/corpora/wikitext-2/valid.txt', max_docs=50
    )
  """
  data_config = ml_collections.ConfigDict(config.data.to_dict())
  data_config.eval_source = data
  if doc_format:
    data_config.doc_format = doc_format
  sources.check_source(data, '--data', tfds_data_dir=data_config.tfds_data_dir)
  if data_config.doc_format not in sources.DOC_FORMATS:
    raise ValueError(
      f'--doc_format={data_config.doc_format!r} is not one of '
      f'{sources.DOC_FORMATS}.'
    )
  docs = sources.documents(
    data_config, split='eval', process_index=0, process_count=1
  )
  if max_docs > 0:
    docs = docs.take(max_docs)
  texts = [doc.decode('utf-8') for doc in docs.as_numpy_iterator()]
  if not texts:
    raise ValueError(f'--data={data!r} holds no documents.')
  return texts


def check_workdir(workdir: str) -> None:
  """Raises FileNotFoundError unless `workdir` holds a run's config.json.

  Args:
    workdir: the directory to check.
  """
  if not tf.io.gfile.exists(os.path.join(workdir, 'config.json')):
    raise FileNotFoundError(
      f'--workdir={workdir!r} is not a pretrain_lm workdir (no config.json '
      'in it).'
    )


def evaluate_workdir(
  workdir: str,
  data: str,
  *,
  step: int | None = None,
  max_docs: int = 0,
  batch_size: int = 16,
  seq_len: int = 0,
  stride: int = 0,
  doc_format: str = '',
) -> dict[str, Any]:
  """Loads checkpoint `step` (default latest) and evaluates it on `data`.

  Args:
    workdir: a training workdir.
    data: files, globs and slices, as config.data.source.
    step: the checkpoint step; None for the latest.
    max_docs: score only the first max_docs documents (0: all).
    batch_size: rows per model call.
    seq_len: context / row length (default: the run's data.seq_len).
    stride: decoders' window stride (default seq_len // 2).
    doc_format: 'line', 'blank_line' or 'file' (default: the run's).

  Returns:
    The evaluate_texts dict, with workdir, step and data added.

  Example:
    from pretrain_lm import evaluate
    result = evaluate.evaluate_workdir(
      'workdirs/gpt_tiny',
      'pretrain_lm/data/corpora/tinyshakespeare/input.txt[90%:]',
    )
    print(evaluate.format_table(result))
  """
  check_workdir(workdir)
  config = ml_collections.ConfigDict(
    workdir_lib.read_json(os.path.join(workdir, 'config.json'))
  )
  # Bad data fails before the checkpoint is restored.
  texts = read_documents(config, data, doc_format=doc_format, max_docs=max_docs)
  loaded = pretrained.load(workdir, step=step)
  result = evaluate_texts(
    loaded, texts, seq_len=seq_len, stride=stride, batch_size=batch_size
  )
  return {'workdir': workdir, 'step': loaded.step, 'data': data, **result}


def format_table(result: dict[str, Any]) -> str:
  """An evaluate_workdir result as an aligned two-column table.

  Args:
    result: evaluate_workdir's dict (with workdir, step and data).

  Returns:
    The table's text, headed by the workdir, step, family and data.
  """
  name = KIND_NAMES[result['kind']]
  rows = [
    ('documents', result['num_docs']),
    ('words', result['num_words']),
    ('predicted tokens', result['num_tokens']),
    ('loss (nats / token)', f'{result["loss"]:.4f}'),
    (f'{name} / token', f'{result["perplexity"]:.3f}'),
  ]
  if result['word_perplexity'] is not None:
    rows.append((f'{name} / word', f'{result["word_perplexity"]:.3f}'))
  for direction in ('forward', 'backward'):
    if f'{direction}_loss' in result:
      rows.append(
        (
          f'{direction} {name} / token',
          f'{result[f"{direction}_perplexity"]:.3f}',
        )
      )
  header = (
    f'{result["workdir"]} (step {result["step"]}, {result["family"]}, '
    f'{result["objective"]}) on {result["data"]}'
  )
  width = max(len(k) for k, _ in rows)
  return '\n'.join([header, *(f'  {k:<{width}}  {v}' for k, v in rows)])


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """The command line's flags, defined only when it runs (so that
  importing this module next to another CLI defines no duplicate)."""
  fv = {'flag_values': flag_values}
  flags.DEFINE_string('workdir', None, 'A training workdir.', **fv)
  flags.DEFINE_string(
    'data', None, 'Text files, globs or slices, as config.data.source.', **fv
  )
  flags.DEFINE_integer('step', None, 'Checkpoint step (default latest).', **fv)
  flags.DEFINE_integer(
    'max_docs', 0, 'Score only the first N documents (0: all).', **fv
  )
  flags.DEFINE_integer('batch_size', 16, 'Rows per model call.', **fv)
  flags.DEFINE_integer(
    'seq_len', 0, 'Context / row length (default: the run data.seq_len).', **fv
  )
  flags.DEFINE_integer(
    'stride', 0, 'Decoder window stride (default seq_len // 2).', **fv
  )
  flags.DEFINE_string(
    'doc_format',
    '',
    "'line', 'blank_line' or 'file' (default: the run's).",
    **fv,
  )
  flags.DEFINE_string('output', '', 'Also write the JSON here.', **fv)
  flags.mark_flags_as_required(['workdir', 'data'], **fv)


def run(flag_values: flags.FlagValues) -> dict[str, Any]:
  """The command line on parsed flags: prints the table and a JSON line.

  Args:
    flag_values: flags defined by define_flags and parsed.

  Returns:
    evaluate_workdir's dict (also written to --output if given).
  """
  f = flag_values
  try:
    result = evaluate_workdir(
      f.workdir,
      f.data,
      step=f.step,
      max_docs=f.max_docs,
      batch_size=f.batch_size,
      seq_len=f.seq_len,
      stride=f.stride,
      doc_format=f.doc_format,
    )
  except (ValueError, FileNotFoundError, IsADirectoryError) as e:
    raise SystemExit(f'error: {e}') from None
  print(format_table(result))
  if f.output:
    workdir_lib.write_json(f.output, result)
  print(json.dumps(result, sort_keys=True))
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    # Orbax logs each restore at INFO; the table is the output.
    logging.set_verbosity(logging.WARNING)
  run(flags.FLAGS)


if __name__ == '__main__':
  define_flags()
  app.run(main)
