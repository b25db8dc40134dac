"""Task rows: examples from a task module, turned into model features.

A task module (pretrain_lm/finetune/glue.py shows the interface) reads its
examples and featurizes them; two heads need rows of their own, made here
from the same examples: T5's text-to-text input, and Sentence-BERT's pair
of single-sentence rows.
"""

import dataclasses

import ml_collections
import numpy as np

from pretrain_lm import configlib
from pretrain_lm.data import sources
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.finetune import TASKS, inputs
from pretrain_lm.finetune import model as model_lib

# Row features the model reads (b_*: a siamese head's second sentence;
# decoder_input_ids: a generative encoder-decoder row's target).
INPUT_KEYS = (
  'input_ids',
  'input_mask',
  'token_type_ids',
  'decoder_input_ids',
  'b_input_ids',
  'b_input_mask',
  'b_token_type_ids',
)


def task_head(task, task_config) -> str:
  """The head a task needs ('regression' for STS-B)."""
  return task.head(task_config) if hasattr(task, 'head') else task.HEAD


def task_metric(task, task_config) -> str:
  """The dev metric that picks the best checkpoint."""
  if hasattr(task, 'metric_name'):
    return task.metric_name(task_config)
  return task.METRIC


def task_eval_splits(task, task_config) -> list[str]:
  """'dev', and any further labelled held-out split (MNLI mismatched)."""
  if hasattr(task, 'eval_splits'):
    return list(task.eval_splits(task_config))
  return ['dev']


@dataclasses.dataclass
class Split:
  """A split's examples and their model rows (several per example: SQuAD)."""

  examples: list[dict]
  features: dict[str, np.ndarray]

  @property
  def num_rows(self) -> int:
    return len(self.features['input_ids'])


def label_sequences(
  task, task_config: ml_collections.ConfigDict, tokenizer
) -> tuple[tuple[int, ...], ...]:
  """T5's decoder sequence of each class: [CLS] label word [SEP].

  [CLS] starts the decoder and [SEP] ends a target in T5's pretraining here
  (objectives/span_corruption.py); the words are the task's text-to-text
  targets (glue.text_to_text: 'negative' / 'positive' for SST-2).
  """
  if not hasattr(task, 'text_to_text'):
    raise ValueError(
      f'head.text_to_text: task {task_config.name} has no text-to-text form.'
    )
  if task_head(task, task_config) != 'classification':
    raise ValueError(
      'head.text_to_text scores each label word, so it needs a '
      f'classification task, not {task_head(task, task_config)}.'
    )
  stub = {'text_a': '', 'text_b': '', 'label': None}
  words = [
    task.text_to_text(dict(stub, label=i), task_config)[1]
    for i in range(task.num_labels(task_config))
  ]
  return tuple(
    (tokenizer.cls_id, *tokenizer.encode(w), tokenizer.sep_id) for w in words
  )


def featurize(
  config: ml_collections.ConfigDict,
  examples: list[dict],
  tokenizer: tokenizer_lib.Tokenizer,
  family: str,
) -> dict[str, np.ndarray]:
  """The model rows of examples: the task's own, or T5's text-to-text.

  Text-to-text rows hold the task's prefixed text ('sst2 sentence: ...')
  and [SEP], T5's end of input here; the label stays the class id, scored
  against every label word.
  """
  tc = config.task
  task = TASKS[tc.name]
  if config.head.siamese:
    return siamese_rows(config, examples, tokenizer, family)
  if not config.head.text_to_text:
    features = task.featurize(
      examples,
      tokenizer,
      tc,
      seq_len=tc.seq_len,
      family=model_lib.backbone_family(family),
    )
    return {k: np.asarray(v) for k, v in features.items()}
  ids = [
    tokenizer.encode(task.text_to_text(e, tc)[0])[: tc.seq_len - 1]
    + [tokenizer.sep_id]
    for e in examples
  ]
  features = inputs.model_rows(
    tokenizer, ids, [[0] * len(row) for row in ids], seq_len=tc.seq_len
  )
  features['example_index'] = np.arange(len(examples), dtype=np.int32)
  labels = [-1 if e['label'] is None else e['label'] for e in examples]
  features['label'] = np.asarray(labels, np.int32)
  return features


