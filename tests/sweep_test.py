"""pretrain_lm.sweep: building, naming, validating, running, summarizing."""

import csv
import io
import json
import os
import re
import shlex

import pytest
from conftest import COMPILE_FLAGS, read_metrics

from pretrain_lm import sweep
from pretrain_lm.sweep import launchers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SWEEP = os.path.join(REPO, 'experiments', 'sweeps', 'tiny_lr.py')
BERT_SWEEP = os.path.join(REPO, 'experiments', 'sweeps', 'bert_lr.py')
# The tiny_workdir fixture's shrunk settings, as command-line overrides.
TINY = [
  '--config.model.vocab_size=640',
  '--config.data.tokenizer_max_docs=2000',
  '--config.data.seq_len=64',
  '--config.data.batch_size=8',
  '--config.data.shuffle_buffer=64',
  '--config.data.eval_batches=1',
  '--config.train.num_steps=2',
  '--config.train.log_every=2',
  '--config.train.eval_every=2',
  '--config.train.progress_bar=false',
  '--config.checkpoint.every=2',
  '--config.checkpoint.async_save=false',
]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
  """Config paths like configs/bert.py are relative to the repository."""
  monkeypatch.chdir(REPO)


def write_sweep(tmp_path, body: str) -> str:
  path = tmp_path / 'my_sweep.py'
  path.write_text(
    f'from pretrain_lm import sweep\n\n\ndef get_sweep():\n  return {body}\n'
  )
  return str(path)


def test_choice_product_zip():
  lr = sweep.choice('optimizer.learning_rate', [1e-4, 3e-4])
  steps = sweep.choice('train.num_steps', [10, 20, 30])
  assert lr == [
    {'optimizer.learning_rate': 1e-4},
    {'optimizer.learning_rate': 3e-4},
  ]
  runs = sweep.product(lr, steps)
  assert len(runs) == 6
  # The first factor varies slowest.
  assert runs[:3] == [
    {'optimizer.learning_rate': 1e-4, 'train.num_steps': n}
    for n in (10, 20, 30)
  ]
  assert sweep.zip(lr, sweep.choice('train.seed', [1, 2])) == [
    {'optimizer.learning_rate': 1e-4, 'train.seed': 1},
    {'optimizer.learning_rate': 3e-4, 'train.seed': 2},
  ]
  # They nest: each zipped pair with each seed.
  nested = sweep.product(
    sweep.zip(lr, sweep.choice('optimizer.warmup_steps', [1, 2])),
    sweep.choice('train.seed', [0, 1]),
  )
  assert [tuple(r.values()) for r in nested] == [
    (1e-4, 1, 0),
    (1e-4, 1, 1),
    (3e-4, 2, 0),
    (3e-4, 2, 1),
  ]
  with pytest.raises(sweep.SweepError, match=r'different lengths \[2, 3\]'):
    sweep.zip(lr, steps)
  with pytest.raises(sweep.SweepError, match="'optimizer.learning_rate'"):
    sweep.product(lr, lr)
  with pytest.raises(sweep.SweepError, match='at least one value'):
    sweep.choice('train.seed', [])
  with pytest.raises(sweep.SweepError, match='must be a list'):
    sweep.choice('data.source', 'a.txt')


def test_run_names_are_short_safe_unique_and_deterministic():
  runs = sweep.product(
    sweep.choice('optimizer.learning_rate', [0.0003, 1e-05]),
    sweep.choice('train.num_steps', [100]),
  )
  assert sweep.run_names(runs) == [
    'learning_rate=0.0003-num_steps=100',
    'learning_rate=1e-05-num_steps=100',
  ]
  # Two fields ending in the same name keep their full names.
  runs = [{'model.dropout_rate': 0.1, 'x.dropout_rate': 0.2, 'train.seed': 1}]
  assert sweep.run_names(runs) == [
    'model.dropout_rate=0.1-x.dropout_rate=0.2-seed=1'
  ]
  # Path separators and spaces go; values that then collide get a hash.
  runs = sweep.choice('data.source', ['a/b c.txt', 'a_b_c.txt', 'x' * 300])
  names = sweep.run_names(runs)
  assert names == sweep.run_names(runs)
  assert len(set(names)) == 3
  assert names[0].startswith('source=a_b_c.txt-')
  assert names[1].startswith('source=a_b_c.txt-')
  assert len(names[2]) <= sweep.MAX_NAME_LEN
  for name in names:
    assert re.fullmatch(r'[A-Za-z0-9._=+,-]+', name), name
  assert sweep.run_names([{}]) == ['base']


