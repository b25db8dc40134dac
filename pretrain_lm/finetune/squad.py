"""SQuAD v1.1 / v2.0 span extraction: JSON reading, strided windows, scoring.

Rows follow BERT's run_squad: `[CLS] question [SEP] context window [SEP]`
for every model family (position 0, the [CLS], is the no-answer span; a
decoder sees nothing there, so v2.0 no-answer scores need an encoder).
Contexts longer than a row are cut into windows `doc_stride` tokens apart;
a token's prediction is taken from the window where it has the most
context on both sides (`is_max_context`).

Offsets are tokenizer-agnostic: the context is split into words on
whitespace, each word is encoded alone (see `inputs.word_pieces`), so every
token maps back to characters of the original context, and predicted
answers are cut from the context itself, as run_squad rebuilds them from the
original words. Exact match and F1 are the official evaluation scripts'
(evaluate-v1.1.py, evaluate-v2.0.py), in percent as they print them.

Task config fields read here (defaults in brackets): data_dir (holding
{train,dev}-v1.1.json or {train,dev}-v2.0.json), version_2 [False],
max_query_len [64], doc_stride [128], n_best [20], max_answer_len [30],
null_score_diff_threshold [0.0].
"""

import collections
import json
import os
import re
import string
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from absl import logging

from pretrain_lm.finetune import inputs

HEAD = 'span'
METRIC = 'f1'


def head(task_config) -> str:
  del task_config
  return HEAD


def num_labels(task_config) -> int:
  """Two logits per token: answer start and answer end."""
  del task_config
  return 2


def metric_name(task_config) -> str:
  del task_config
  return METRIC


def eval_splits(task_config) -> list[str]:
  del task_config
  return ['dev']


def check_config(task_config) -> None:
  """Raises on window and search settings that cannot work; reads no data."""
  _file(task_config, 'dev')
  positive = ('doc_stride', 'max_query_len', 'n_best', 'max_answer_len')
  for name, default in zip(positive, (128, 64, 20, 30), strict=True):
    value = task_config.get(name, default)
    if value < 1:
      raise ValueError(f'task.{name}={value} must be >= 1.')
  seq_len = task_config.get('seq_len', 0)
  max_query_len = task_config.get('max_query_len', 64)
  if seq_len and seq_len < max_query_len + 4:
    raise ValueError(
      f'task.seq_len={seq_len} leaves no room for the context after '
      f'task.max_query_len={max_query_len} question tokens and 3 special '
      'tokens.'
    )


def _file(task_config, split: str) -> str:
  version = '2.0' if task_config.get('version_2', False) else '1.1'
  if split not in ('train', 'dev'):
    raise ValueError(f"SQuAD has splits 'train' and 'dev', not {split!r}.")
  data_dir = task_config.get('data_dir', '')
  if not data_dir:
    raise ValueError(
      f'Set task.data_dir to the folder of SQuAD {version}: '
      f'train-v{version}.json and dev-v{version}.json.'
    )
  return os.path.join(data_dir, f'{split}-v{version}.json')


def _normalized_space(text: str) -> str:
  return ' '.join(text.split())


def read(task_config, split: str) -> list[dict]:
  """Questions of the SQuAD JSON file of `split`, one example each.

  Args:
    task_config: the task section (data_dir, version_2).
    split: 'train' or 'dev'.

  Returns:
    Examples {'id', 'title', 'question', 'context', 'answers' (a list of
    {'text', 'answer_start'}), 'is_impossible'}. For 'train', as run_squad
    does, a question whose first answer is not the context's text at
    answer_start is dropped (counted in a warning), since its label would
    be wrong.
  """
  path = _file(task_config, split)
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(
      f'{path} not found. task.data_dir must hold SQuAD JSON files named '
      'as the official downloads ({train,dev}-v1.1.json, or -v2.0.json '
      "with task.version_2=True): {'data': [{'title', 'paragraphs': "
      "[{'context', 'qas': [{'id', 'question', 'answers': [{'text', "
      "'answer_start'}], 'is_impossible'}]}]}]}."
    )
  with tf.io.gfile.GFile(path, 'r') as f:
    data = json.load(f)['data']
  examples, dropped = [], 0
  for article in data:
    for paragraph in article['paragraphs']:
      context = paragraph['context']
      for qa in paragraph['qas']:
        answers = [
          {'text': a['text'], 'answer_start': int(a['answer_start'])}
          for a in qa.get('answers', [])
        ]
        impossible = bool(qa.get('is_impossible', False)) or not answers
        if split == 'train' and not impossible:
          first = answers[0]
          start = first['answer_start']
          found = context[start : start + len(first['text'])]
          if _normalized_space(found) != _normalized_space(first['text']):
            dropped += 1
            continue
        examples.append(
          {
            'id': qa['id'],
            'title': article.get('title', ''),
            'question': qa['question'],
            'context': context,
            'answers': answers,
            'is_impossible': impossible,
          }
        )
  if dropped:
    logging.warning(
      '%s: dropped %d questions whose answer is not at its answer_start.',
      path,
      dropped,
    )
  return examples


