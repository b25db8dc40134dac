"""Batches of prepared corpora (data.source='prepared:...'), read by index.

The glue between the run's config and prepared.py: the checked stream of
the run's corpora, their train and eval batches with the objective's
transform, and the per-corpus facts training logs (tokens read, input the
preparation skipped).
"""

import ml_collections
import tensorflow as tf

from pretrain_lm.data import packing, prepared, records, sources
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.data.rows import RowTransform


def eval_is_prepared(data_config) -> bool:
  """Whether the eval split comes from prepared corpora."""
  source = sources.eval_source(data_config) or data_config.source
  return prepared.is_prepared(source)


def prepared_stream(
  config: ml_collections.ConfigDict, row_length: int, split: str = 'train'
) -> prepared.Stream:
  """The run's prepared corpora (data.source) as a stream, checked.

  For 'eval', data.eval_source's corpora where it names prepared ones,
  and each must hold data.eval_batches full batches (every host runs the
  same eval steps).
  """
  d = config.data
  source = d.source
  if split == 'eval' and sources.eval_source(d):
    source = d.eval_source
  corpora = prepared.corpora(config, row_length, split=split, source=source)
  for corpus in corpora if split == 'eval' else ():
    rows = corpus.num_rows('eval')
    if rows < d.eval_batches * d.batch_size:
      raise ValueError(
        f'Prepared corpus {corpus.directory}: its eval split has {rows} '
        f'rows, fewer than data.eval_batches={d.eval_batches} x '
        f'data.batch_size={d.batch_size}: lower data.eval_batches, or '
        'prepare it with a data.eval_source.'
      )
  return prepared.Stream(corpora, d.seed, split=split)


def prepared_dataset(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  objective: RowTransform,
  *,
  split: str,
  start_batch: int = 0,
  process_index: int = 0,
  process_count: int = 1,
  stream: prepared.Stream | None = None,
  num_batches: int | None = None,
) -> tf.data.Dataset:
  """train_dataset (or an eval split) of prepared corpora, read by index.

  Args:
    config: the full run config (uses `data` and `objective`).
    tokenizer: the run's tokenizer (the corpora's own).
    objective: the objective's transform (objectives.row_transform).
    split: 'train' (shuffled, endless) or 'eval' (stored order).
    start_batch: the first global batch (the train step to resume at).
    process_index: this host's index.
    process_count: the number of hosts.
    stream: the corpora to read; None: the run's (prepared_stream).
    num_batches: stop after this many batches; None: never.
  """
  stream = stream or prepared_stream(config, objective.row_length, split)
  _check_prepared_tokenizer(stream, tokenizer)
  partnered = objective.partnered
  if partnered and config.data.batch_size < 2:
    raise ValueError(
      f'objective.sentence_task={config.objective.sentence_task!r} pairs '
      'rows within a batch and needs data.batch_size >= 2.'
    )

  def transform(row, seed, partner=None):
    kwargs = {'partner': partner} if partnered else {}
    return objective.fn(
      row, seed, config=config.objective, tokenizer=tokenizer, **kwargs
    )

  return prepared.dataset(
    stream,
    row_length=objective.row_length,
    features=lambda ids: packing.row_features(
      ids, tokenizer.sep_id, tokenizer.pad_id
    ),
    transform=transform,
    batch_size=config.data.batch_size,
    start_batch=start_batch,
    process_index=process_index,
    process_count=process_count,
    partnered=partnered,
    num_batches=num_batches,
    shuffled=split == 'train',
  )


def _check_prepared_tokenizer(stream: prepared.Stream, tokenizer) -> None:
  """The run's tokenizer must be the one the rows were made with."""
  sha = records.tokenizer_meta(tokenizer)['sha256']
  for corpus in stream.corpora:
    if corpus.manifest['tokenizer']['sha256'] != sha:
      raise ValueError(
        f'Prepared corpus {corpus.directory} was tokenized with tokenizer '
        f'{corpus.manifest["tokenizer"]["sha256"][:12]}, but this run '
        f'uses {tokenizer.path} ({sha[:12]}). Leave data.tokenizer empty '
        "to use the corpus' own, or prepare the corpus with this one."
      )


def prepared_eval(config, tokenizer, objective, process_index, process_count):
  """Eval batches of prepared corpora: {name: batches} per corpus.

  Each corpus' eval split is read in stored order from its start: the
  same rows and masks on every host count.
  """
  d = config.data
  stream = prepared_stream(config, objective.row_length, 'eval')
  sets = {}
  for corpus in stream.corpora:
    one = prepared.Stream([corpus], d.seed, split='eval')
    ds = prepared_dataset(
      config,
      tokenizer,
      objective,
      split='eval',
      process_index=process_index,
      process_count=process_count,
      stream=one,
      num_batches=d.eval_batches,
    )
    sets[corpus.entry.name] = list(ds.as_numpy_iterator())
  if len(sets) == 1:
    return next(iter(sets.values()))
  return sets


def tokens_per_source(
  config: ml_collections.ConfigDict, row_length: int, step: int
) -> dict[str, int]:
  """Row tokens each prepared corpus gave in steps [0, step) (metrics).

  data/tokens_<name>: rows x row length, [PAD] included; {} for a raw
  source, whose single stream is train/tokens already.
  """
  if not prepared.is_prepared(config.data.source):
    return {}
  entries = prepared.parse_source(config.data.source)
  stream = prepared.Stream(
    [prepared.Corpus.cached(e) for e in entries], config.data.seed
  )
  rows = stream.rows_read(step * config.data.batch_size)
  return {
    f'data/tokens_{e.name}': int(n) * row_length
    for e, n in zip(entries, rows, strict=True)
  }


def skipped_input(
  config: ml_collections.ConfigDict,
  process_index: int = 0,
  process_count: int = 1,
) -> dict[str, int]:
  """Training documents data.bad_input='skip' dropped, per kind (metrics).

  A prepared source reports what its preparation skipped, summed over its
  corpora.
  """
  if not prepared.is_prepared(config.data.source):
    return sources.skipped_input(config.data, process_index, process_count)
  counts = {}
  for entry in prepared.parse_source(config.data.source):
    manifest = prepared.Corpus.cached(entry).manifest
    for k, n in manifest.get('bad_input_counts', {}).items():
      counts[f'data/skipped_{k}'] = counts.get(f'data/skipped_{k}', 0) + n
  return counts
