r"""Raw text -> tokenized, packed ArrayRecord shards + manifest (Apache Beam).

  python -m pretrain_lm.data.prepare --config=configs/bert.py:size=tiny \
      --output=/tmp/wiki_prepared [--config.data.seq_len=256] \
      [--range_mb=128] [--tfds_pieces=64] [--overwrite] \
      [--beam_pipeline_options='--direct_num_workers=4']

The config's `data` section names the input exactly as training reads it
(data.source, data.eval_source as sources.eval_source reads it,
doc_format, bad_input, max_doc_bytes, tfds_*), and its tokenizer
(data.tokenizer, or one trained on the source as a run would) is resolved
into OUTPUT/tokenizer.model first. The layout
of OUTPUT is pretrain_lm.data.records'; besides it, `stats/` holds one JSON
sidecar per input range (what `manifest.json` is assembled from).

Input ranges are fixed when the pipeline is built, from file sizes alone:
with doc_format 'line' an unsliced file is cut into byte ranges of about
--range_mb MiB (a range owns the lines whose first byte it holds); a
'blank_line' or 'file' file, or a sliced one ('a.txt[:90%]'), is one range;
a 'tfds:' source is --tfds_pieces pieces of its split. Range i of
data.source writes shard i of 'train' and, where there is no eval source,
shard i of 'eval' with every data.eval_holdout_every-th document of the
range (counted within the range). Where data.eval_source is set, its
ranges write the 'eval' shards and data.source's write no eval shard. A
shard's rows are `packing.pack` over its range's documents, exactly as the
raw-text pipeline packs them, written one by one as they are made.
(Ranges and their documents: pretrain_lm.data.ranges; a range's shards
and sidecar: pretrain_lm.data.shards; this module is the driver.)

Restarts: each shard is written under a temporary name and renamed into
place; then its range's sidecar records the shards' sizes and hashes and a
key (the preparation's fields, the tokenizer's hash, the range). A rerun
skips every range whose sidecar has its key and whose shards have the
recorded sizes, so a preparation killed at any point and rerun ends with
the same bytes as one never interrupted. `manifest.json` is written last,
from the sidecars, only after every range is done; a rerun of a finished
preparation with the same key does nothing.

Engine: Beam's DirectRunner on all local cores by default. Anything in
--beam_pipeline_options overrides that, e.g. Dataflow:

  --beam_pipeline_options='--runner=DataflowRunner --project=P --region=R
    --temp_location=gs://B/tmp --extra_package=dist/pretrain_lm-0.1.0.tar.gz
    --requirements_file=requirements.txt'

Dataflow workers need this package (the repository has no setup.py: build
an sdist with `python -m build --sdist` and pass it as --extra_package, or
use a custom --sdk_container_image with it installed), the same versions
of tensorflow, tensorflow-text and array_record as here, and a gs:// output
and source they can read.
"""

import hashlib
import json
import os
import shlex
import sys
import threading
import time
from typing import Any

import apache_beam as beam
import ml_collections
import tensorflow as tf
from absl import app, flags, logging
from apache_beam.options.pipeline_options import PipelineOptions

from pretrain_lm.data import (
  fingerprint,
  packing,
  ranges,
  records,
  rows,
  shards,
  sources,
)
from pretrain_lm.data import tokenizer as tokenizer_lib

DEFAULT_BEAM_OPTIONS = (
  '--direct_running_mode=multi_processing',
  '--direct_num_workers=0',
  # Workers log every bundle at INFO; the driver shows progress instead.
  '--default_sdk_harness_log_level=WARNING',
)


