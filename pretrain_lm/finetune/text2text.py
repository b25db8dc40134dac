"""Text-to-text generation: teacher-forced training, evaluation by decoding.

Decoders (GPT) and encoder-decoders (T5, BART) learn to write each
example's target after its input with the body's own language-model head
(head 'lm'), by token-level cross-entropy on the target tokens only. Rows
(B batch, L row length, T target length):

  decoder: `input [SEP] target [SEP]` in input_ids [B, L]; target_ids[t]
      is the token after position t, and target_mask marks the positions
      whose next token is the target's or its closing [SEP] (GPT's
      fine-tuning with a delimiter, Radford et al., 2018, section 3.3).
  encoder-decoder: the encoder reads `input [SEP]` (input_ids, [B, L]);
      the decoder is teacher-forced on `[CLS] target` (decoder_input_ids,
      [B, T]) against `target [SEP]` (target_ids), [CLS] being the
      decoder's start here as in span corruption and BART's denoising.

Evaluation decodes each dev input with the current params through
`pretrain_lm.Pretrained.generate_ids` (greedy, or beam search with GNMT's
length penalty; KV-cached) and scores the texts against the targets:
ROUGE-1/2/L F-measures (`rouge_score`, Porter stemming, as the summarisation
papers report them), corpus BLEU (`sacrebleu`) and SQuAD's exact match and
token F1 (squad.py's normalisation), all in percent.

Data (`task.data_dir`): a folder with train and dev files, either TSV
(`input<TAB>target` per line, an optional header row `input<TAB>target`)
or JSONL (`{"input": ..., "target": ...}` per line), local or gs://. An
empty data_dir builds the bundled default: WikiText-2 section headings from
their section's first paragraph (`heading_examples`).

Task config fields: data_dir, metric (rouge1, rouge2, rougeL, bleu,
exact_match, f1; 'rouge' is rougeL), seq_len (an encoder's input row, a
decoder's whole row), target_len (target tokens with the closing [SEP]),
max_new_tokens, num_beams, length_penalty.
"""

import json
import os
import re

import numpy as np
import tensorflow as tf

from pretrain_lm import configlib
from pretrain_lm.finetune import squad

HEAD = 'lm'
METRICS = ('rouge1', 'rouge2', 'rougeL', 'bleu', 'exact_match', 'f1')
ALIASES = {'rouge': 'rougeL'}
FORMATS = ('tsv', 'jsonl')
BUNDLED_WIKITEXT = os.path.join(configlib.CORPUS_DIR, 'wikitext-2')
# The default dataset: train on the headings of the quickstart's training
# text, evaluate on those of its held-out text.
WIKITEXT_FILES = {'train': 'valid.txt', 'dev': 'test.txt'}
# ' = Title = ' starts an article, ' = = Title = = ' a section and
# ' = = = Title = = = ' a subsection.
_HEADING = re.compile(r'^ (=(?: =)*) (.+?) \1 $')
_UNK = '<unk>'  # WikiText's stand-in for a word out of its vocabulary


def head(task_config) -> str:
  del task_config
  return HEAD


def num_labels(task_config) -> int:
  """No classes: the head is the body's vocabulary."""
  del task_config
  return 0


def metric_name(task_config) -> str:
  """The evaluate() key that picks the best checkpoint (default rougeL)."""
  name = task_config.get('metric', '') or 'rougeL'
  name = ALIASES.get(name, name)
  if name not in METRICS:
    raise ValueError(
      f'task.metric={task_config.metric!r}; valid: '
      f'{list(METRICS) + list(ALIASES)}.'
    )
  return name


def eval_splits(task_config) -> list[str]:
  del task_config
  return ['dev']


def check_config(task_config) -> None:
  """Raises on bad lengths, decoding options or metric; reads no data."""
  metric_name(task_config)
  for name in ('target_len', 'max_new_tokens', 'num_beams'):
    if task_config[name] < 1:
      raise ValueError(f'task.{name}={task_config[name]} must be >= 1.')
  if task_config.length_penalty < 0:
    raise ValueError(
      f'task.length_penalty={task_config.length_penalty} must be >= 0.'
    )