class _Context(NamedTuple):
  """A context's tokens and each token's [start, end) characters."""

  ids: np.ndarray
  starts: np.ndarray
  ends: np.ndarray


def tokenize_context(tokenizer, context: str, cache: dict) -> _Context:
  """The context's tokens, word by word, with character offsets."""
  ids, starts, ends = [], [], []
  words, word_starts = inputs.split_words(context)
  for i, (word, offset) in enumerate(zip(words, word_starts, strict=True)):
    word_ids, spans = inputs.word_pieces(tokenizer, word, i == 0, cache)
    ids.extend(word_ids)
    starts.extend(offset + s for s, _ in spans)
    ends.extend(offset + e for _, e in spans)
  return _Context(
    np.asarray(ids, np.int32),
    np.asarray(starts, np.int32),
    np.asarray(ends, np.int32),
  )


def answer_tokens(context: _Context, start: int, end: int) -> tuple[int, int]:
  """The first and last token overlapping characters [start, end).

  (-1, -1) if no token does. A token with no characters (a word-start
  marker decoded to nothing) is never an answer's first or last token.
  """
  real = context.ends > context.starts
  first = np.nonzero(real & (context.ends > start))[0]
  last = np.nonzero(real & (context.starts < end))[0]
  if not len(first) or not len(last) or last[-1] < first[0]:
    return -1, -1
  return int(first[0]), int(last[-1])


def windows(num_tokens: int, max_tokens: int, stride: int) -> list[range]:
  """run_squad's doc spans: windows of max_tokens, `stride` apart."""
  spans, start = [], 0
  while True:
    length = min(num_tokens - start, max_tokens)
    spans.append(range(start, start + length))
    if start + length >= num_tokens:
      return spans
    start += min(length, stride)


def max_context_windows(spans: list[range], num_tokens: int) -> np.ndarray:
  """int [num_tokens]: the window that gives each token the most context.

  run_squad's _check_is_max_context for all tokens at once: a window's
  score for a token in it is the smaller of its left and right context
  plus 0.01 * the window's length; the first best window wins.
  """
  positions = np.arange(num_tokens)
  scores = np.full((len(spans), num_tokens), -np.inf)
  for i, span in enumerate(spans):
    inside = positions[span.start : span.stop]
    context = np.minimum(inside - span.start, span.stop - 1 - inside)
    scores[i, span.start : span.stop] = context + 0.01 * len(span)
  return scores.argmax(0)