def _sha256_json(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


class WriteShardFn(beam.DoFn):
  """Writes one input range's shards, then its stats sidecar."""

  def __init__(self, output: str, settings: dict[str, Any]):
    self.output, self.settings = output, settings

  def setup(self):
    path = os.path.join(self.output, records.TOKENIZER_FILE)
    self.tokenizer = tokenizer_lib.load_tokenizer(path)
    sha = hashlib.sha256(self.tokenizer.model_bytes()).hexdigest()
    if sha != self.settings['tokenizer_sha256']:
      raise ValueError(f'{path} changed while the preparation ran.')

  def process(self, r: dict[str, Any]):
    if shards.range_done(self.output, r):
      return
    shards.write_range(self.output, r, self.settings, self.tokenizer)
    yield r['task']


# ---------------------------------------------------------------------------
# The driver.


def _settings(
  config: ml_collections.ConfigDict, row_len: int, tok_sha: str
) -> dict:
  """What the workers need of the config, as plain data."""
  d = config.data
  return {
    'doc_format': d.doc_format,
    'max_doc_bytes': d.max_doc_bytes,
    'bad_input': d.bad_input,
    'eval_holdout_every': 0 if sources.eval_source(d) else d.eval_holdout_every,
    'row_len': row_len,
    'packing': d.packing,
    'tfds_data_dir': d.tfds_data_dir,
    'tfds_text_key': d.tfds_text_key,
    'tokenizer_sha256': tok_sha,
  }


def _fingerprint(spec: str, split: str) -> str:
  if not spec:
    return ''
  if sources.is_tfds(spec):
    return f'{spec} split {split}'
  return fingerprint._files_identity(spec)


def _source_fields(
  config: ml_collections.ConfigDict, range_mb: float, tfds_pieces: int
) -> dict[str, Any]:
  d = config.data
  eval_spec = sources.eval_source(d)
  return {
    'spec': d.source,
    'eval_spec': eval_spec,
    'eval_holdout_every': 0 if eval_spec else d.eval_holdout_every,
    'doc_format': d.doc_format,
    'max_doc_bytes': d.max_doc_bytes,
    'bad_input': d.bad_input,
    'fingerprint': _fingerprint(d.source, d.tfds_split),
    'eval_fingerprint': _fingerprint(eval_spec, d.tfds_eval_split),
    'range_mb': range_mb,
    'tfds_pieces': tfds_pieces,
    'tfds_text_key': d.tfds_text_key,
  }


def key_fields(manifest: dict[str, Any]) -> dict[str, Any]:
  """The manifest fields that decide its shards' bytes, flat."""
  fields = {
    k: manifest[k]
    for k in ('format', 'version', 'row_length', 'seq_len', 'packing')
  }
  fields['objective'] = manifest['objective']
  fields['tokenizer.sha256'] = manifest['tokenizer']['sha256']
  for k, v in manifest['source'].items():
    fields[f'source.{k}'] = v
  # As JSON stores them, so a read-back manifest compares equal.
  return json.loads(json.dumps(fields))


def _check_previous(
  output: str, fields: dict[str, Any], overwrite: bool
) -> dict[str, Any] | None:
  """The finished preparation in `output` if it has these fields.

  A different one fails naming what differs, unless `overwrite`, which
  removes it (saying what it removes).
  """
  path = os.path.join(output, records.MANIFEST)
  if not tf.io.gfile.exists(path):
    return None
  old = records.read_manifest(output)
  old_fields = key_fields(old)
  if old_fields == fields:
    return old
  changed = [
    f'{k}: {old_fields.get(k, "(none)")!r} -> {fields.get(k, "(none)")!r}'
    for k in sorted(set(old_fields) | set(fields))
    if old_fields.get(k, '(none)') != fields.get(k, '(none)')
  ]
  if not overwrite:
    raise ValueError(
      f'{output} holds another preparation ({"; ".join(changed)}). Use '
      'another --output, or pass --overwrite to replace it.'
    )
  doomed = [path, os.path.join(output, records.TOKENIZER_FILE)]
  doomed += tf.io.gfile.glob(os.path.join(output, '*.array_record'))
  doomed += tf.io.gfile.glob(os.path.join(output, shards.STATS_DIR, '*.json'))
  print(
    f'--overwrite: removing the preparation in {output} ({"; ".join(changed)}):'
  )
  for p in doomed:
    if tf.io.gfile.exists(p):
      print(f'  rm {p}')
      tf.io.gfile.remove(p)
  return None


def _tokenizer_sha(config, output: str) -> str | None:
  """The sha256 the tokenizer will have, None if it is yet to be trained."""
  existing = os.path.join(output, records.TOKENIZER_FILE)
  # data.tokenizer first: a run would find the output's and keep it.
  for path in (config.data.tokenizer, existing):
    if path and tf.io.gfile.exists(path):
      return records.file_sha256(path)
  return None


def _check_config(config: ml_collections.ConfigDict) -> None:
  d = config.data
  checks = [
    ('doc_format', d.doc_format, sources.DOC_FORMATS),
    ('bad_input', d.bad_input, sources.BAD_INPUT_POLICIES),
    ('packing', d.packing, packing.PACKINGS),
  ]
  for field, value, valid in checks:
    if value not in valid:
      raise ValueError(f'data.{field}={value!r} is not one of {valid}.')
  if not sources.eval_source(d) and d.eval_holdout_every < 2:
    raise ValueError(
      f'data.eval_holdout_every={d.eval_holdout_every} must be >= 2 (or set '
      'data.eval_source), else nothing is left to train on.'
    )
  if not d.source.strip():
    raise ValueError('data.source is empty; name text files or a TFDS dataset.')


class _Progress:
  """Polls the sidecars in a thread and shows shards, MB, MB/s and ETA."""

  def __init__(self, output: str, todo: list[dict[str, Any]], enabled: bool):
    self.output, self.todo, self.enabled = output, todo, enabled
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._run, daemon=True)

  def __enter__(self):
    if self.enabled and self.todo:
      self.thread.start()
    return self

  def __exit__(self, *exc):
    self.stop.set()
    if self.thread.is_alive():
      self.thread.join()

  def _run(self):
    import tqdm

    keys = {r['task']: r for r in self.todo}
    done, docs = set(), 0
    bar = tqdm.tqdm(
      total=sum(r['bytes'] for r in self.todo),
      unit='B',
      unit_scale=True,
      desc='prepare',
      file=sys.stderr,
    )
    with bar:
      while True:
        stopping = self.stop.wait(2.0)
        pattern = os.path.join(self.output, shards.STATS_DIR, '*.json')
        for path in tf.io.gfile.glob(pattern):
          task = os.path.basename(path)[: -len('.json')]
          if task in done or task not in keys:
            continue
          stats = shards.read_json(path)
          if stats and stats.get('key') == keys[task]['key']:
            done.add(task)
            docs += sum(s['documents'] for s in stats['shards'].values())
            bar.update(keys[task]['bytes'])
        bar.set_postfix_str(f'shards {len(done)}/{len(keys)}, {docs} docs')
        if stopping:
          return