def _data_file(data_dir: str, split: str) -> str:
  """The split's file in data_dir: <split>.tsv or <split>.jsonl."""
  found = [
    os.path.join(data_dir, f'{split}.{ext}')
    for ext in FORMATS
    if tf.io.gfile.exists(os.path.join(data_dir, f'{split}.{ext}'))
  ]
  if len(found) != 1:
    what = 'both' if found else 'neither'
    raise FileNotFoundError(
      f'{data_dir!r} holds {what} of {split}.tsv and {split}.jsonl; '
      'task.data_dir must hold one file per split: TSV lines '
      '\'input<TAB>target\' or JSONL lines {"input": ..., "target": ...}.'
    )
  return found[0]


def read_file(path: str) -> list[dict]:
  """Examples {'input', 'target'} of a TSV or JSONL file, in file order."""
  with tf.io.gfile.GFile(path, 'r') as f:
    lines = [line.rstrip('\r\n') for line in f]
  examples = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    where = f'{path}:{number}'
    if path.endswith('.jsonl'):
      try:
        record = json.loads(line)
        pair = str(record['input']), str(record['target'])
      except (ValueError, KeyError, TypeError):
        raise ValueError(
          f'{where}: not a JSON object with "input" and "target".'
        ) from None
    else:
      pair = tuple(line.split('\t'))
      if len(pair) != 2:
        raise ValueError(
          f'{where}: {len(pair)} tab-separated fields; expected 2 '
          '(input, target).'
        )
      if number == 1 and pair == ('input', 'target'):
        continue  # the header row
    examples.append({'input': pair[0], 'target': pair[1]})
  return examples


def heading_examples(path: str) -> list[dict]:
  """Each WikiText section's first paragraph -> its heading.

  A section is a ' = = Title = = ' line, or a subsection's ' = = = Title
  = = = ', up to the next heading; a section whose next heading comes
  before any paragraph (a subsection's, or the next article's) is left out,
  and so is a heading with '<unk>' in it: it stands for any rare word, which
  no paragraph can name (and ROUGE's tokenizer would score it as 'unk').
  """
  with tf.io.gfile.GFile(path, 'r') as f:
    lines = [line.rstrip('\n') for line in f]
  examples, title = [], None
  for line in lines:
    match = _HEADING.match(line)
    if match:
      # Article titles (level 1) are left out: a lead paragraph names its
      # own title in its first words.
      title = match.group(2) if match.group(1) != '=' else None
      if title is not None and _UNK in title:
        title = None
      continue
    if title is not None and line.strip():
      examples.append({'input': line.strip(), 'target': title})
      title = None
  return examples


def read(task_config, split: str) -> list[dict]:
  """Examples {'input', 'target'} of a split ('train' or 'dev')."""
  if split not in ('train', 'dev'):
    raise ValueError(f"text2text has splits 'train' and 'dev', not {split!r}.")
  data_dir = task_config.get('data_dir', '')
  if not data_dir:
    return heading_examples(
      os.path.join(BUNDLED_WIKITEXT, WIKITEXT_FILES[split])
    )
  return read_file(_data_file(data_dir, split))


