"""Fine-tuning's evaluation: predictions, scores, texts and results.json.

The head's outputs over every row of a split (run_predictions), a split's
task scores and dev loss, a generative task's decoded texts and their
predictions_<step>.jsonl, and results.json, which keeps the best and the
final dev evaluation and decides when the best checkpoint is saved.
"""

import json
import os
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
import tensorflow as tf

from pretrain_lm import pretrained as pretrained_lib
from pretrain_lm import sharding
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.finetune import losses
from pretrain_lm.finetune import rows as rows_lib
from pretrain_lm.finetune.batches import host_rows
from pretrain_lm.models import ModelConfig

RESULTS_FILE = 'results.json'


def predict_step(params, batch, *, model):
  """The head's outputs on a batch, without dropout."""
  return model.apply({'params': params}, batch, deterministic=True)


def lm_predict_step(params, batch, *, model):
  """A generative row's target NLL and token count (losses.target_nll)."""
  logits = model.apply({'params': params}, batch, deterministic=True)['logits']
  return losses.target_nll(logits, batch['target_ids'], batch['target_mask'])


def run_predictions(
  predict: Callable,
  params,
  features: dict[str, np.ndarray],
  *,
  keys: tuple[str, ...],
  batch_size: int,
  mesh: jax.sharding.Mesh,
) -> dict[str, np.ndarray]:
  """`predict` over every row, in batches of batch_size (last one padded)."""
  n = len(features['input_ids'])
  chunks = []
  for start in range(0, n, batch_size):
    rows = np.arange(start, start + batch_size)
    # The last batch repeats row 0: a real row keeps every output finite.
    rows = np.where(rows < n, rows, 0)
    host = host_rows(rows)
    batch = {k: features[k][host] for k in keys}
    out = predict(params, sharding.host_to_global(batch, mesh))
    chunks.append(jax.tree.map(np.asarray, jax.device_get(out)))
  return {k: np.concatenate([c[k] for c in chunks])[:n] for k in chunks[0]}


def split_scores(
  task,
  config: ml_collections.ConfigDict,
  head: str,
  split: rows_lib.Split,
  predictions: dict,
) -> dict[str, float]:
  """The task's metrics on a split's predictions, and its gold 'loss' where
  the split has labels."""
  scores = task.evaluate(
    split.examples, split.features, predictions, config.task
  )
  loss = losses.eval_loss(
    head, predictions, split.features, config.head.text_to_text
  )
  if loss is not None:
    scores['loss'] = loss
  return scores


def check_generation_lengths(
  task_config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  eval_splits: dict[str, rows_lib.Split],
) -> None:
  """Raises unless the body's positions cover the training rows and
  every dev prompt with max_new_tokens after it."""
  tc, max_len = task_config, model_config.max_len
  longest = max(tc.seq_len, tc.target_len, tc.max_new_tokens)
  if model_config.family == 'decoder':
    prompts = max(
      int(split.features['prompt_length'].max())
      for split in eval_splits.values()
    )
    longest = max(longest, prompts + tc.max_new_tokens)
  if longest > max_len:
    raise ValueError(
      f'task.seq_len={tc.seq_len}, task.target_len={tc.target_len} and '
      f'task.max_new_tokens={tc.max_new_tokens} make rows of {longest} '
      f'tokens, more than the model.max_len={max_len} of the body.'
    )


def generate(
  generator: pretrained_lib.Pretrained,
  params,
  features: dict[str, np.ndarray],
  task_config: ml_collections.ConfigDict,
  batch_size: int,
) -> list[str]:
  """Each row's decoded text from its prompt, as the task config says
  (greedy, or beam search with its length penalty), cut at [SEP]."""
  tc = task_config
  generator.params = params['backbone']
  rows = [
    ids[:n]
    for ids, n in zip(
      features['input_ids'], features['prompt_length'], strict=True
    )
  ]
  out_NT = generator.generate_ids(
    rows,
    tc.max_new_tokens,
    temperature=0.0,
    num_beams=tc.num_beams,
    length_penalty=tc.length_penalty,
    batch_size=batch_size,
  )
  sep, texts = generator.tokenizer.sep_id, []
  for ids in out_NT.tolist():
    texts.append(generator.decode(ids[: ids.index(sep)] if sep in ids else ids))
  return texts


def write_predictions(
  workdir: str, name: str, step: int, split: rows_lib.Split, texts: list[str]
) -> None:
  """predictions_<step>.jsonl (dev; predictions_<split>_<step>.jsonl for
  others): each example with its generated 'prediction'."""
  infix = '' if name == 'dev' else f'{name}_'
  path = os.path.join(workdir, f'predictions_{infix}{step}.jsonl')
  index = split.features['example_index']
  with tf.io.gfile.GFile(path, 'w') as f:
    for i, text in zip(index, texts, strict=True):
      record = dict(split.examples[i], prediction=text)
      f.write(json.dumps(record, ensure_ascii=False) + '\n')


class Results:
  """results.json: the metric's best dev evaluation, the final one, all."""

  def __init__(self, workdir: str, metric: str, enabled: bool):
    self.path = os.path.join(workdir, RESULTS_FILE)
    self.enabled = enabled
    self.content = {'metric': metric, 'best': None, 'final': None, 'evals': []}
    if tf.io.gfile.exists(self.path):  # a resumed run keeps its history
      self.content = workdir_lib.read_json(self.path)

  def add(self, step: int, scores: dict[str, float], final: bool) -> bool:
    """Records an evaluation; True when it is the best so far."""
    key = 'eval_' + self.content['metric']
    record = {'step': step, **scores}
    best = self.content['best']
    improved = best is None or scores[key] > best[key]
    if improved:
      self.content['best'] = record
    self.content['evals'] = [
      e for e in self.content['evals'] if e['step'] != step
    ] + [record]
    if final:
      self.content['final'] = record
    if self.enabled:
      workdir_lib.write_json(self.path, self.content)
    return improved