def featurize(
  examples: list[dict], tokenizer, task_config, *, seq_len: int, family: str
) -> dict[str, np.ndarray]:
  """Rows of every example's windows, with start/end labels and offsets.

  Besides the model inputs, 'start_position'/'end_position' (the first
  answer's tokens where the window holds all of it, else 0 = [CLS]), rows
  carry 'token_char_start'/'token_char_end' int32 [N, L] (each context
  token's characters in the example's context; -1 elsewhere) and
  'token_is_max_context' int32 [N, L], which `predict` needs.
  """
  del family  # One layout for all: position 0 is the no-answer span.
  max_query_len = task_config.get('max_query_len', 64)
  stride = task_config.get('doc_stride', 128)
  keys = (
    'ids',
    'types',
    'example_index',
    'start_position',
    'end_position',
    'token_char_start',
    'token_char_end',
    'token_is_max_context',
  )
  rows = {key: [] for key in keys}
  word_cache, context_cache = {}, {}
  for index, example in enumerate(examples):
    query = tokenizer.encode(example['question'])[:max_query_len]
    context = example['context']
    if context not in context_cache:
      context_cache[context] = tokenize_context(tokenizer, context, word_cache)
    doc = context_cache[context]
    prefix = [tokenizer.cls_id, *query, tokenizer.sep_id]
    max_doc = seq_len - len(prefix) - 1
    if max_doc < 1:
      raise ValueError(
        f'seq_len={seq_len} leaves no room for the context after a '
        f'{len(query)}-token question; raise seq_len or lower '
        'task.max_query_len.'
      )
    first, last = -1, -1
    if not example['is_impossible']:
      answer = example['answers'][0]
      begin = answer['answer_start']
      first, last = answer_tokens(doc, begin, begin + len(answer['text']))
    spans = windows(len(doc.ids), max_doc, stride)
    best_window = max_context_windows(spans, len(doc.ids))
    # Rows are numpy arrays: SQuAD's train split has ~10^5 of them.
    prefix = np.asarray(prefix, np.int32)
    before = np.full(len(prefix), -1, np.int32)
    for w, span in enumerate(spans):
      piece = slice(span.start, span.stop)
      ids = np.concatenate([prefix, doc.ids[piece], [tokenizer.sep_id]])
      rows['ids'].append(ids)
      rows['types'].append(np.arange(len(ids)) >= len(prefix))
      rows['example_index'].append(index)
      offset = len(prefix) - span.start
      inside = first >= 0 and first in span and last in span
      rows['start_position'].append(first + offset if inside else 0)
      rows['end_position'].append(last + offset if inside else 0)
      rows['token_char_start'].append(
        np.concatenate([before, doc.starts[piece]])
      )
      rows['token_char_end'].append(np.concatenate([before, doc.ends[piece]]))
      rows['token_is_max_context'].append(
        np.concatenate([before + 1, best_window[piece] == w])
      )
  out = inputs.model_rows(
    tokenizer, rows['ids'], rows['types'], seq_len=seq_len
  )
  for key in ('example_index', 'start_position', 'end_position'):
    out[key] = np.asarray(rows[key], np.int32).reshape(-1)
  for key in ('token_char_start', 'token_char_end'):
    out[key] = inputs.pad(rows[key], seq_len, -1)
  out['token_is_max_context'] = inputs.pad(
    rows['token_is_max_context'], seq_len, 0
  )
  return out


def _top(logits: np.ndarray, n: int) -> np.ndarray:
  """Indices of the n largest logits, largest first (ties: lower index)."""
  return np.argsort(-logits, kind='stable')[:n]


def predict(
  examples: list[dict],
  features: dict[str, np.ndarray],
  predictions: dict[str, np.ndarray],
  task_config,
) -> dict[str, str]:
  """Question id -> answer text ('' for no answer), run_squad's search.

  For each example, over all its windows: the n_best start and end logits
  of each window give candidate spans; a span is kept if both ends lie in
  the context, its start token is in its max-context window, it ends at or
  after it starts and has at most max_answer_len tokens. The best by
  start + end logit wins. With version_2, the question gets '' when the
  smallest no-answer score (start + end logit of [CLS]) over its windows
  beats the best span by more than null_score_diff_threshold.
  """
  n_best = task_config.get('n_best', 20)
  max_answer_len = task_config.get('max_answer_len', 30)
  version_2 = task_config.get('version_2', False)
  threshold = task_config.get('null_score_diff_threshold', 0.0)
  start_logits = np.asarray(predictions['start_logits'], np.float64)
  end_logits = np.asarray(predictions['end_logits'], np.float64)
  char_start = features['token_char_start']
  char_end = features['token_char_end']
  max_context = features['token_is_max_context'].astype(bool)
  rows_of = collections.defaultdict(list)
  for row, index in enumerate(features['example_index']):
    rows_of[int(index)].append(row)
  answers = {}
  for index, example in enumerate(examples):
    best_score, best_text = -np.inf, ''
    null_score = np.inf
    for row in rows_of[index]:
      null_score = min(null_score, start_logits[row, 0] + end_logits[row, 0])
      starts = _top(start_logits[row], n_best)
      ends = _top(end_logits[row], n_best)
      in_context = char_start[row] >= 0
      ok = (in_context[starts] & max_context[row, starts])[:, None]
      ok = ok & in_context[ends][None, :]
      length = ends[None, :] - starts[:, None] + 1
      ok &= (length >= 1) & (length <= max_answer_len)
      scores = start_logits[row, starts][:, None] + end_logits[row, ends]
      scores = np.where(ok, scores, -np.inf)
      # Best first, as run_squad sorts its candidates; a span whose text is
      # empty (only word-start markers) cannot be an answer.
      for flat in np.argsort(-scores, axis=None, kind='stable'):
        i, j = np.unravel_index(flat, scores.shape)
        if scores[i, j] <= best_score:
          break
        begin, end = char_start[row, starts[i]], char_end[row, ends[j]]
        text = example['context'][begin:end]
        if text.strip():
          best_score, best_text = scores[i, j], text
          break
    if version_2 and null_score - best_score > threshold:
      best_text = ''
    answers[example['id']] = best_text
  return answers