def featurize(
  examples: list[dict], tokenizer, task_config, *, seq_len: int, family: str
) -> dict[str, np.ndarray]:
  """Teacher-forced rows (the module docstring's layouts) of examples.

  Inputs are cut at the end to fit seq_len; targets to target_len tokens
  with their [SEP]. 'prompt_length' is how many of a row's input_ids the
  model is given to generate from.
  """
  T = task_config.target_len
  sep, pad = tokenizer.sep_id, tokenizer.pad_id
  inputs = [tokenizer.encode(e['input']) for e in examples]
  targets = [tokenizer.encode(e['target'])[: T - 1] + [sep] for e in examples]
  N = len(examples)
  if family == 'decoder':
    budget = seq_len - T - 1  # input tokens, after [SEP] and the target
    if budget < 0:
      raise ValueError(
        f'task.seq_len={seq_len} must exceed task.target_len={T} by one: '
        'a decoder row holds the input, [SEP] and the target.'
      )
    rows = [
      x[:budget] + [sep] + y for x, y in zip(inputs, targets, strict=True)
    ]
    prompt = np.asarray([min(len(x), budget) + 1 for x in inputs], np.int32)
    L = seq_len
  elif family == 'encoder_decoder':
    rows = [x[: seq_len - 1] + [sep] for x in inputs]
    prompt = np.asarray([len(row) for row in rows], np.int32)
    L = T
  else:
    raise ValueError(
      "text2text generates with the body's language-model head: it needs "
      f'a decoder or an encoder-decoder, not {family!r}.'
    )
  features = {
    'input_ids': np.full((N, seq_len), pad, np.int32),
    'input_mask': np.zeros((N, seq_len), np.int32),
    'target_ids': np.full((N, L), pad, np.int32),
    'target_mask': np.zeros((N, L), np.int32),
  }
  for i, row in enumerate(rows):
    features['input_ids'][i, : len(row)] = row
    features['input_mask'][i, : len(row)] = 1
    y = targets[i]
    # Decoder: position t predicts row[t + 1], so the target's tokens are
    # predicted from the [SEP] before them on.
    start = prompt[i] - 1 if family == 'decoder' else 0
    features['target_ids'][i, start : start + len(y)] = y
    features['target_mask'][i, start : start + len(y)] = 1
  if family == 'encoder_decoder':
    features['decoder_input_ids'] = np.full((N, T), pad, np.int32)
    for i, y in enumerate(targets):
      features['decoder_input_ids'][i, : len(y)] = [tokenizer.cls_id] + y[:-1]
  features['prompt_length'] = prompt
  features['example_index'] = np.arange(N, dtype=np.int32)
  return features


def scores(predictions: list[str], references: list[str]) -> dict[str, float]:
  """ROUGE-1/2/L F, corpus BLEU, exact match and F1, each in percent.

  ROUGE is rouge_score's (its tokenizer: lower case, alphanumeric tokens;
  Porter stemming), averaged over examples; BLEU is sacrebleu's corpus
  BLEU with its default 13a tokenization; exact match and F1 are SQuAD
  v1.1's (squad.normalize_answer), averaged over examples.
  """
  if len(predictions) != len(references) or not references:
    raise ValueError(
      f'{len(predictions)} predictions for {len(references)} references.'
    )
  # Imported here: nltk's stemmer loads in seconds, and only scoring needs
  # it.
  import sacrebleu
  from rouge_score import rouge_scorer

  scorer = rouge_scorer.RougeScorer(METRICS[:3], use_stemmer=True)
  rouge = [
    scorer.score(r, p) for p, r in zip(predictions, references, strict=True)
  ]
  out = {
    k: 100.0 * float(np.mean([s[k].fmeasure for s in rouge]))
    for k in METRICS[:3]
  }
  out['bleu'] = float(sacrebleu.corpus_bleu(predictions, [references]).score)
  pairs = list(zip(predictions, references, strict=True))
  out['exact_match'] = 100.0 * float(
    np.mean([squad.exact_match_score(p, r) for p, r in pairs])
  )
  out['f1'] = 100.0 * float(np.mean([squad.f1_score(p, r) for p, r in pairs]))
  return out


def evaluate(
  examples: list[dict],
  features: dict[str, np.ndarray],
  predictions: dict[str, np.ndarray],
  task_config,
) -> dict[str, float]:
  """`scores` of the decoded 'texts' (one per row) against the targets."""
  del task_config
  references = [examples[i]['target'] for i in features['example_index']]
  return scores(list(predictions['texts']), references)
