"""CoNLL-2003 token classification: reading, first-sub-token labels, conlleval.

The layout is CoNLL-2003's: one token per line with space-separated columns
(token, POS, chunk, NER), a blank line between sentences, and '-DOCSTART-'
lines between documents. Each word is encoded alone (see
`inputs.word_pieces`); its label goes on its first sub-token and the others
get -1, as BERT's NER fine-tuning does. Entity-level precision, recall and F1
follow the `conlleval` Perl script exactly, in percent as it prints them.

Task config fields read here (defaults in brackets): data_dir (holding
train.txt, valid.txt and test.txt, or CoNLL's eng.train, eng.testa and
eng.testb), label_column [-1, the last], labels [CoNLL-2003's 9 NER tags],
tag_scheme ['': as in the files; 'iob2' or 'iob1' converts on reading].
"""

import collections
import dataclasses
import os

import numpy as np
import tensorflow as tf
from absl import logging

from pretrain_lm.finetune import inputs, metrics

HEAD = 'token'
METRIC = 'f1'
# CoNLL-2003's NER tags, in the order of Hugging Face's conll2003 dataset.
NER_LABELS = (
  'O',
  'B-PER',
  'I-PER',
  'B-ORG',
  'I-ORG',
  'B-LOC',
  'I-LOC',
  'B-MISC',
  'I-MISC',
)
FILES = {
  'train': ('train.txt', 'eng.train'),
  'dev': ('valid.txt', 'dev.txt', 'eng.testa'),
  'test': ('test.txt', 'eng.testb'),
}
DOCSTART = '-DOCSTART-'
_NO_DATA_DIR = (
  'Set task.data_dir to the CoNLL-2003 folder (train.txt, valid.txt, '
  'test.txt, or eng.train, eng.testa, eng.testb).'
)
TAG_SCHEMES = ('', 'iob1', 'iob2')


def head(task_config) -> str:
  del task_config
  return HEAD


def labels(task_config) -> tuple[str, ...]:
  """The tag strings in id order."""
  return tuple(task_config.get('labels', None) or NER_LABELS)


def num_labels(task_config) -> int:
  return len(labels(task_config))


def metric_name(task_config) -> str:
  del task_config
  return METRIC


def check_config(task_config) -> None:
  """Raises on a bad tag scheme, label set or data_dir; reads no data."""
  scheme = task_config.get('tag_scheme', '')
  if scheme not in TAG_SCHEMES:
    raise ValueError(f'task.tag_scheme={scheme!r} is not one of {TAG_SCHEMES}.')
  names = labels(task_config)
  if len(set(names)) != len(names):
    raise ValueError(f'task.labels={list(names)} has duplicates.')
  if not task_config.get('data_dir', ''):
    raise ValueError(_NO_DATA_DIR)


def eval_splits(task_config) -> list[str]:
  del task_config
  return ['dev']


def _split_tag(tag: str) -> tuple[str, str]:
  """'B-PER' -> ('B', 'PER'); 'O' -> ('O', ''). Types may hold hyphens."""
  prefix, dash, kind = tag.partition('-')
  return (prefix, kind) if dash else (tag, '')


def iob1_to_iob2(tags: list[str]) -> list[str]:
  """Every chunk starts with B- (CoNLL-2003's files use B- only between two
  adjacent chunks of one type)."""
  out, previous = [], 'O'
  for tag in tags:
    prefix, kind = _split_tag(tag)
    if prefix == 'I' and previous not in (f'B-{kind}', f'I-{kind}'):
      tag = f'B-{kind}'
    out.append(tag)
    previous = tag
  return out


def iob2_to_iob1(tags: list[str]) -> list[str]:
  """B- only where a chunk follows one of the same type."""
  out, previous = [], 'O'
  for tag in tags:
    prefix, kind = _split_tag(tag)
    if prefix == 'B' and previous not in (f'B-{kind}', f'I-{kind}'):
      out.append(f'I-{kind}')
    else:
      out.append(tag)
    previous = tag
  return out