def prepare(
  config: ml_collections.ConfigDict,
  output: str,
  objective: rows.RowTransform,
  *,
  range_mb: float = 128,
  tfds_pieces: int = 16,
  beam_options: str = '',
  overwrite: bool = False,
  progress: bool = True,
) -> dict[str, Any]:
  """Prepares `config`'s data into `output`; returns the manifest.

  Args:
    config: a run config (uses `data`, `objective` and model.vocab_size).
    output: the directory (local or gs://) to write.
    objective: the run objective's row length and reserved ids
      (objectives.row_transform(config)).
    range_mb: the size of the byte ranges 'line' files are cut into.
    tfds_pieces: the pieces a TFDS split is read in.
    beam_options: Beam flags, shlex-split, over DEFAULT_BEAM_OPTIONS.
    overwrite: replace a finished preparation with another key.
    progress: show a progress bar while the pipeline runs.
  """
  _check_config(config)
  d = config.data
  row_len = objective.row_length
  tf.io.gfile.makedirs(os.path.join(output, shards.STATS_DIR))
  source = _source_fields(config, range_mb, tfds_pieces)

  def fields_for(tok_sha):
    tokenizer = {'sha256': tok_sha or '(to be trained)'}
    return key_fields(_header(config, row_len, source, tokenizer))

  # Before the tokenizer is resolved: a differing OUTPUT/tokenizer.model
  # must not be silently kept (setup_tokenizer would reuse it).
  old = _check_previous(
    output, fields_for(_tokenizer_sha(config, output)), overwrite
  )
  if old is not None:
    print(f'{output} is already prepared with this key ({old["key"]}).')
    return old
  _check_unfinished_tokenizer(d, output, overwrite)
  tok = tokenizer_lib.setup_tokenizer(
    d,
    vocab_size=config.model.vocab_size,
    workdir=output,
    reserved_ids=objective.reserved_ids,
  )
  meta = records.tokenizer_meta(tok)
  fields = fields_for(meta['sha256'])
  all_ranges = _keyed_ranges(d, fields, range_mb, tfds_pieces)
  todo = _ranges_to_write(output, all_ranges)
  settings = _settings(config, row_len, meta['sha256'])
  started = time.time()
  if todo:
    _write_ranges(output, todo, settings, beam_options, progress)
  seconds = time.time() - started
  kept = ('sha256', 'vocab_size', 'special_ids')
  tokenizer = {'file': records.TOKENIZER_FILE, **{k: meta[k] for k in kept}}
  manifest = _manifest(
    _header(config, row_len, source, tokenizer),
    output,
    all_ranges,
    key=_sha256_json(fields)[:16],
  )
  if not manifest['splits']['train']['rows']:
    raise ValueError(
      f'data.source={d.source!r} gave no training rows (bad input skipped: '
      f'{sources.count_summary(manifest["bad_input_counts"])}).'
    )
  manifest['created'] = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())
  records.write_json_atomic(os.path.join(output, records.MANIFEST), manifest)
  _remove_leftovers(output)
  _print_summary(output, manifest, todo, seconds)
  return manifest