def test_dry_run_prints_one_command_per_run(tmp_path, capsys):
  root = str(tmp_path / 'root dir')
  code = sweep.main(
    [
      BERT_SWEEP,
      '--base=configs/bert.py:size=small',
      f'--workdir_root={root}',
      '--dry_run',
      '--config.train.num_steps=100',
    ]
  )
  assert code == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 6
  argv = shlex.split(lines[1])
  assert argv[1:3] == ['-m', 'pretrain_lm.main']
  assert argv[3:] == [
    '--config=configs/bert.py:size=small',
    f'--workdir={root}/learning_rate=0.0001-warmup_steps=10000',
    '--config.train.num_steps=100',
    '--config.optimizer.learning_rate=0.0001',
    '--config.optimizer.warmup_steps=10000',
  ]
  assert not os.path.exists(root)  # a dry run writes nothing

  sweep.main(
    [
      TINY_SWEEP,
      '--base=configs/bert.py:size=tiny',
      '--workdir_root=gs://bucket/tiny',
      '--dry_run',
      '--launcher=slurm',
      '--launcher_args=--nodes=2 --partition=gpu',
    ]
  )
  out = capsys.readouterr().out
  argv = shlex.split(out.splitlines()[-1])
  assert argv[:4] == [
    'sbatch',
    '--job-name=learning_rate=0.003-warmup_steps=20',
    '--nodes=2',
    '--partition=gpu',
  ]
  assert argv[4].endswith('launch/slurm.sbatch')
  assert (
    '--workdir=gs://bucket/tiny/learning_rate=0.003-warmup_steps=20' in argv
  )

  sweep.main(
    [
      TINY_SWEEP,
      '--base=configs/bert.py:size=tiny',
      f'--workdir_root={root}',
      '--dry_run',
      '--launcher=tpu_pod',
      '--launcher_args=--tpu=my-tpu --zone=us-central2-b',
    ]
  )
  argv = shlex.split(capsys.readouterr().out.splitlines()[0])
  assert argv[0].endswith('launch/tpu_pod.sh')
  assert argv[1:4] == ['run', '--tpu=my-tpu', '--zone=us-central2-b']


@pytest.mark.parametrize(
  'body, message',
  [
    (
      "sweep.choice('optimizer.learning_rat', [1e-4])",
      r"optimizer has no field 'learning_rat'.*'learning_rate'",
    ),
    ("sweep.choice('train.num_steps', [0.5])", r'train\.num_steps'),
    ("sweep.choice('train.num_steps', [10, 0])", r'train.num_steps=0 must be'),
    ("sweep.choice('data.seq_len', [1024])", r'data.seq_len=1024 exceeds'),
  ],
)
def test_bad_override_fails_before_anything_runs(
  tmp_path, capsys, body, message
):
  root = tmp_path / 'root'
  code = sweep.main(
    [
      write_sweep(tmp_path, body),
      '--base=configs/bert.py:size=tiny',
      f'--workdir_root={root}',
    ]
  )
  err = capsys.readouterr().err
  assert code == 2
  assert re.search(message, err), err
  assert not root.exists()


def test_bad_fixed_override_is_reported_once(tmp_path, capsys):
  code = sweep.main(
    [
      TINY_SWEEP,
      '--base=configs/bert.py:size=tiny',
      f'--workdir_root={tmp_path}',
      '--config.train.num_step=5',
    ]
  )
  err = capsys.readouterr().err
  assert code == 2
  assert err.count("train has no field 'num_step'") == 1