def read_file(path: str, label_column: int = -1) -> list[dict]:
  """Sentences {'tokens', 'labels'} of a CoNLL file, documents in order."""
  sentences, tokens, tags = [], [], []

  def flush():
    if tokens:
      sentences.append({'tokens': list(tokens), 'labels': list(tags)})
      tokens.clear()
      tags.clear()

  with tf.io.gfile.GFile(path, 'r') as f:
    for line_number, line in enumerate(f, 1):
      fields = line.split()
      if not fields or fields[0] == DOCSTART:
        flush()
        continue
      try:
        tag = fields[label_column]
      except IndexError:
        raise ValueError(
          f'{path}:{line_number}: {len(fields)} columns, no '
          f'task.label_column={label_column}: {line.strip()!r}.'
        ) from None
      tokens.append(fields[0])
      tags.append(tag)
  flush()
  return sentences


def _path(task_config, split: str) -> str:
  if split not in FILES:
    raise ValueError(f'CoNLL splits are {list(FILES)}, not {split!r}.')
  data_dir = task_config.get('data_dir', '')
  names = FILES[split]
  if not data_dir:
    raise ValueError(_NO_DATA_DIR)
  for name in names:
    path = os.path.join(data_dir, name)
    if tf.io.gfile.exists(path):
      return path
  raise FileNotFoundError(
    f'No {" or ".join(names)} in {data_dir}: task.data_dir must hold the '
    'CoNLL-2003 layout, one "token POS chunk NER" line per token, blank '
    'lines between sentences.'
  )


def read(task_config, split: str) -> list[dict]:
  """Sentences {'guid', 'tokens', 'labels'} of a split ('train'|'dev'|'test').

  Labels are tag strings, converted to task.tag_scheme; a tag outside
  task.labels raises.
  """
  path = _path(task_config, split)
  scheme = task_config.get('tag_scheme', '')
  if scheme not in TAG_SCHEMES:
    raise ValueError(f'task.tag_scheme={scheme!r} is not one of {TAG_SCHEMES}.')
  sentences = read_file(path, task_config.get('label_column', -1))
  known = set(labels(task_config))
  convert = {'iob1': iob2_to_iob1, 'iob2': iob1_to_iob2}.get(scheme)
  for i, sentence in enumerate(sentences):
    sentence['guid'] = f'{split}-{i}'
    if convert:
      sentence['labels'] = convert(sentence['labels'])
    unknown = set(sentence['labels']) - known
    if unknown:
      raise ValueError(
        f'{path}: sentence {i} ({" ".join(sentence["tokens"][:8])} ...) '
        f'has tags {sorted(unknown)} outside task.labels {sorted(known)}.'
      )
  return sentences


def unlabeled_example(text: str, task_config, index: int) -> dict:
  """An example of unlabelled text (cross-view training): its words split
  at whitespace, each tagged with a placeholder (only its place is read)."""
  tokens = text.split()
  placeholder = labels(task_config)[0]
  return {
    'guid': f'unlabeled-{index}',
    'tokens': tokens,
    'labels': [placeholder] * len(tokens),
  }