def _header(
  config: ml_collections.ConfigDict,
  row_len: int,
  source: dict[str, Any],
  tokenizer: dict[str, Any],
) -> dict[str, Any]:
  """The manifest's fields but its counts and key, with `tokenizer`."""
  return {
    'format': records.FORMAT,
    'version': records.VERSION,
    'row_length': row_len,
    'seq_len': config.data.seq_len,
    'packing': config.data.packing,
    'objective': config.objective.name,
    'tokenizer': tokenizer,
    'source': source,
  }


def _check_unfinished_tokenizer(d, output: str, overwrite: bool) -> None:
  """An unfinished preparation's tokenizer must be data.tokenizer's."""
  existing = os.path.join(output, records.TOKENIZER_FILE)
  if (
    d.tokenizer
    and tf.io.gfile.exists(existing)
    and records.file_sha256(existing) != records.file_sha256(d.tokenizer)
  ):
    if not overwrite:
      raise ValueError(
        f'{existing} (from an unfinished preparation) is not '
        f'data.tokenizer={d.tokenizer!r}; pass --overwrite to replace it.'
      )
    print(f'--overwrite: rm {existing}')
    tf.io.gfile.remove(existing)


def _keyed_ranges(
  d, fields: dict[str, Any], range_mb: float, tfds_pieces: int
) -> list[dict[str, Any]]:
  """The input ranges, each keyed by the preparation's fields and itself."""
  all_ranges = ranges.make_ranges(d, range_mb, tfds_pieces)
  for r in all_ranges:
    r['key'] = _sha256_json({'fields': fields, 'range': r})[:16]
  return all_ranges


def _ranges_to_write(
  output: str, all_ranges: list[dict[str, Any]]
) -> list[dict[str, Any]]:
  """The ranges without finished shards of their key in `output`."""
  todo, stale = [], []
  for r in all_ranges:
    if not shards.range_done(output, r):
      todo.append(r)
      old_stats = shards.read_json(shards.sidecar_path(output, r))
      if old_stats and old_stats.get('key') != r['key']:
        stale.append(r['task'])
  if stale:
    # Only an unfinished preparation (no manifest) gets here: say so anyway.
    print(
      f'Rewriting {len(stale)} range(s) an unfinished preparation with '
      f'other settings left (e.g. {stale[0]}).'
    )
  return todo


def _write_ranges(
  output: str,
  todo: list[dict[str, Any]],
  settings: dict[str, Any],
  beam_options: str,
  progress: bool,
) -> None:
  """The Beam graph: spread the ranges over workers, each writes its shards."""
  options = PipelineOptions([*DEFAULT_BEAM_OPTIONS, *shlex.split(beam_options)])
  with _Progress(output, todo, progress), beam.Pipeline(options=options) as p:
    _ = (
      p
      | 'Ranges' >> beam.Create(todo)
      | 'Spread' >> beam.Reshuffle()
      | 'Write' >> beam.ParDo(WriteShardFn(output, settings))
    )


