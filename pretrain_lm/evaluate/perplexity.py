"""Loss and perplexities of a loaded model on documents (`evaluate_texts`).

What is scored depends on the model family:

- decoder (GPT; also prefix_lm- and ul2_decoder-trained decoders, scored
  as plain causal LMs): each document is read as the training packing
  writes it (`doc [SEP]` for 'concat', `[CLS] doc [SEP]` otherwise) and
  every token after the first, the closing [SEP] (end of text) included,
  is predicted from the ones before it. A 'concat' document's first token
  is never predicted: with no [CLS] nothing marks a document's start, and
  training never predicts it either. A document longer than the context
  (`seq_len`, default data.seq_len) is scored with strided windows, as in
  the Hugging Face perplexity guide: windows of seq_len inputs start every
  `stride` tokens (default seq_len // 2) and each predicts only the tokens
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

import math
from collections.abc import Sequence
from typing import Any

import ml_collections

from pretrain_lm import pretrained
from pretrain_lm.evaluate import likelihood
from pretrain_lm.evaluate.likelihood import MASKED_FAMILIES

FAMILIES = ('decoder', 'bilm', 'encoder_decoder', *MASKED_FAMILIES)


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


def _reconstruction_pairs(
  docs: Sequence[list[int]], cls: list[int], sep_id: int, seq_len: int
) -> list[tuple[list[int], list[int]]]:
  """(encoder ids, targets) per piece of each document that fits seq_len.

  Each piece fits the encoder with the packing's [CLS] (`cls`) and a [SEP].
  """
  room = seq_len - len(cls) - 1
  pairs = []
  for d in docs:
    for start in range(0, len(d), room):
      piece = d[start : start + room]
      pairs.append((cls + piece + [sep_id], piece + [sep_id]))
  return pairs


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
    forward = likelihood.causal_log_likelihoods(
      model, params, cfg, sequences, **common
    )
    result.update(kind='causal', stride=stride)
    if cfg.family == 'decoder':
      result.update(_stats(forward, num_words))
    else:
      backward = likelihood.causal_log_likelihoods(
        model, params, cfg, sequences, backward=True, **common
      )
      result.update(_bilm_stats(forward, backward, num_words))
  elif cfg.family in MASKED_FAMILIES:
    scores = likelihood.pseudo_log_likelihoods(
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
    pairs = _reconstruction_pairs(docs, cls, tok.sep_id, seq_len)
    scores = likelihood.reconstruction_log_likelihoods(
      model, params, pairs, start_id=tok.cls_id, batch_size=batch_size
    )
    result.update(kind='reconstruction', **_stats(scores, num_words))
  return result
