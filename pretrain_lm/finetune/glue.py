"""GLUE tasks: the TSV layout (or TFDS glue/*), rows, and official metrics.

`task_config.glue_task` picks a preset in `PRESETS`: cola, sst2, mrpc, stsb,
qqp, mnli, qnli, rte. `task_config.data_dir` is the task's folder as GLUE's
download script lays it out (train.tsv, dev.tsv, test.tsv; MNLI has
dev_matched.tsv and dev_mismatched.tsv), or 'tfds:' / 'tfds:DIR' for the
prepared TFDS dataset glue/<task> (in TFDS' default folder or DIR). For sst2
an empty data_dir reads the SST-2 sample bundled with the package.

Metrics are fractions (accuracy 0.93, not 93): each task's official ones,
plus the mean GLUE's leaderboard scores MRPC, QQP and STS-B by.

Every task module (glue, squad, conll, text2text) has the same interface,
which the fine-tuning loop calls: `read(task_config, split)` -> examples
(dicts); `featurize(examples, tokenizer, task_config, *, seq_len, family)`
-> numpy rows with static shapes ('input_ids', 'input_mask',
'token_type_ids', 'example_index', the head's labels, and bookkeeping
`evaluate` needs); `evaluate(examples, rows, predictions, task_config)` ->
official metrics from the head's outputs for every row (a generative
task's: the decoded 'texts'); `head`, `num_labels`, `metric_name`,
`eval_splits` and `check_config` of the task config.
"""

import dataclasses
import os

import numpy as np
import tensorflow as tf
from absl import logging

from pretrain_lm import configlib
from pretrain_lm.finetune import inputs, metrics

HEAD = 'classification'
METRIC = 'accuracy'
BUNDLED_SST2 = os.path.join(configlib.CORPUS_DIR, 'sst2')
TFDS_PREFIX = 'tfds:'


@dataclasses.dataclass(frozen=True)
class Preset:
  """Where a GLUE task's fields are in its TSV files and how it is scored.

  Columns are named by the header row; the first of several names that the
  header holds is used (the bundled SST-2 calls its text 'content' in dev).
  A task whose train/dev files have no header (CoLA) gives column indices.
  """

  text_a: tuple[str, ...]
  text_b: tuple[str, ...] | None
  label: tuple[str, ...]
  # Label strings in id order; None for regression (STS-B).
  labels: tuple[str, ...] | None
  metrics: tuple[str, ...]
  metric: str
  # Split -> file in data_dir.
  files: dict[str, str]
  # Headerless layout: (text_a index, label index).
  positions: tuple[int, int] | None = None
  # TFDS glue/<name>: feature names and split names.
  tfds_text: tuple[str, str | None] = ('sentence', None)
  tfds_splits: dict[str, str] = dataclasses.field(
    default_factory=lambda: {
      'train': 'train',
      'dev': 'validation',
      'test': 'test',
    }
  )


_FILES = {'train': 'train.tsv', 'dev': 'dev.tsv', 'test': 'test.tsv'}
_BINARY = ('0', '1')
_NLI = ('entailment', 'not_entailment')
_ACCURACY_F1 = ('accuracy', 'f1', 'accuracy_f1_mean')

