"""Weights & Biases receives what metrics.jsonl gets, in one W&B run per
workdir across restarts."""

import glob
import json
import os
import sys

import pytest

from pretrain_lm import metrics


class FakeRun:
  def __init__(self, **kwargs):
    self.init = kwargs
    self.logged = []
    self.finished = False

  def log(self, data, step):
    self.logged.append({'step': step, **data})

  def finish(self):
    self.finished = True


def open_writer(workdir, **kwargs):
  return metrics.MetricWriter(
    workdir,
    total_steps=10,
    initial_step=0,
    enabled=True,
    progress_bar=False,
    **kwargs,
  )


def test_wandb_gets_the_scalars_and_a_restart_continues_its_run(
  tmp_path, monkeypatch
):
  wandb = pytest.importorskip('wandb')
  runs = []
  monkeypatch.setattr(
    wandb, 'init', lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
  )
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  config = {'train': {'num_steps': 10}}
  w = open_writer(workdir, wandb_project='proj', config=config)
  w.write(1, {'loss': 2.5, 'mfu': None})
  w.write(2, {'loss': float('nan'), 'grad_norm': 1.0})
  w.close()
  (run,) = runs
  assert run.init['project'] == 'proj' and run.init['entity'] is None
  assert run.init['name'] == 'run' and run.init['config'] == config
  assert run.init['resume'] == 'allow' and run.finished
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    written = [json.loads(line) for line in f]
  # The same scalars, with the ones JSON writes as null left out.
  assert run.logged == [
    {k: v for k, v in r.items() if v is not None} for r in written
  ]
  w = open_writer(workdir, wandb_project='proj', wandb_entity='team')
  w.close()
  assert (
    runs[1].init['id'] == run.init['id'] and runs[1].init['entity'] == 'team'
  )
  assert not open_writer(str(tmp_path / 'off'))._wandb  # '' logs nowhere


def test_wandb_offline_writes_its_run_files(tmp_path, monkeypatch):
  pytest.importorskip('wandb')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  w = open_writer(workdir, wandb_project='proj', config={'a': 1})
  for step in (1, 2, 3):
    w.write(step, {'loss': 1.0 / step})
  w.close()
  (run_file,) = glob.glob(
    os.path.join(workdir, 'wandb', 'offline-run-*', '*.wandb')
  )
  assert os.path.getsize(run_file) > 0


def test_missing_wandb_names_the_extra(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)
  with pytest.raises(ImportError, match='needs the wandb package'):
    open_writer(str(tmp_path), wandb_project='proj')