def siamese_rows(
  config: ml_collections.ConfigDict,
  examples: list[dict],
  tokenizer: tokenizer_lib.Tokenizer,
  family: str,
) -> dict[str, np.ndarray]:
  """A sentence pair as two rows, A in input_ids and B in b_input_ids.

  Each is laid out as the task lays out a single sentence ([CLS] A [SEP]
  for encoders). Regression labels are divided by head.similarity_scale,
  the score a cosine of 1 stands for.
  """
  tc = config.task
  if any(e.get('text_b') is None for e in examples):
    raise ValueError(
      f'head.siamese needs sentence pairs; task {tc.name} '
      f'({tc.get("glue_task", "")}) has single sentences.'
    )
  family = model_lib.backbone_family(family)
  features = {}
  for prefix, field in (('', 'text_a'), ('b_', 'text_b')):
    rows = [
      inputs.pair_row(
        tokenizer,
        tokenizer.encode(e[field]),
        None,
        seq_len=tc.seq_len,
        family=family,
      )
      for e in examples
    ]
    side = inputs.model_rows(
      tokenizer, [r[0] for r in rows], [r[1] for r in rows], seq_len=tc.seq_len
    )
    features.update({prefix + k: v for k, v in side.items()})
  features['example_index'] = np.arange(len(examples), dtype=np.int32)
  task = TASKS[tc.name]
  if task_head(task, tc) == 'regression':
    labels = [np.nan if e['label'] is None else e['label'] for e in examples]
    scale = config.head.similarity_scale
    features['label'] = np.asarray(labels, np.float32) / scale
  else:
    labels = [-1 if e['label'] is None else e['label'] for e in examples]
    features['label'] = np.asarray(labels, np.int32)
  return features


def read_split(
  config: ml_collections.ConfigDict,
  split: str,
  tokenizer: tokenizer_lib.Tokenizer,
  family: str,
  limit: int = 0,
) -> Split:
  """Reads and featurizes a split; `limit` keeps its first examples."""
  tc = config.task
  examples = TASKS[tc.name].read(tc, split)
  if limit:
    examples = examples[:limit]
  if not examples:
    raise ValueError(f'task {tc.name}: split {split!r} is empty.')
  return Split(examples, featurize(config, examples, tokenizer, family))


def unlabeled_examples(config: ml_collections.ConfigDict) -> list[dict]:
  """Cross-view training's unlabelled examples (cvt.unlabeled).

  'train': the task's training examples after its first
  task.max_train_examples (the labelled ones). Else the documents of a
  data.source string, each made an example by the task's
  `unlabeled_example`. At most cvt.max_unlabeled_examples, in order.
  """
  cvt, tc = config.cvt, config.task
  task = TASKS[tc.name]
  limit = cvt.max_unlabeled_examples or None
  if cvt.unlabeled == 'train':
    examples = task.read(tc, 'train')[tc.max_train_examples :][:limit]
    if not examples:
      raise ValueError(
        f"cvt.unlabeled='train': task {tc.name}'s training split has no "
        f'examples after the first task.max_train_examples='
        f'{tc.max_train_examples}.'
      )
    return examples
  if not hasattr(task, 'unlabeled_example'):
    raise ValueError(
      f'cvt.unlabeled={cvt.unlabeled!r}: task {tc.name} cannot make '
      "examples of plain text; use cvt.unlabeled='train'."
    )
  data = configlib.base_config().data
  # Every document is read; none is held out for evaluation.
  data.source = data.eval_source = cvt.unlabeled
  data.doc_format = cvt.doc_format
  docs = sources.documents(
    data, split='train', process_index=0, process_count=1
  )
  if limit:
    docs = docs.take(limit)
  examples = [
    task.unlabeled_example(doc.decode('utf-8'), tc, i)
    for i, doc in enumerate(docs.as_numpy_iterator())
  ]
  if not examples:
    raise ValueError(f'cvt.unlabeled={cvt.unlabeled!r} holds no documents.')
  return examples


def unlabeled_split(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  family: str,
  head: str,
) -> Split:
  """The unlabelled examples as model rows whose only target is
  `cvt_weight`: 1 per row for a sentence-level head, 1 on each word's first
  sub-token for a token head (where a tag would be read)."""
  examples = unlabeled_examples(config)
  features = featurize(config, examples, tokenizer, family)
  rows = {k: v for k, v in features.items() if k in INPUT_KEYS}
  if head == 'token':
    rows['cvt_weight'] = (features['token_labels'] >= 0).astype(np.float32)
  else:
    rows['cvt_weight'] = np.ones(len(features['input_ids']), np.float32)
  return Split(examples, rows)
