r"""Prints the documents behind the global batch of a step (prepared data).

  python -m pretrain_lm.data.show_batch --config=configs/bert.py:size=base \
      --config.data.source=prepared:gs://bucket/c4 --step=41200 [--json]

The config is the run's (its data.source, batch_size and seed decide the
batch); nothing is trained and no checkpoint is read.
"""

import json

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'The run config, e.g. configs/bert.py:size=base.'
)
_STEP = flags.DEFINE_integer('step', None, 'The train step (global batch).')
_JSON = flags.DEFINE_bool('json', False, 'One JSON line per row.')
flags.mark_flags_as_required(['config', 'step'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from pretrain_lm.data import provenance

  try:
    rows = provenance.batch_documents(_CONFIG.value, _STEP.value)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None
  for i, row in enumerate(rows):
    if _JSON.value:
      print(json.dumps({'index': i, **row}))
      continue
    print(
      f'row {i}: {row["corpus"]} row {row["row"]} ({row["shard"]}, '
      f'epoch {row["epoch"]})'
    )
    for doc in row['documents']:
      where = doc.get('offset', doc.get('example'))
      print(f'  {doc["path"]} @ {where}: {doc.get("text", "")[:200]!r}')


if __name__ == '__main__':
  app.run(main)