PRESETS = {
  # CoLA's train/dev files have no header: source, label, original
  # judgement ('*' or empty), sentence. Its test.tsv has 'index\tsentence'.
  'cola': Preset(
    text_a=('sentence',),
    text_b=None,
    label=('label',),
    labels=_BINARY,
    metrics=('matthews_corr', 'accuracy'),
    metric='matthews_corr',
    files=_FILES,
    positions=(3, 1),
  ),
  'sst2': Preset(
    text_a=('sentence', 'content'),
    text_b=None,
    label=('label',),
    labels=_BINARY,
    metrics=('accuracy',),
    metric='accuracy',
    files=_FILES,
  ),
  'mrpc': Preset(
    text_a=('#1 String',),
    text_b=('#2 String',),
    label=('Quality',),
    labels=_BINARY,
    metrics=_ACCURACY_F1,
    metric='accuracy_f1_mean',
    files=_FILES,
    tfds_text=('sentence1', 'sentence2'),
  ),
  'stsb': Preset(
    text_a=('sentence1',),
    text_b=('sentence2',),
    label=('score',),
    labels=None,
    metrics=('pearson', 'spearman', 'pearson_spearman_mean'),
    metric='pearson_spearman_mean',
    files=_FILES,
    tfds_text=('sentence1', 'sentence2'),
  ),
  'qqp': Preset(
    text_a=('question1',),
    text_b=('question2',),
    label=('is_duplicate',),
    labels=_BINARY,
    metrics=_ACCURACY_F1,
    metric='accuracy_f1_mean',
    files=_FILES,
    tfds_text=('question1', 'question2'),
  ),
  # MNLI's label order is BERT's and Hugging Face's; TFDS ids are mapped by
  # name. 'dev_mismatched' is a second evaluation split.
  'mnli': Preset(
    text_a=('sentence1',),
    text_b=('sentence2',),
    label=('gold_label',),
    labels=('contradiction', 'entailment', 'neutral'),
    metrics=('accuracy',),
    metric='accuracy',
    files={
      'train': 'train.tsv',
      'dev': 'dev_matched.tsv',
      'dev_mismatched': 'dev_mismatched.tsv',
      'test': 'test_matched.tsv',
      'test_mismatched': 'test_mismatched.tsv',
    },
    tfds_text=('premise', 'hypothesis'),
    tfds_splits={
      'train': 'train',
      'dev': 'validation_matched',
      'dev_mismatched': 'validation_mismatched',
      'test': 'test_matched',
      'test_mismatched': 'test_mismatched',
    },
  ),
  'qnli': Preset(
    text_a=('question',),
    text_b=('sentence',),
    label=('label',),
    labels=_NLI,
    metrics=('accuracy',),
    metric='accuracy',
    files=_FILES,
    tfds_text=('question', 'sentence'),
  ),
  'rte': Preset(
    text_a=('sentence1',),
    text_b=('sentence2',),
    label=('label',),
    labels=_NLI,
    metrics=('accuracy',),
    metric='accuracy',
    files=_FILES,
    tfds_text=('sentence1', 'sentence2'),
  ),
}

# The label words T5 was trained to emit for each task (t5.data.glue_utils),
# for text-to-text fine-tuning; ids follow Preset.labels.
T5_LABEL_WORDS = {
  'cola': ('unacceptable', 'acceptable'),
  'sst2': ('negative', 'positive'),
  'mrpc': ('not_equivalent', 'equivalent'),
  'qqp': ('not_duplicate', 'duplicate'),
  'mnli': ('contradiction', 'entailment', 'neutral'),
  'qnli': ('entailment', 'not_entailment'),
  'rte': ('entailment', 'not_entailment'),
}
# T5's input prefixes: the task name, then each text after its field name.
_T5_FIELDS = {
  'cola': ('sentence', None),
  'sst2': ('sentence', None),
  'mrpc': ('sentence1', 'sentence2'),
  'stsb': ('sentence1', 'sentence2'),
  'qqp': ('question1', 'question2'),
  'mnli': ('premise', 'hypothesis'),
  'qnli': ('question', 'sentence'),
  'rte': ('sentence1', 'sentence2'),
}


def get_preset(task_config) -> Preset:
  """The preset that task_config.glue_task names."""
  name = task_config.glue_task
  if name not in PRESETS:
    raise ValueError(
      f'task.glue_task={name!r} is not one of {sorted(PRESETS)}.'
    )
  return PRESETS[name]


def head(task_config) -> str:
  """'regression' for STS-B, 'classification' for the others."""
  return HEAD if get_preset(task_config).labels else 'regression'


def num_labels(task_config) -> int:
  """Classes of the task; 1 (the score) for STS-B."""
  labels = get_preset(task_config).labels
  return len(labels) if labels else 1


def metric_name(task_config) -> str:
  """The evaluate() key that picks the best checkpoint.

  task_config.metric overrides the task's default: its GLUE leaderboard
  score (the mean of the two metrics for MRPC, QQP and STS-B).
  """
  preset = get_preset(task_config)
  name = task_config.get('metric', '') or preset.metric
  if name not in preset.metrics:
    raise ValueError(
      f'task.metric={name!r} is not a metric of {task_config.glue_task}: '
      f'{preset.metrics}.'
    )
  return name


def check_config(task_config) -> None:
  """Raises on a bad glue_task, metric or missing data_dir; reads no data."""
  metric_name(task_config)
  _data_dir(task_config)


def eval_splits(task_config) -> list[str]:
  """The labelled held-out splits: 'dev', and MNLI's 'dev_mismatched'."""
  return [s for s in get_preset(task_config).files if s.startswith('dev')]


def _data_dir(task_config) -> str:
  data_dir = task_config.get('data_dir', '')
  if data_dir:
    return data_dir
  if task_config.glue_task == 'sst2':
    return BUNDLED_SST2
  raise ValueError(
    f'Set task.data_dir to the {task_config.glue_task} folder of the GLUE '
    "download (train.tsv, dev.tsv, ...), or to 'tfds:' for TFDS glue/"
    f'{task_config.glue_task}; only sst2 has a bundled default.'
  )