def featurize(
  examples: list[dict], tokenizer, task_config, *, seq_len: int, family: str
) -> dict[str, np.ndarray]:
  """One row per sentence, `[CLS] pieces [SEP]` (decoders: no [CLS]).

  'token_labels' holds each word's tag id on its first sub-token (the first
  that is more than a space marker) and -1 elsewhere; 'word_index' int32
  [N, L] names the word there (-1 elsewhere), which `evaluate` needs. Words
  past seq_len are cut off (a warning counts them) and predicted 'O'.
  """
  label_ids = {tag: i for i, tag in enumerate(labels(task_config))}
  cls = [tokenizer.cls_id] if inputs.has_cls(family) else []
  room = seq_len - len(cls) - 1
  if room < 1:
    raise ValueError(f'seq_len={seq_len} leaves no room for a word.')
  ids, token_labels, word_index = [], [], []
  cache, cut = {}, 0
  for example in examples:
    row, row_labels, row_words = list(cls), [-1] * len(cls), [-1] * len(cls)
    for w, (word, tag) in enumerate(
      zip(example['tokens'], example['labels'], strict=True)
    ):
      pieces, spans = inputs.word_pieces(tokenizer, word, w == 0, cache)
      if len(row) - len(cls) + len(pieces) > room:
        cut += len(example['tokens']) - w
        break
      first = next((i for i, (s, e) in enumerate(spans) if e > s), 0)
      row.extend(pieces)
      row_labels.extend(
        label_ids[tag] if i == first else -1 for i in range(len(pieces))
      )
      row_words.extend(w if i == first else -1 for i in range(len(pieces)))
    row.append(tokenizer.sep_id)
    ids.append(row)
    token_labels.append(row_labels + [-1])
    word_index.append(row_words + [-1])
  if cut:
    logging.warning(
      '%d words past seq_len=%d get no label and are predicted O.', cut, seq_len
    )
  rows = inputs.model_rows(
    tokenizer, ids, [[0] * len(r) for r in ids], seq_len=seq_len
  )
  rows['example_index'] = np.arange(len(examples), dtype=np.int32)
  rows['token_labels'] = inputs.pad(token_labels, seq_len, -1)
  rows['word_index'] = inputs.pad(word_index, seq_len, -1)
  return rows


def _end_of_chunk(prev_tag, tag, prev_type, kind) -> bool:
  """conlleval's endOfChunk: a chunk ended between the two tokens."""
  return (
    (prev_tag, tag)
    in {
      ('B', 'B'),
      ('B', 'O'),
      ('I', 'B'),
      ('I', 'O'),
      ('E', 'E'),
      ('E', 'I'),
      ('E', 'O'),
    }
    or (prev_tag not in ('O', '.') and prev_type != kind)
    # conlleval's 1998-12-22 correction: bracket chunks have length 1.
    or prev_tag in (']', '[')
  )


def _start_of_chunk(prev_tag, tag, prev_type, kind) -> bool:
  """conlleval's startOfChunk: a chunk started at the current token."""
  return (
    (prev_tag, tag)
    in {
      ('B', 'B'),
      ('I', 'B'),
      ('O', 'B'),
      ('O', 'I'),
      ('E', 'E'),
      ('E', 'I'),
      ('O', 'E'),
    }
    or (tag not in ('O', '.') and prev_type != kind)
    or tag in ('[', ']')
  )


def conlleval(
  gold: list[list[str]], guessed: list[list[str]]
) -> dict[str, float]:
  """conlleval's counts and scores for tag sequences, one list per sentence.

  A port of the script's main loop: sentences are separated as by its
  boundary lines (outside any chunk), a chunk is correct when gold and
  guess start it at the same token with the same type and end it at the
  same token. Returns 'precision', 'recall', 'f1' and tag 'accuracy' in
  percent, the counts 'found_correct', 'found_guessed', 'correct_chunks',
  and per chunk type '<type>_precision', '<type>_recall', '<type>_f1'.
  """
  return _chunk_scores(_count_chunks(_tag_lines(gold, guessed)))


def _tag_lines(
  gold: list[list[str]], guessed: list[list[str]]
) -> list[tuple[str, str] | None]:
  """The (gold, guessed) tag of each token, and None after every sentence,
  as conlleval reads a blank line."""
  if len(gold) != len(guessed):
    raise ValueError(f'{len(gold)} gold but {len(guessed)} guessed sentences.')
  lines = []
  for i, (gold_tags, guessed_tags) in enumerate(
    zip(gold, guessed, strict=True)
  ):
    if len(gold_tags) != len(guessed_tags):
      raise ValueError(
        f'Sentence {i}: {len(gold_tags)} gold but {len(guessed_tags)} '
        'guessed tags.'
      )
    lines.extend(zip(gold_tags, guessed_tags, strict=True))
    lines.append(None)
  return lines


@dataclasses.dataclass
class _Counts:
  """conlleval's counters: chunks by type, and tokens."""

  correct_chunks: collections.Counter
  found_correct: collections.Counter
  found_guessed: collections.Counter
  correct_tags: int
  tokens: int