# The official evaluation scripts' functions, kept as they define them.
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r'\b(a|an|the)\b')


def normalize_answer(s: str) -> str:
  """Lower case, drop punctuation and articles, collapse whitespace."""
  s = ''.join(ch for ch in s.lower() if ch not in _PUNCTUATION)
  return ' '.join(_ARTICLES.sub(' ', s).split())


def exact_match_score(prediction: str, ground_truth: str) -> bool:
  return normalize_answer(prediction) == normalize_answer(ground_truth)


def f1_score(
  prediction: str, ground_truth: str, *, version_2: bool = False
) -> float:
  """Bag-of-words F1 of the normalized answers.

  v2.0's script scores an empty answer against an empty gold as 1 (a
  correct no-answer); v1.1's gives 0 whenever no word is shared.
  """
  prediction_tokens = normalize_answer(prediction).split()
  ground_truth_tokens = normalize_answer(ground_truth).split()
  if version_2 and (not prediction_tokens or not ground_truth_tokens):
    return float(prediction_tokens == ground_truth_tokens)
  common = collections.Counter(prediction_tokens) & collections.Counter(
    ground_truth_tokens
  )
  num_same = sum(common.values())
  if num_same == 0:
    return 0.0
  precision = num_same / len(prediction_tokens)
  recall = num_same / len(ground_truth_tokens)
  return 2 * precision * recall / (precision + recall)


def score(
  examples: list[dict], answers: dict[str, str], *, version_2: bool
) -> dict[str, float]:
  """The official script's numbers for `answers` (id -> text), in percent.

  v1.1: 'exact_match' and 'f1', each the best over a question's gold
  answers (a question without an answer counts 0). v2.0: 'exact' and
  'f1' over all questions, where an unanswerable one's gold is '' and
  golds that normalize to nothing are dropped, plus the same over the
  answerable ('HasAns_') and unanswerable ('NoAns_') questions and their
  counts ('_total').
  """
  exact, f1, has_answer = [], [], []
  for example in examples:
    prediction = answers.get(example['id'], '')
    golds = [a['text'] for a in example['answers']]
    if version_2:
      golds = [g for g in golds if normalize_answer(g)] or ['']
    exact.append(max(float(exact_match_score(prediction, g)) for g in golds))
    f1.append(max(f1_score(prediction, g, version_2=version_2) for g in golds))
    has_answer.append(not example['is_impossible'])
  exact, f1 = 100.0 * np.asarray(exact), 100.0 * np.asarray(f1)
  if not version_2:
    return {'exact_match': float(exact.mean()), 'f1': float(f1.mean())}
  has_answer = np.asarray(has_answer, bool)
  result = {
    'exact': float(exact.mean()),
    'f1': float(f1.mean()),
    'total': float(len(examples)),
  }
  for name, subset in (('HasAns', has_answer), ('NoAns', ~has_answer)):
    if subset.any():
      result[f'{name}_exact'] = float(exact[subset].mean())
      result[f'{name}_f1'] = float(f1[subset].mean())
      result[f'{name}_total'] = float(subset.sum())
  return result


def evaluate(
  examples: list[dict],
  features: dict[str, np.ndarray],
  predictions: dict[str, np.ndarray],
  task_config,
) -> dict[str, float]:
  """Exact match and F1 of the n-best answers from start/end logits."""
  answers = predict(examples, features, predictions, task_config)
  return score(examples, answers, version_2=task_config.get('version_2', False))