def _column(header: list[str], names: tuple[str, ...], path: str) -> int:
  for name in names:
    if name in header:
      return header.index(name)
  raise ValueError(
    f'{path}: the header {header} has none of the columns {list(names)}.'
  )


def _parse_label(value: str, preset: Preset, where: str):
  """A label id, or a float score for regression."""
  if preset.labels is None:
    try:
      return float(value)
    except ValueError:
      raise ValueError(f'{where}: score {value!r} is not a number.') from None
  if value not in preset.labels:
    raise ValueError(
      f'{where}: label {value!r} is not one of {list(preset.labels)}.'
    )
  return preset.labels.index(value)


def read_tsv(path: str, preset: Preset, split: str) -> tuple[list[dict], int]:
  """A GLUE TSV's examples, and how many lines lacked a field.

  Fields are split on tabs with no quoting, as GLUE's reference processors
  read them (csv with quotechar=None). A line too short for the columns the
  task needs is skipped and counted, as Hugging Face's QQP processor does
  for the few malformed QQP lines. A file without the label column (GLUE's
  test files) gives label None.
  """
  with tf.io.gfile.GFile(path, 'r') as f:
    rows = [line.rstrip('\r\n').split('\t') for line in f]
  rows = [row for row in rows if row != ['']]
  if not rows:
    raise ValueError(f'{path} is empty.')
  # MRPC's files keep the byte order mark of Microsoft's originals.
  rows[0][0] = rows[0][0].removeprefix('\ufeff')
  header = rows[0]
  has_header = any(name in header for name in preset.text_a)
  if has_header:
    a = _column(header, preset.text_a, path)
    b = _column(header, preset.text_b, path) if preset.text_b else None
    label_names = [n for n in preset.label if n in header]
    label = header.index(label_names[0]) if label_names else None
    rows = rows[1:]
  elif preset.positions:
    (a, label), b = preset.positions, None
  else:
    raise ValueError(
      f'{path} has no header row naming the columns {list(preset.text_a)}; '
      'is it a GLUE TSV of this task?'
    )
  needed = max(i for i in (a, b, label) if i is not None)
  examples, skipped = [], 0
  first_line = 2 if has_header else 1
  for line_number, row in enumerate(rows, first_line):
    if len(row) <= needed:
      skipped += 1
      continue
    example = {
      'guid': f'{split}-{len(examples)}',
      'text_a': row[a],
      'text_b': row[b] if b is not None else None,
      'label': None,
    }
    if label is not None:
      where = f'{path}:{line_number}'
      example['label'] = _parse_label(row[label], preset, where)
    examples.append(example)
  return examples, skipped


def _tfds_read(task_config, preset: Preset, split: str) -> list[dict]:
  """Examples of the prepared TFDS dataset glue/<task>."""
  # Imported here: it takes seconds and TSV reading does not need it.
  import tensorflow_datasets as tfds

  name = f'glue/{task_config.glue_task}'
  data_dir = task_config.data_dir[len(TFDS_PREFIX) :] or None
  builder = tfds.builder(name, data_dir=data_dir)
  if not builder.is_prepared():
    raise FileNotFoundError(
      f'TFDS dataset {name!r} is not prepared in {builder.data_dir!r}. '
      f'Prepare it where there is network access (`tfds build {name} '
      "--data_dir=DIR`) and set task.data_dir='tfds:DIR', or point "
      'task.data_dir at the GLUE TSV folder; runs never download.'
    )
  ds = builder.as_dataset(split=preset.tfds_splits[split], shuffle_files=False)
  label_feature = builder.info.features['label']
  key_a, key_b = preset.tfds_text
  examples = []
  for i, row in enumerate(tfds.as_numpy(ds)):
    label = row['label']
    if label < 0:  # TFDS test splits carry -1.
      label = None
    elif preset.labels is None:
      label = float(label)
    elif preset.labels == _BINARY:
      label = int(label)
    else:
      label = preset.labels.index(label_feature.int2str(int(label)))
    examples.append(
      {
        'guid': f'{split}-{i}',
        'text_a': row[key_a].decode('utf-8'),
        'text_b': row[key_b].decode('utf-8') if key_b else None,
        'label': label,
      }
    )
  return examples


def read(task_config, split: str) -> list[dict]:
  """Examples {'guid', 'text_a', 'text_b', 'label'} of a split.

  Args:
    task_config: the config's task section (glue_task, data_dir).
    split: 'train', 'dev', 'test', and for MNLI also 'dev_mismatched' and
      'test_mismatched'.

  Returns:
    Examples in file order; 'text_b' is None for single-sentence tasks,
    'label' a class id, a float (STS-B), or None where the split has none.
  """
  preset = get_preset(task_config)
  if split not in preset.files:
    raise ValueError(
      f'{task_config.glue_task} has no split {split!r}; it has '
      f'{list(preset.files)}.'
    )
  data_dir = _data_dir(task_config)
  if data_dir.startswith(TFDS_PREFIX):
    return _tfds_read(task_config, preset, split)
  path = os.path.join(data_dir, preset.files[split])
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(
      f'{path} not found. task.data_dir must be the {task_config.glue_task} '
      'folder of the GLUE download, holding '
      f'{", ".join(preset.files.values())}.'
    )
  examples, skipped = read_tsv(path, preset, split)
  if skipped:
    logging.warning('%s: skipped %d lines with missing fields.', path, skipped)
  return examples


