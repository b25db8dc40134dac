"""The data stream a run reads, as a fingerprint its checkpoints store.

Resuming checks the saved fields against the run's (train.Trainer): a
changed source, tokenizer, packing, length, batch, seed or objective field
would silently feed other batches than the run was trained on.
"""

import concurrent.futures
import hashlib
import json
import os
from typing import Any

import ml_collections
from etils import epath

from pretrain_lm.data import pipeline, prepared, records, sources

# objective.* fields that only a loss reads: changing one mid-run leaves
# every batch as it was, so they are not part of the data stream.
LOSS_ONLY_FIELDS = ('disc_weight', 'cross_entropy')


def _files_identity(source: str) -> str:
  """A local/gs:// source by its files' names, slices and sizes.

  Not their directories, so a corpus copied elsewhere (gs:// to a local
  disk) is the same stream; not their content, which would read the whole
  corpus at every start. An edit that keeps every size goes unnoticed.
  """
  # The files the pipeline reads, in its order (data/sources resolves them).
  files = sources.match_files(source, 'data.source')
  # Stats run one by one would take minutes for thousands of gs:// shards.
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    sizes = list(pool.map(lambda f: epath.Path(f.path).stat().length, files))
  ids = [
    [os.path.basename(f.path), f.start, f.stop, size]
    for f, size in zip(files, sizes, strict=True)
  ]
  digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]
  return f'{len(files)} file(s), {sum(sizes)} bytes, id {digest}'


def data_stream(
  config: ml_collections.ConfigDict, tokenizer, process_count: int
) -> dict[str, Any]:
  """The fields that decide which batch each train step reads.

  Returns {'fields': {name: value}, 'fingerprint': their hash, 'source':
  data.source}. Eval-only fields are not in it, nor train.num_steps except
  through the steps a data.seq_len_schedule stage starts at.
  """
  d = config.data
  if prepared.is_prepared(d.source):
    return _digest(_prepared_fields(config, tokenizer), d.source)
  tfds = d.source.startswith(sources.TFDS_PREFIX)
  fields = {
    'data.source': d.source if tfds else _files_identity(d.source),
    # Without an eval source, every n-th document is held out of training.
    'data.eval_holdout_every': (
      0 if sources.eval_source(d) else d.eval_holdout_every
    ),
    'data.packing': d.packing,
    'data.seq_len': d.seq_len,
    # Resolved to [first step, row length, first batch] per stage: they
    # move with train.num_steps.
    'data.seq_len_schedule': (
      [
        [begin, length, pipeline.stage_at(config, begin)[3]]
        for begin, _, length in pipeline.seq_len_stages(config)
      ]
      if d.seq_len_schedule
      else ''
    ),
    'data.batch_size': d.batch_size,
    'data.shuffle_buffer': d.shuffle_buffer,
    'data.seed': d.seed,
    'tokenizer.sha256': records.tokenizer_meta(tokenizer)['sha256'],
    # Each host reads its own shard of the documents.
    'process_count': process_count,
  }
  if tfds:
    fields.update(
      {'data.tfds_split': d.tfds_split, 'data.tfds_text_key': d.tfds_text_key}
    )
  else:
    fields['data.doc_format'] = d.doc_format
    # Longer documents are dropped (data.bad_input='skip'): fewer rows.
    fields['data.max_doc_bytes'] = d.get('max_doc_bytes')
  fields.update(_objective_fields(config))
  return _digest(fields, d.source)


def _objective_fields(config: ml_collections.ConfigDict) -> dict[str, Any]:
  return {
    f'objective.{k}': v
    for k, v in config.objective.to_dict().items()
    if k not in LOSS_ONLY_FIELDS
  }


def _prepared_fields(config: ml_collections.ConfigDict, tokenizer):
  """A prepared stream's fields: no host count, which it does not depend on.

  Each corpus is named by its manifest's key (what was prepared, from
  which files, with which tokenizer) and row count, not by its directory,
  so a corpus copied elsewhere is the same stream.
  """
  d = config.data
  corpora = []
  for entry in prepared.parse_source(d.source):
    manifest = records.read_manifest(entry.directory)
    corpora.append(
      [
        entry.name,
        round(entry.weight, 6),
        manifest.get('key', ''),
        manifest['splits']['train']['rows'],
      ]
    )
  return {
    'data.source': corpora,
    'data.seq_len': d.seq_len,
    'data.packing': d.packing,
    'data.batch_size': d.batch_size,
    'data.seed': d.seed,
    'tokenizer.sha256': records.tokenizer_meta(tokenizer)['sha256'],
    **_objective_fields(config),
  }


def _digest(fields: dict[str, Any], source: str) -> dict[str, Any]:
  # As a checkpoint stores them (tuples become lists), so they compare.
  fields = json.loads(json.dumps(fields, sort_keys=True, default=str))
  digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
  return {
    'fields': fields,
    'fingerprint': digest.hexdigest()[:16],
    'source': source,
  }


def changed_fields(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
  """'name: saved -> now' for each saved field whose value differs.

  A field the checkpoint lacks (added to the data stream after it was
  written) is not counted as a change.
  """
  return [
    f'{k}: {saved[k]!r} -> {now.get(k, "(none)")!r}'
    for k in sorted(saved)
    if saved[k] != now.get(k, '(none)')
  ]