def test_finished_runs_are_skipped(tmp_path, capsys):
  root = tmp_path / 'root'
  done = root / 'learning_rate=0.001-warmup_steps=10'
  partial = root / 'learning_rate=0.003-warmup_steps=20'
  # Orbax's unfinished save is not a checkpoint.
  for step in ('1', '2', '3.orbax-checkpoint-tmp-7'):
    (done / 'checkpoints' / step).mkdir(parents=True)
  partial.mkdir()
  (partial / 'metrics.jsonl').write_text('{"step": 1, "loss": 6.0}\n')
  assert sweep.completed_step(str(done)) == 2
  assert sweep.completed_step(str(partial)) == 1
  assert sweep.completed_step(str(root / 'missing')) is None

  sweep.main(
    [
      TINY_SWEEP,
      '--base=configs/bert.py:size=tiny',
      f'--workdir_root={root}',
      '--dry_run',
      '--config.train.num_steps=2',
    ]
  )
  lines = capsys.readouterr().out.splitlines()
  assert (
    lines[0] == '[skip] learning_rate=0.001-warmup_steps=10: finished (step 2)'
  )
  assert f'--workdir={partial}' in shlex.split(lines[1])
  # With more steps to go, the first run resumes too.
  sweep.main(
    [
      TINY_SWEEP,
      '--base=configs/bert.py:size=tiny',
      f'--workdir_root={root}',
      '--dry_run',
      '--config.train.num_steps=3',
    ]
  )
  assert '[skip]' not in capsys.readouterr().out


def fabricate_run(root, name, overrides, records):
  """A workdir whose metrics.jsonl is written as metrics.MetricWriter does."""
  workdir = os.path.join(root, name)
  os.makedirs(workdir)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    for record in records:
      f.write(json.dumps(record) + '\n')
  return dict(name=name, workdir=workdir, overrides=overrides)