def unlabeled_example(text: str, task_config, index: int) -> dict:
  """An example of unlabelled text (cross-view training): one sentence."""
  if get_preset(task_config).text_b is not None:
    raise ValueError(
      f'{task_config.glue_task} reads sentence pairs; plain text makes no '
      "unlabelled pairs (cvt.unlabeled='train' reads its own)."
    )
  return {
    'guid': f'unlabeled-{index}',
    'text_a': text,
    'text_b': None,
    'label': None,
  }


def featurize(
  examples: list[dict], tokenizer, task_config, *, seq_len: int, family: str
) -> dict[str, np.ndarray]:
  """One row per example: `[CLS] A [SEP] (B [SEP])` (decoders: no [CLS]).

  Too long a pair loses tokens from the end of the longer sentence first.
  'label' is int32 (-1 where unknown) or float32 for STS-B (NaN where
  unknown).
  """
  ids, types = [], []
  for example in examples:
    tokens_b = None
    if example['text_b'] is not None:
      tokens_b = tokenizer.encode(example['text_b'])
    row = inputs.pair_row(
      tokenizer,
      tokenizer.encode(example['text_a']),
      tokens_b,
      seq_len=seq_len,
      family=family,
    )
    ids.append(row[0])
    types.append(row[1])
  rows = inputs.model_rows(tokenizer, ids, types, seq_len=seq_len)
  rows['example_index'] = np.arange(len(examples), dtype=np.int32)
  classes = get_preset(task_config).labels
  missing, dtype = (-1, np.int32) if classes else (np.nan, np.float32)
  labels = [missing if e['label'] is None else e['label'] for e in examples]
  rows['label'] = np.asarray(labels, dtype).reshape(len(examples))
  return rows


def evaluate(
  examples: list[dict],
  features: dict[str, np.ndarray],
  predictions: dict[str, np.ndarray],
  task_config,
) -> dict[str, float]:
  """The task's official metrics from 'logits' [N, C] (STS-B: [N])."""
  preset = get_preset(task_config)
  del examples  # The labels are in the rows.
  labels = features['label']
  logits = np.asarray(predictions['logits'])
  if preset.labels is None:
    if np.isnan(labels).any():
      raise ValueError('Cannot score a split without gold scores.')
    scores = logits.reshape(len(labels))
    return {
      name: value
      for name, value in metrics.regression_metrics(labels, scores).items()
      if name in preset.metrics
    }
  if (labels < 0).any():
    raise ValueError('Cannot score a split without gold labels.')
  guesses = logits.reshape(len(labels), -1).argmax(-1)
  scores = {'accuracy': metrics.accuracy(labels, guesses)}
  if 'f1' in preset.metrics:
    scores['f1'] = metrics.f1_binary(labels, guesses)
    scores['accuracy_f1_mean'] = (scores['accuracy'] + scores['f1']) / 2
  if 'matthews_corr' in preset.metrics:
    scores['matthews_corr'] = metrics.matthews_corrcoef(labels, guesses)
  return scores


def text_to_text(example: dict, task_config) -> tuple[str, str]:
  """T5's (input, target) strings of an example, e.g. 'sst2 sentence: ...'.

  The target is the label word, or the STS-B score rounded to T5's 0.2 grid
  ('3.8'); '' where the label is unknown.
  """
  name = task_config.glue_task
  field_a, field_b = _T5_FIELDS[name]
  text = f'{name} {field_a}: {example["text_a"]}'
  if field_b:
    text += f' {field_b}: {example["text_b"]}'
  label = example['label']
  if label is None:
    return text, ''
  if name == 'stsb':
    return text, f'{round(label * 5) / 5:.1f}'
  return text, T5_LABEL_WORDS[name][label]


def parse_text_label(text: str, task_config) -> int | float:
  """The label id (or STS-B score) a generated target names; -1 (or NaN)
  for text that names none, which then counts as wrong."""
  text = text.strip()
  if task_config.glue_task == 'stsb':
    try:
      return float(text)
    except ValueError:
      return float('nan')
  words = T5_LABEL_WORDS[task_config.glue_task]
  return words.index(text) if text in words else -1
