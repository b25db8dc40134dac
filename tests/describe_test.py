"""`python -m pretrain_lm.describe WORKDIR`: what each checkpoint says."""

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import pytest

import pretrain_lm
from pretrain_lm import checkpoint
from pretrain_lm import describe as describe_lib
from pretrain_lm import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def trained(tiny_workdir):
  return tiny_workdir('bert')


def test_describe_lists_checkpoints_and_describes_one(trained):
  d = describe_lib.describe(trained)
  assert [c['step'] for c in d['checkpoints']] == [4] and d['step'] == 4
  listed = d['checkpoints'][0]
  assert listed['bytes'] > 100_000 and listed['saved'].endswith('Z')
  assert 'eval_loss' in listed['eval']
  c = d['checkpoint']
  assert c['recorded'] and c['git_commit'] == workdir_lib.git_commit()
  assert c['versions']['jax'] == jax.__version__
  assert c['mesh'] == {'data': 8, 'fsdp': 1, 'tensor': 1}
  assert c['process_count'] == 1 and c['device_count'] == 8
  assert c['config_diff_vs_config_json'] == {}
  assert c['tokenizer']['matches_workdir_file'] is True
  meta = checkpoint.read_meta(f'{trained}/checkpoints', 4)
  assert c['data']['fingerprint'] == meta['data']['fingerprint']
  # The param summary, from metadata alone, is the loaded params'.
  params = pretrain_lm.load(trained).params
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  want = {
    jax.tree_util.keystr(p, simple=True, separator='/'): [
      list(x.shape),
      str(x.dtype),
    ]
    for p, x in flat
  }
  assert {n: [s, t] for n, s, t in c['params']['arrays']} == want
  assert c['params']['count'] == sum(math.prod(x.shape) for _, x in flat)
  text = describe_lib.format_text(d)
  for part in (
    'step        4',
    f'git commit:   {c["git_commit"]}',
    'data=8 x fsdp=1 x tensor=1',
    'the same as config.json',
    'data.seq_len = 64',
    'token_embed/embedding',
    f'{c["params"]["count"]:,}',
  ):
    assert part in text, (part, text)


def test_config_diff_and_missing_checkpoints(trained, tmp_path, capsys):
  work = str(tmp_path / 'run')
  shutil.copytree(trained, work)
  config = workdir_lib.read_json(f'{work}/config.json')
  config['optimizer']['learning_rate'] = 0.5
  workdir_lib.write_json(f'{work}/config.json', config)
  diff = describe_lib.describe(work)['checkpoint']['config_diff_vs_config_json']
  assert list(diff) == ['optimizer.learning_rate'] and diff[
    'optimizer.learning_rate'
  ][1] == (0.5)

  empty = tmp_path / 'empty'
  empty.mkdir()
  assert describe_lib.main([str(empty)]) == 1
  err = capsys.readouterr().err
  assert 'No checkpoint in' in err and str(empty) in err, err
  assert describe_lib.main([work, '--step=3']) == 1
  assert 'there are [4]' in capsys.readouterr().err


def test_command_line_prints_json(trained):
  result = subprocess.run(
    [sys.executable, '-m', 'pretrain_lm.describe', trained, '--json'],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    # As a user runs it: no fake devices, nothing set up for JAX.
    env={
      k: v for k, v in os.environ.items() if not k.startswith(('XLA', 'JAX'))
    },
  )
  assert result.returncode == 0, result.stderr
  d = json.loads(result.stdout)
  assert d['step'] == 4 and d['checkpoint']['params']['count'] > 0
