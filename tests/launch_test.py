"""launch/local.sh builds the command it runs."""

import os
import shlex
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dry_run(*args):
  return subprocess.run(
    [os.path.join(REPO, 'launch', 'local.sh'), '--dry_run', *args],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()


def test_local_dry_run_passes_arguments_through():
  out = dry_run(
    '--config=configs/bert.py:size=tiny',
    '--workdir=/tmp/a b',
    '--config.train.num_steps=5',
  )
  assert shlex.split(out) == [
    '.venv/bin/python',
    '-m',
    'pretrain_lm.main',
    '--config=configs/bert.py:size=tiny',
    '--workdir=/tmp/a b',
    '--config.train.num_steps=5',
  ]


def test_local_fake_devices_sets_xla_flags():
  out = shlex.split(dry_run('--fake_devices=8', '--workdir=/tmp/w'))
  assert out[0].startswith('XLA_FLAGS=')
  assert '--xla_force_host_platform_device_count=8' in out[0]
  assert out[1] == 'JAX_PLATFORMS=cpu'
  assert out[2:] == [
    '.venv/bin/python',
    '-m',
    'pretrain_lm.main',
    '--workdir=/tmp/w',
  ]


def run_script(script, *args, env=None, check=True, timeout=60):
  return subprocess.run(
    [os.path.join(REPO, 'launch', script), *args],
    capture_output=True,
    text=True,
    check=check,
    env={**os.environ, **(env or {})},
    timeout=timeout,
  )


# Arguments for pretrain_lm.main with a value that needs quoting.
MAIN_ARGS = [
  '--config=configs/bert.py:size=base',
  "--workdir=gs://bucket/it's a run",
  '--config.train.num_steps=5',
]
TPU = ['--tpu=my-tpu', '--zone=us-central2-b']


def test_tpu_pod_dry_run_prints_the_gcloud_commands():
  out = run_script(
    'tpu_pod.sh',
    'run',
    '--dry_run',
    *TPU,
    '--accelerator_type=v5p-32',
    '--version=v2-alpha-tpuv5',
    '--spot',
    '--env=LIBTPU_INIT_ARGS=--xla_tpu_x=1 --y',
    *MAIN_ARGS,
  ).stdout
  lines = [shlex.split(line) for line in out.splitlines() if line[0] != '#']
  gcloud = ['gcloud', 'compute', 'tpus', 'tpu-vm']
  assert [line[:5] for line in lines] == [
    [*gcloud, 'describe'],
    [*gcloud, 'create'],
    [*gcloud, 'scp'],
    [*gcloud, 'ssh'],  # setup
    [*gcloud, 'ssh'],  # start
    [*gcloud, 'ssh'],  # logs
    [*gcloud, 'ssh'],  # status
  ]
  assert lines[1][4:] == [
    'create',
    'my-tpu',
    '--zone=us-central2-b',
    '--accelerator-type=v5p-32',
    '--version=v2-alpha-tpuv5',
    '--spot',
  ]
  assert '--worker=all' in lines[2]
  setup, start, logs = lines[3], lines[4], lines[5]
  assert '--worker=all' in setup and '--worker=all' in start
  assert '--worker=0' in logs
  assert "pip install -q --python .venv/bin/python -e '.[tpu]'" in setup[-1]
  # The start script runs a wrapper shell whose command line is main's.
  script = start[-1].removeprefix('--command=')
  tokens = shlex.split(script)
  wrapper = tokens[tokens.index('-c', tokens.index('setsid')) + 1]
  argv = shlex.split(wrapper.split('; ')[2].split(' >> ')[0])
  assert argv[0] == 'env'
  assert argv[1].startswith('PRETRAIN_LM_GIT_COMMIT=')
  assert argv[2:] == [
    'LIBTPU_INIT_ARGS=--xla_tpu_x=1 --y',
    '.venv/bin/python',
    '-m',
    'pretrain_lm.main',
    *MAIN_ARGS,
  ]


def test_tpu_pod_rejects_bad_invocations():
  for args, message in [
    (['launch'], "unknown command 'launch'"),
    (['run', '--zone=z', *MAIN_ARGS], '--tpu=NAME is required'),
    (['run', *TPU, '--workdir=/w'], 'run needs --config'),
    (['create', *TPU, '--code=git'], '--code=git needs --repo'),
  ]:
    result = run_script('tpu_pod.sh', *args, '--dry_run', check=False)
    assert result.returncode == 2
    assert message in result.stderr


# A stand-in for gcloud: one local "worker" whose home is $HOME. ssh runs the
# command here; the VM's state lives in $HOME/state.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
echo "$4" >> "$HOME/gcloud_calls"
case "$4" in
  describe) cat "$HOME/state" 2>/dev/null || exit 1 ;;
  create) echo READY > "$HOME/state" ;;
  delete) rm -f "$HOME/state" ;;
  scp) cp "$5" "$HOME/${6#*:}" ;;
  ssh)
    for a in "$@"; do
      case "$a" in --command=*) c="${a#--command=}" ;; esac
    done
    cd "$HOME" && exec bash -c "$c" ;;