def test_summarize_tables(tmp_path, capsys):
  root = str(tmp_path)
  runs = [
    fabricate_run(
      root,
      'learning_rate=0.0001',
      {'optimizer.learning_rate': 1e-4},
      [
        {'step': 10, 'loss': 7.0, 'learning_rate': 1e-5},
        {'step': 10, 'eval_loss': 6.9, 'eval_perplexity': 992.3},
        {'step': 20, 'loss': 6.123456, 'learning_rate': 1e-4},
        {'step': 20, 'eval_loss': 6.0, 'eval_perplexity': 403.4},
      ],
    ),
    # Diverged: the writer logs NaN as null; no eval yet.
    fabricate_run(
      root,
      'learning_rate=0.01',
      {'optimizer.learning_rate': 1e-2},
      [{'step': 10, 'loss': None, 'grad_norm': None}],
    ),
    dict(
      name='learning_rate=0.1',
      workdir=os.path.join(root, 'learning_rate=0.1'),
      overrides={'optimizer.learning_rate': 0.1},
    ),
  ]
  with open(os.path.join(root, sweep.SWEEP_FILE), 'w') as f:
    json.dump({'runs': runs}, f)

  assert sweep.main(['--summarize', root]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines == [
    '| run | learning_rate | step | loss | eval_loss | eval_perplexity |',
    '| --- | --- | --- | --- | --- | --- |',
    '| learning_rate=0.0001 | 0.0001 | 20 | 6.123 | 6 | 403.4 |',
    '| learning_rate=0.01 | 0.01 | 10 |  |  |  |',
    '| learning_rate=0.1 | 0.1 |  |  |  |  |',
  ]
  assert sweep.main(['--summarize', root, '--format=csv']) == 0
  rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
  assert rows[0] == [
    'run',
    'learning_rate',
    'step',
    'loss',
    'eval_loss',
    'eval_perplexity',
  ]
  assert rows[1] == [
    'learning_rate=0.0001',
    '0.0001',
    '20',
    '6.123',
    '6',
    '403.4',
  ]

  # Without sweep.json: every subdirectory with metrics, no override columns.
  os.remove(os.path.join(root, sweep.SWEEP_FILE))
  sweep.main(['--summarize', root])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == '| run | step | loss | eval_loss | eval_perplexity |'
  assert len(lines) == 4


def test_tiny_sweep_end_to_end(tmp_path, capsys, monkeypatch):
  """Two real runs of the tiny BERT, summarized, then skipped when rerun."""
  from pretrain_lm import configlib
  from pretrain_lm.data import tokenizer as tokenizer_lib

  # One tokenizer for both runs: half the CPU the runs' own would take.
  c = configlib.load_file('configs/bert.py:size=tiny')
  c.data.tokenizer_max_docs = 2000
  tokenizer_lib.setup_tokenizer(
    c.data, vocab_size=640, workdir=str(tmp_path / 'tok')
  )
  tokenizer = str(tmp_path / 'tok' / tokenizer_lib.WORKDIR_FILENAME)
  # One CPU device per run, with the suite's compile flags: the 8 fake
  # devices of conftest only slow the compile down.
  monkeypatch.setenv('XLA_FLAGS', COMPILE_FLAGS)
  root = str(tmp_path / 'root')
  argv = [
    TINY_SWEEP,
    '--base=configs/bert.py:size=tiny',
    f'--workdir_root={root}',
    '--parallel=2',
    f'--config.data.tokenizer={tokenizer}',
    *TINY,
  ]
  assert sweep.main(argv) == 0
  out = capsys.readouterr().out
  assert '2 runs: 0 already finished, 2 ran, 0 failed.' in out

  with open(os.path.join(root, sweep.SWEEP_FILE)) as f:
    runs = json.load(f)['runs']
  assert [r['name'] for r in runs] == [
    'learning_rate=0.001-warmup_steps=10',
    'learning_rate=0.003-warmup_steps=20',
  ]
  logged_lr = []
  for run in runs:
    # The run trained with its overrides (its resolved config says so).
    with open(os.path.join(run['workdir'], 'config.json')) as f:
      config = json.load(f)
    for key, value in run['overrides'].items():
      section, field = key.split('.')
      assert config[section][field] == value
    assert sweep.completed_step(run['workdir']) == 2
    records = read_metrics(run['workdir'])
    logged_lr.append(next(r['learning_rate'] for r in records if 'loss' in r))
  # In warmup the rate is peak * step / warmup_steps: 1e-4 vs 1.5e-4.
  assert logged_lr[1] / logged_lr[0] == pytest.approx(1.5, rel=1e-4)

  assert sweep.main(['--summarize', root]) == 0
  table = capsys.readouterr().out.splitlines()
  assert table[0].startswith('| run | learning_rate | warmup_steps | step |')
  assert table[2].startswith('| learning_rate=0.001-warmup_steps=10 | 0.001 |')
  assert all(row.split(' | ')[3] == '2' for row in table[2:])

  # Rerunning the sweep finds both finished and starts nothing.
  assert sweep.main(argv) == 0
  out = capsys.readouterr().out
  assert out.count('[skip]') == 2
  assert '[start]' not in out
  assert '2 runs: 2 already finished, 0 ran, 0 failed.' in out


def test_summarize_missing_directory_is_a_message(tmp_path, capsys):
  missing = str(tmp_path / 'no_such_sweep')
  assert sweep.main(['--summarize', missing]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f'error: {missing} is not a directory')
  assert 'Traceback' not in err


# A scheduler's stand-in: records its argv, one JSON file per call.
FAKE_SCHEDULER = """#!/usr/bin/env python3
import json, os, sys, uuid
out = os.environ['SCHEDULER_OUT']
with open(os.path.join(out, uuid.uuid4().hex + '.json'), 'w') as f:
  json.dump(sys.argv[1:], f)
"""


def test_sweep_through_a_launcher_template(tmp_path, capsys, monkeypatch):
  scheduler = tmp_path / 'xpk'
  scheduler.write_text(FAKE_SCHEDULER)
  scheduler.chmod(0o755)
  calls = tmp_path / 'calls'
  calls.mkdir()
  monkeypatch.setenv('SCHEDULER_OUT', str(calls))
  # A root a shell would split or end early, were it not quoted.
  root = str(tmp_path / 'it\'s a "root" $HOME')
  template = (
    f'{scheduler} workload create --workload={{job}} --label={{name}} '
    '--command="{command}"'
  )
  argv = [
    TINY_SWEEP,
    '--base=configs/bert.py:size=tiny',
    f'--workdir_root={root}',
    f'--launcher={template}',
    '--config.train.num_steps=7',
  ]
  assert sweep.main(argv) == 0
  assert (
    '2 runs: 0 already finished, 2 ran, 0 failed.' in capsys.readouterr().out
  )
  got = []
  for path in calls.iterdir():
    args = json.loads(path.read_text())
    assert args[:2] == ['workload', 'create']
    flags = dict(a[2:].split('=', 1) for a in args[2:])
    got.append(
      (flags['label'], flags['workload'], shlex.split(flags['command']))
    )
  names = [
    'learning_rate=0.001-warmup_steps=10',
    'learning_rate=0.003-warmup_steps=20',
  ]
  assert sorted(got) == [
    (
      name,
      sweep.job_name(name),
      [
        'python',
        '-m',
        'pretrain_lm.main',
        '--config=configs/bert.py:size=tiny',
        f'--workdir={root}/{name}',
        '--config.train.num_steps=7',
        f'--config.optimizer.learning_rate={name[14:19]}',
        f'--config.optimizer.warmup_steps={name[-2:]}',
      ],
    )
    for name in names
  ]
  assert re.fullmatch(r'[a-z][a-z0-9-]{0,38}', got[0][1])
  with open(os.path.join(root, sweep.SWEEP_FILE)) as f:
    record = json.load(f)
  assert record['launcher'] == template

  # A template from a file; {args} unquoted are the flags as words.
  path = tmp_path / 'launcher.sh'
  path.write_text('# sbatch-like\nsubmit --name={name} -- run.sh {args}\n')
  argv[3] = f'--launcher={path}'
  assert sweep.main([*argv, '--dry_run']) == 0
  lines = capsys.readouterr().out.splitlines()
  words = shlex.split(lines[0])
  assert words[:4] == ['submit', f'--name={names[0]}', '--', 'run.sh']
  assert words[4:6] == [
    '--config=configs/bert.py:size=tiny',
    f'--workdir={root}/{names[0]}',
  ]


@pytest.mark.parametrize(
  'launcher, message',
  [
    ('kubectl', "not one of ['local', 'tpu_pod', 'slurm'], a file"),
    ('submit {nme} {command}', "names ['nme']"),
    ('submit --name={name}', 'needs {command} or {args}'),
    ('submit "{command}', 'unclosed "'),
  ],
)
def test_bad_launcher_template_is_a_message(
  tmp_path, capsys, launcher, message
):
  code = sweep.main(
    [
      TINY_SWEEP,
      '--base=configs/bert.py:size=tiny',
      f'--workdir_root={tmp_path}',
      f'--launcher={launcher}',
      '--dry_run',
    ]
  )
  assert code == 2
  assert message in capsys.readouterr().err


# launch/tpu_pod.sh's stand-in: one job per slice at a time, or it fails.
FAKE_TPU_POD = """#!/usr/bin/env bash
for a in "$@"; do case "$a" in --tpu=*) tpu="${a#--tpu=}" ;; esac; done
lock="$OUT/$tpu.lock"
[ -e "$lock" ] && exit 3
touch "$lock"
echo "$tpu" >> "$OUT/used"
sleep 0.5
rm "$lock"
"""


def test_sweep_spread_over_two_tpu_slices(tmp_path, capsys, monkeypatch):
  fake_repo = tmp_path / 'repo'
  (fake_repo / 'launch').mkdir(parents=True)
  script = fake_repo / 'launch' / 'tpu_pod.sh'
  script.write_text(FAKE_TPU_POD)
  script.chmod(0o755)
  monkeypatch.setattr(launchers, 'REPO', str(fake_repo))
  monkeypatch.setenv('OUT', str(tmp_path))
  argv = [
    write_sweep(tmp_path, "sweep.choice('train.seed', [1, 2, 3])"),
    '--base=configs/bert.py:size=tiny',
    f'--workdir_root={tmp_path / "root"}',
    '--launcher=tpu_pod',
    '--launcher_args=--zone=us-central2-b',
    '--tpus=slice-a,slice-b',
  ]
  # A dry run gives the slices in turn.
  assert sweep.main([*argv, '--dry_run']) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [shlex.split(line)[1:4] for line in lines] == [
    ['run', '--zone=us-central2-b', f'--tpu={t}']
    for t in ('slice-a', 'slice-b', 'slice-a')
  ]
  assert sweep.main(argv) == 0
  out = capsys.readouterr().out
  assert '3 runs: 0 already finished, 3 ran, 0 failed.' in out
  assert '[start] seed=1 on slice-a' in out
  assert '[start] seed=2 on slice-b' in out
  # Both slices worked, one run at a time each (the fake fails otherwise).
  used = (tmp_path / 'used').read_text().split()
  assert sorted(used) == ['slice-a', 'slice-a', 'slice-b'] or sorted(used) == [
    'slice-a',
    'slice-b',
    'slice-b',
  ]
  with open(tmp_path / 'root' / sweep.SWEEP_FILE) as f:
    assert json.load(f)['tpus'] == ['slice-a', 'slice-b']
  with pytest.raises(sweep.SweepError, match='--tpus needs --launcher=tpu_pod'):
    sweep.run_sweep(
      argv[0],
      base='configs/bert.py:size=tiny',
      workdir_root=str(tmp_path),
      tpus=['a', 'b'],
    )