def _count_chunks(lines: list[tuple[str, str] | None]) -> _Counts:
  """conlleval's main loop over its lines (None: a boundary, read as O O)."""
  correct_chunks, found_correct, found_guessed = (
    collections.Counter() for _ in range(3)
  )
  correct_tags = tokens = 0
  in_correct = False
  last_correct, last_correct_type = 'O', ''
  last_guessed, last_guessed_type = 'O', ''
  for line in lines:
    boundary = line is None
    correct, correct_type = _split_tag('O' if boundary else line[0])
    guess, guessed_type = _split_tag('O' if boundary else line[1])
    end_correct = _end_of_chunk(
      last_correct, correct, last_correct_type, correct_type
    )
    end_guessed = _end_of_chunk(
      last_guessed, guess, last_guessed_type, guessed_type
    )
    if in_correct:
      if end_correct and end_guessed and last_guessed_type == last_correct_type:
        in_correct = False
        correct_chunks[last_correct_type] += 1
      elif end_correct != end_guessed or guessed_type != correct_type:
        in_correct = False
    start_correct = _start_of_chunk(
      last_correct, correct, last_correct_type, correct_type
    )
    start_guessed = _start_of_chunk(
      last_guessed, guess, last_guessed_type, guessed_type
    )
    if start_correct and start_guessed and guessed_type == correct_type:
      in_correct = True
    if start_correct:
      found_correct[correct_type] += 1
    if start_guessed:
      found_guessed[guessed_type] += 1
    if not boundary:
      correct_tags += correct == guess and guessed_type == correct_type
      tokens += 1
    last_correct, last_correct_type = correct, correct_type
    last_guessed, last_guessed_type = guess, guessed_type
  if in_correct:
    correct_chunks[last_correct_type] += 1
  return _Counts(
    correct_chunks, found_correct, found_guessed, correct_tags, tokens
  )


def _chunk_scores(counts: _Counts) -> dict[str, float]:
  """conlleval's report of its counts: overall, then per chunk type."""

  def scores(tp, guessed_count, gold_count):
    p, r, f = metrics.precision_recall_f1(
      tp, guessed_count - tp, gold_count - tp
    )
    return 100 * p, 100 * r, 100 * f

  correct_chunks = counts.correct_chunks
  found_guessed, found_correct = counts.found_guessed, counts.found_correct
  total = [
    sum(c.values()) for c in (correct_chunks, found_guessed, found_correct)
  ]
  precision, recall, f1 = scores(*total)
  tokens = counts.tokens
  result = {
    'precision': precision,
    'recall': recall,
    'f1': f1,
    'accuracy': 100.0 * counts.correct_tags / tokens if tokens else 0.0,
    'correct_chunks': float(total[0]),
    'found_guessed': float(total[1]),
    'found_correct': float(total[2]),
  }
  for kind in sorted(set(found_correct) | set(found_guessed)):
    p, r, f = scores(
      correct_chunks[kind], found_guessed[kind], found_correct[kind]
    )
    result.update(
      {f'{kind}_precision': p, f'{kind}_recall': r, f'{kind}_f1': f}
    )
  return result


def predicted_tags(
  examples: list[dict],
  features: dict[str, np.ndarray],
  predictions: dict[str, np.ndarray],
  task_config,
) -> list[list[str]]:
  """Each word's arg-max tag at its first sub-token ('O' where cut off)."""
  names = labels(task_config)
  guesses = np.asarray(predictions['token_logits']).argmax(-1)
  tags = [['O'] * len(e['tokens']) for e in examples]
  rows, positions = np.nonzero(features['word_index'] >= 0)
  for row, position in zip(rows, positions, strict=True):
    example = features['example_index'][row]
    word = features['word_index'][row, position]
    tags[example][word] = names[guesses[row, position]]
  return tags


def evaluate(
  examples: list[dict],
  features: dict[str, np.ndarray],
  predictions: dict[str, np.ndarray],
  task_config,
) -> dict[str, float]:
  """conlleval's scores of the arg-max tags from 'token_logits' [N, L, C]."""
  guessed = predicted_tags(examples, features, predictions, task_config)
  return conlleval([e['labels'] for e in examples], guessed)
