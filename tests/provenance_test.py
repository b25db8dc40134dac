"""Tests for pretrain_lm.data.provenance: the documents behind a step.

The check is against what training reads: every segment of every row of
the batch the pipeline gives at step N is a run of the tokens of the
document provenance names for that row.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, load_config

from pretrain_lm import configlib, objectives
from pretrain_lm.data import pipeline, prepare, provenance
from pretrain_lm.data import tokenizer as tokenizer_lib

WIKI = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')
SEQ_LEN = 64
BATCH = 8


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp('provenance')
  with open(WIKI, 'rb') as f:
    text = f.read(60_000)
  corpus = root / 'wiki.txt'
  corpus.write_bytes(text[: text.rindex(b'\n') + 1])
  lines = [t for t in text.decode('utf-8', 'ignore').split('\n') if t.strip()]
  tok = tokenizer_lib.train_tokenizer(
    lines, str(root / 'tok.model'), vocab_size=512, model_type='bpe'
  )
  c = load_config('bert', 'size=tiny')
  c.model.vocab_size = 512
  c.data.update(
    source=str(corpus),
    eval_source='',
    eval_holdout_every=10,
    seq_len=SEQ_LEN,
    batch_size=BATCH,
    eval_batches=1,
    tokenizer=tok.path,
  )
  prepare.prepare(
    c,
    str(root / 'prepared'),
    objectives.row_transform(c),
    range_mb=0.02,
    beam_options='--direct_running_mode=in_memory',
    progress=False,
  )
  c.data.source = f'prepared:{root / "prepared"}'
  c.data.tokenizer = ''
  return c, tok


def _segments(row_ids, segment_ids, tok):
  """The content tokens of each segment of a row, in order."""
  special = {tok.cls_id, tok.sep_id, tok.pad_id}
  out = []
  for s in range(1, segment_ids.max() + 1):
    ids = row_ids[segment_ids == s]
    out.append([int(i) for i in ids if int(i) not in special])
  return out


def _contains(haystack, needle):
  n = len(needle)
  return any(
    haystack[i : i + n] == needle for i in range(len(haystack) - n + 1)
  )


@pytest.mark.parametrize('step', [0, 3, 100])
def test_documents_are_the_ones_the_batch_was_made_of(run, step):
  c, tok = run
  rows = provenance.batch_documents(c, step)
  batch = next(
    pipeline.train_iterator(
      c, tok, objectives.row_transform(c), start_batch=step
    )
  )
  ids = batch['input_ids'].copy()
  for b in range(BATCH):  # undo the MLM masking
    real = batch['masked_weights'][b] > 0
    ids[b, batch['masked_positions'][b, real]] = batch['masked_ids'][b, real]
  assert len(rows) == BATCH
  for b, row in enumerate(rows):
    docs = [tok.encode(d['text']) for d in row['documents']]
    for segment in _segments(ids[b], batch['segment_ids'][b], tok):
      # A segment is a piece of one of the row's documents.
      assert any(_contains(doc, segment) for doc in docs), (b, segment)
    assert all(d['path'].endswith('wiki.txt') for d in row['documents'])


def test_the_command_line_prints_the_batch(run, tmp_path):
  c, _ = run
  out = subprocess.run(
    [
      sys.executable,
      '-m',
      'pretrain_lm.data.show_batch',
      f'--config={REPO}/configs/bert.py:size=tiny',
      f'--config.data.source={c.data.source}',
      f'--config.data.seq_len={SEQ_LEN}',
      f'--config.data.batch_size={BATCH}',
      '--config.model.vocab_size=512',
      '--step=3',
      '--json',
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    check=True,
  )
  lines = [x for x in out.stdout.splitlines() if x.startswith('{')]
  want = provenance.batch_documents(c, 3)
  got = [json.loads(x) for x in lines]
  assert [g['row'] for g in got] == [w['row'] for w in want]
  assert got[0]['documents'] == want[0]['documents']


def test_raw_sources_are_refused(run):
  c, _ = run
  raw = c.copy_and_resolve_references()
  raw.data.source = WIKI
  with pytest.raises(ValueError, match='only prepared corpora'):
    provenance.batch_documents(raw, 0)