esac
"""
# pretrain_lm.main's stand-in: run n records its argv and exits with line n
# of $HOME/codes; 'preempt' plays a spot VM going away mid-run.
FAKE_PYTHON = r"""#!/usr/bin/env bash
n=$(( $(cat "$HOME/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$HOME/count"
printf '%s\n' "$@" > "$HOME/args$n"
echo "fake run $n"
code="$(sed -n "${n}p" "$HOME/codes")"
if [ "$code" = preempt ]; then
  echo PREEMPTED > "$HOME/state"
  kill -9 "$PPID"
  exit 1
fi
if [ "$code" = wait ]; then
  trap 'echo saving; exit 75' TERM
  for i in $(seq 300); do sleep 0.1; done
fi
exit "$code"
"""
# uv's stand-in: `uv venv` installs the fake python.
FAKE_UV = r"""#!/usr/bin/env bash
if [ "$1" = venv ]; then
  mkdir -p .venv/bin && cp "$HOME/fake_python" .venv/bin/python
fi
"""


def fake_worker(tmp_path, codes, state='READY'):
  home = tmp_path / 'home'
  bin_dir = tmp_path / 'bin'
  venv = home / 'pretrain_lm' / '.venv' / 'bin'
  for d in (home, bin_dir, venv):
    d.mkdir(parents=True)
  for path, text in [
    (bin_dir / 'gcloud', FAKE_GCLOUD),
    (bin_dir / 'uv', FAKE_UV),
    (home / 'fake_python', FAKE_PYTHON),
    (venv / 'python', FAKE_PYTHON),
  ]:
    path.write_text(text)
    path.chmod(0o755)
  (home / 'codes').write_text('\n'.join(codes) + '\n')
  if state:
    (home / 'state').write_text(state + '\n')
  env = {
    'HOME': str(home),
    'GCLOUD': str(bin_dir / 'gcloud'),
    'PATH': f'{bin_dir}:{os.environ["PATH"]}',
    'RELAUNCH_DELAY': '0',
  }
  return home, env


def test_tpu_pod_run_relaunches_after_exit_75(tmp_path):
  home, env = fake_worker(tmp_path, ['75', '0'])
  result = run_script(
    'tpu_pod.sh', 'run', *TPU, '--no_setup', *MAIN_ARGS, env=env
  )
  assert 'relaunch 1/100' in result.stderr
  assert 'the job finished' in result.stderr
  assert 'fake run 2' in result.stdout
  # Both runs got main's arguments intact, through three layers of shells.
  for n in (1, 2):
    assert (home / f'args{n}').read_text().splitlines() == [
      '-m',
      'pretrain_lm.main',
      *MAIN_ARGS,
    ]
  assert not (home / 'args3').exists()
  assert 'create' not in (home / 'gcloud_calls').read_text()


def test_tpu_pod_run_recreates_a_preempted_vm(tmp_path):
  home, env = fake_worker(tmp_path, ['preempt', '0'])
  result = run_script(
    'tpu_pod.sh', 'run', *TPU, '--no_setup', *MAIN_ARGS, env=env
  )
  assert 'TPU my-tpu is PREEMPTED' in result.stderr
  calls = (home / 'gcloud_calls').read_text().split()
  # The new VM is set up again: the checkout copied and installed there.
  i = calls.index('delete')
  assert calls[i : i + 4] == ['delete', 'create', 'scp', 'ssh']
  assert (home / 'pretrain_lm' / 'pretrain_lm' / 'sweep.py').exists()
  assert (home / 'args2').read_text().splitlines()[2:] == MAIN_ARGS


def test_tpu_pod_stop_saves_and_does_not_relaunch(tmp_path):
  home, env = fake_worker(tmp_path, ['wait'])
  run_script('tpu_pod.sh', 'start', *TPU, *MAIN_ARGS, env=env)
  for _ in range(100):
    if (home / 'pretrain_lm_job' / 'child').exists():
      break
    time.sleep(0.1)
  # A second start, or a setup, leaves the running job alone.
  out = run_script('tpu_pod.sh', 'start', *TPU, *MAIN_ARGS, env=env).stdout
  assert 'a job is already running' in out
  assert (
    'setup skipped' in run_script('tpu_pod.sh', 'setup', *TPU, env=env).stdout
  )
  run_script('tpu_pod.sh', 'stop', *TPU, env=env)
  result = run_script(
    'tpu_pod.sh', 'run', *TPU, '--no_setup', *MAIN_ARGS, env=env
  )
  assert 'the job was stopped' in result.stderr
  assert 'saving' in (home / 'pretrain_lm_job' / 'log').read_text()
  assert (home / 'pretrain_lm_job' / 'rc').read_text().strip() == '75'
  assert not (home / 'args2').exists()


def test_slurm_dry_run_prints_the_srun_command():
  out = run_script(
    'slurm.sbatch',
    *MAIN_ARGS,
    env={'DRY_RUN': '1', 'SRUN_ARGS': '--mpi=none --gpus-per-task=1'},
  ).stdout
  assert shlex.split(out) == [
    'srun',
    '--mpi=none',
    '--gpus-per-task=1',
    '.venv/bin/python',
    '-m',
    'pretrain_lm.main',
    *MAIN_ARGS,
  ]
  with open(os.path.join(REPO, 'launch', 'slurm.sbatch')) as f:
    directives = [line.split()[1] for line in f if line.startswith('#SBATCH')]
  assert '--requeue' in directives
  assert '--signal=TERM@120' in directives


def test_slurm_requeues_on_exit_75(tmp_path):
  srun = tmp_path / 'srun'
  srun.write_text(
    '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT/srun.args"\n'
    'exit "$CODE"\n'
  )
  scontrol = tmp_path / 'scontrol'
  scontrol.write_text(
    '#!/usr/bin/env bash\necho "$@" >> "$OUT/scontrol.calls"\n'
  )
  for f in (srun, scontrol):
    f.chmod(0o755)
  env = {
    'SRUN': str(srun),
    'SCONTROL': str(scontrol),
    'OUT': str(tmp_path),
    'SLURM_JOB_ID': '123',
  }
  result = run_script('slurm.sbatch', *MAIN_ARGS, env={**env, 'CODE': '75'})
  assert (tmp_path / 'scontrol.calls').read_text() == 'requeue 123\n'
  assert (tmp_path / 'srun.args').read_text().splitlines()[1:] == [
    '-m',
    'pretrain_lm.main',
    *MAIN_ARGS,
  ]
  assert 'requeueing job 123' in result.stdout
  (tmp_path / 'scontrol.calls').unlink()
  # A failure is not requeued, nor a job that was requeued too often.
  result = run_script(
    'slurm.sbatch', *MAIN_ARGS, env={**env, 'CODE': '1'}, check=False
  )
  assert result.returncode == 1
  result = run_script(
    'slurm.sbatch',
    *MAIN_ARGS,
    env={**env, 'CODE': '75', 'SLURM_RESTART_COUNT': '20'},
    check=False,
  )
  assert result.returncode == 75
  assert not (tmp_path / 'scontrol.calls').exists()
