"""A workdir's checkpoint evaluated on data files, and its result as a table."""

import os
from typing import Any

import ml_collections
import tensorflow as tf

from pretrain_lm import pretrained
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import sources
from pretrain_lm.evaluate.perplexity import evaluate_texts

# How each kind of score is named in the printed table.
KIND_NAMES = {
  'causal': 'perplexity',
  'pseudo': 'pseudo-perplexity',
  'reconstruction': 'reconstruction perplexity',
}


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