def _manifest(
  header: dict[str, Any],
  output: str,
  all_ranges: list[dict[str, Any]],
  *,
  key: str,
) -> dict[str, Any]:
  """The manifest: `header` and the counts and shards of every range."""
  manifest = {
    **header,
    'bad_input_counts': dict.fromkeys(sources.BAD_INPUT, 0),
    'splits': {
      s: {'rows': 0, 'tokens': 0, 'documents': 0, 'shards': []}
      for s in records.SPLITS
    },
    'key': key,
  }
  for r in all_ranges:
    stats = shards.range_done(output, r)
    if stats is None:
      raise RuntimeError(
        f'{r["task"]} has no finished shards after the pipeline ran '
        f'({shards.sidecar_path(output, r)} is missing or stale).'
      )
    for k, n in stats['bad_input_counts'].items():
      manifest['bad_input_counts'][k] += n
    for split, shard in stats['shards'].items():
      total = manifest['splits'][split]
      for k in ('rows', 'tokens', 'documents'):
        total[k] += shard[k]
      total['shards'].append({**shard, 'input': stats['input']})
  return manifest


def _remove_leftovers(output: str) -> None:
  """Removes the temporary files interrupted runs left in `output`."""
  # Left by interrupted runs; nothing writes them once the pipeline is done.
  leftovers = tf.io.gfile.glob(os.path.join(output, f'*{shards.TMP}*'))
  # records.write_json_atomic's, of sidecars.
  leftovers += tf.io.gfile.glob(
    os.path.join(output, shards.STATS_DIR, '*.tmp-*')
  )
  for path in leftovers:
    print(f'Removing {path}, left by an interrupted run.')
    tf.io.gfile.remove(path)


def _print_summary(
  output: str,
  manifest: dict[str, Any],
  todo: list[dict[str, Any]],
  seconds: float,
) -> None:
  """One line: the input written, its speed and the rows made."""
  mb = sum(r['bytes'] for r in todo) / 1e6
  train = manifest['splits']['train']
  print(
    f'Prepared {output}: {mb:.1f} MB in {seconds:.1f} s '
    f'({mb / max(seconds, 1e-9):.2f} MB/s), {train["rows"]} train rows, '
    f'{train["tokens"]} tokens; eval {manifest["splits"]["eval"]["rows"]} '
    'rows.'
  )


def _define_flags():
  """The CLI's flags (defined only when run: tests import this module)."""
  from ml_collections import config_flags

  config = config_flags.DEFINE_config_file(
    'config',
    None,
    'Config file, e.g. configs/bert.py:size=tiny.',
    lock_config=True,
  )
  output = flags.DEFINE_string('output', None, 'Directory to write (or gs://).')
  flags.DEFINE_string(
    'beam_pipeline_options', '', 'Extra Beam flags, e.g. --runner=...'
  )
  flags.DEFINE_float('range_mb', 128, "MiB per input range of 'line' files.")
  flags.DEFINE_integer('tfds_pieces', 16, 'Pieces a TFDS split is read in.')
  flags.DEFINE_boolean(
    'overwrite', False, 'Replace a finished preparation with another key.'
  )
  flags.mark_flags_as_required(['config', 'output'])
  return config, output


def main(argv, config_flag, output_flag, row_transform):
  """The command line; `row_transform(config)` resolves the objective."""
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  try:
    prepare(
      config_flag.value,
      output_flag.value,
      row_transform(config_flag.value),
      range_mb=f.range_mb,
      tfds_pieces=f.tfds_pieces,
      beam_options=f.beam_pipeline_options,
      overwrite=f.overwrite,
    )
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None


def _parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with a clear message for a mistyped config field."""
  from pretrain_lm import validate

  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise SystemExit(f'error: {validate.unknown_override(argv) or e}') from None


if __name__ == '__main__':
  # Beam pickles the DoFn by reference: it must live in the module's real
  # name, not in __main__, for worker processes to import it.
  # The program resolves the objective; the library takes it as an argument.
  from pretrain_lm import objectives
  from pretrain_lm.data import prepare as _module

  _config, _output = _define_flags()
  logging.set_verbosity(logging.WARNING)
  app.run(
    lambda argv: _module.main(argv, _config, _output, objectives.row_transform),
    flags_parser=_parse_flags,
  )
