"""launch/local.sh builds the command it runs."""

import os
import re
import shlex
import subprocess
import time

import pytest

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
    # status of each of the v5p-32's 4 workers
    *[[*gcloud, 'ssh']] * 4,
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
  assert [line[-2] for line in lines[6:]] == [f'--worker={w}' for w in range(4)]
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


# A stand-in for gcloud: the slice's workers are local directories, worker 0's
# $HOME and $HOME/workerN (as many as $HOME/nworkers says); ssh runs the
# command there with that HOME. The VM's state lives in $HOME/state, a queued
# resource's in $HOME/qr_states (one line per describe; the last one stays).
FAKE_GCLOUD = r"""#!/usr/bin/env bash
root="$HOME"
n=$(cat "$root/nworkers" 2>/dev/null || echo 1)
home_of() {
  if [ "$1" = 0 ]; then echo "$root"; else echo "$root/worker$1"; fi
}
case "$3" in
  tpu-vm) echo "$4" ;;
  *) echo "qr_$4" ;;
esac >> "$root/gcloud_calls"
case "$3 $4" in
  'tpu-vm describe')
    [ -f "$root/state" ] || exit 1
    for a in "$@"; do
      if [ "$a" = --flatten=networkEndpoints ]; then
        seq "$n" | sed 's/^/10.0.0./'
        exit 0
      fi
    done
    cat "$root/state" ;;
  'tpu-vm create') echo READY > "$root/state" ;;
  'tpu-vm delete') rm -f "$root/state" ;;
  'tpu-vm scp')
    for w in $(seq 0 $(( n - 1 ))); do
      cp "$5" "$(home_of "$w")/${6#*:}"
    done ;;
  'tpu-vm ssh')
    for a in "$@"; do
      case "$a" in
        --command=*) c="${a#--command=}" ;;
        --worker=*) w="${a#--worker=}" ;;
      esac
    done
    export FAKE_ROOT="$root"
    if [ "$w" != all ]; then
      cd "$(home_of "$w")" && HOME="$PWD" WORKER="$w" exec bash -c "$c"
    fi
    rc=0
    for w in $(seq 0 $(( n - 1 ))); do
      (cd "$(home_of "$w")" && HOME="$PWD" WORKER="$w" bash -c "$c") || rc=$?
    done
    exit "$rc" ;;
  'queued-resources create')
    printf '%s\n' "$@" > "$root/qr_create_args"
    printf '%s\n' WAITING_FOR_RESOURCES PROVISIONING ACTIVE \
      > "$root/qr_states" ;;
  'queued-resources describe')
    [ -f "$root/qr_states" ] || exit 1
    s="$(head -n 1 "$root/qr_states")"
    [ "$(wc -l < "$root/qr_states")" -le 1 ] || sed -i 1d "$root/qr_states"
    [ "$s" != ACTIVE ] || echo READY > "$root/state"
    echo "$s" ;;
  'queued-resources delete')
    printf '%s\n' "$@" > "$root/qr_delete_args"
    rm -f "$root/qr_states" "$root/state" ;;
esac
"""
# pretrain_lm.main's stand-in: run n records its argv and exits with line n
# of $HOME/codes; 'preempt' plays a spot VM going away mid-run, 'vanish' a
# job killed with its wrapper, 'wait' a job that runs until SIGTERM.
FAKE_PYTHON = r"""#!/usr/bin/env bash
n=$(( $(cat "$HOME/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$HOME/count"
printf '%s\n' "$@" > "$HOME/args$n"
echo "fake run $n on worker ${WORKER:-0}"
code="$(sed -n "${n}p" "$HOME/codes")"
if [ "$code" = preempt ]; then
  echo PREEMPTED > "${FAKE_ROOT:-$HOME}/state"
fi
if [ "$code" = preempt ] || [ "$code" = vanish ]; then
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
  mkdir -p .venv/bin && cp "$FAKE_ROOT/fake_python" .venv/bin/python
fi
"""


def fake_worker(tmp_path, codes, state='READY', worker_codes=None):
  """A fake slice; worker_codes (one list per worker) makes it multi-host."""
  worker_codes = worker_codes or [codes]
  home = tmp_path / 'home'
  bin_dir = tmp_path / 'bin'
  homes = [home] + [home / f'worker{w}' for w in range(1, len(worker_codes))]
  bin_dir.mkdir(parents=True)
  for path, text in [
    (bin_dir / 'gcloud', FAKE_GCLOUD),
    (bin_dir / 'uv', FAKE_UV),
  ]:
    path.write_text(text)
    path.chmod(0o755)
  for h, c in zip(homes, worker_codes, strict=True):
    venv = h / 'pretrain_lm' / '.venv' / 'bin'
    venv.mkdir(parents=True)
    for path in (h / 'fake_python', venv / 'python'):
      path.write_text(FAKE_PYTHON)
      path.chmod(0o755)
    (h / 'codes').write_text('\n'.join(c) + '\n')
  (home / 'nworkers').write_text(f'{len(homes)}\n')
  if state:
    (home / 'state').write_text(state + '\n')
  env = {
    'HOME': str(home),
    'GCLOUD': str(bin_dir / 'gcloud'),
    'PATH': f'{bin_dir}:{os.environ["PATH"]}',
    'RELAUNCH_DELAY': '0',
    'POLL_INTERVAL': '0.1',
    'QUEUE_POLL': '0',
    'STOP_TIMEOUT': '30',
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
  assert (home / 'pretrain_lm' / 'pretrain_lm' / 'main.py').exists()
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


def worker_homes(home, n):
  return [home] + [home / f'worker{w}' for w in range(1, n)]


@pytest.mark.parametrize(
  'failure, message',
  [('1', 'worker 3 exited 1'), ('vanish', "worker 3's job vanished")],
)
def test_tpu_pod_run_relaunches_the_slice_when_one_worker_fails(
  tmp_path, failure, message
):
  # Workers 0-2 run on; worker 3 fails: the launcher sees it, stops the
  # others (they save) and relaunches all four.
  home, env = fake_worker(
    tmp_path, [], worker_codes=[['wait', '0']] * 3 + [[failure, '0']]
  )
  result = run_script(
    'tpu_pod.sh', 'run', *TPU, '--no_setup', *MAIN_ARGS, env=env
  )
  assert message in result.stderr
  assert 'stopping the job on every worker' in result.stderr
  # The failed worker's log tail, not only worker 0's stream.
  assert '--- worker 3: last lines of its log ---' in result.stderr
  assert 'fake run 1 on worker 3' in result.stderr
  assert 'relaunch 1/100' in result.stderr
  assert 'the job finished on all 4 workers' in result.stderr
  homes = worker_homes(home, 4)
  for h in homes[:3]:
    assert 'saving' in (h / 'pretrain_lm_job' / 'log').read_text()
  for h in homes:
    assert (h / 'args2').read_text().splitlines()[2:] == MAIN_ARGS
    assert not (h / 'args3').exists()


def test_tpu_pod_run_stops_on_exit_65_of_any_worker(tmp_path):
  home, env = fake_worker(
    tmp_path, [], worker_codes=[['wait'], ['65'], ['wait'], ['wait']]
  )
  result = run_script(
    'tpu_pod.sh', 'run', *TPU, '--no_setup', *MAIN_ARGS, env=env, check=False
  )
  assert result.returncode == 65
  assert 'worker 1 exited 65' in result.stderr
  assert 'not relaunching' in result.stderr
  assert 'relaunch' not in result.stderr.replace('not relaunching', '')
  homes = worker_homes(home, 4)
  assert not any((h / 'args2').exists() for h in homes)
  # Every worker's state, and any worker's log.
  status = run_script('tpu_pod.sh', 'status', *TPU, env=env).stdout
  assert status.splitlines() == [
    'worker 0: exit=75',
    'worker 1: exit=65',
    'worker 2: exit=75',
    'worker 3: exit=75',
  ]
  logs = run_script('tpu_pod.sh', 'logs', *TPU, '--worker=1', env=env).stdout
  assert 'fake run 1 on worker 1' in logs


@pytest.mark.parametrize(
  'flags, tier',
  [
    (['--queued', '--spot'], ['my-tpu-qr', '--spot']),
    (['--queued=my-qr', '--reserved'], ['my-qr', '--reserved']),
  ],
)
def test_tpu_pod_queued_resource_is_requested_and_waited_for(
  tmp_path, flags, tier
):
  home, env = fake_worker(tmp_path, [], state=None)
  result = run_script(
    'tpu_pod.sh',
    'create',
    *TPU,
    *flags,
    '--accelerator_type=v5litepod-16',
    '--version=v2-alpha-tpuv5-lite',
    env=env,
  )
  args = (home / 'qr_create_args').read_text().splitlines()
  assert args == [
    'compute',
    'tpus',
    'queued-resources',
    'create',
    tier[0],
    '--node-id=my-tpu',
    '--zone=us-central2-b',
    '--accelerator-type=v5litepod-16',
    '--runtime-version=v2-alpha-tpuv5-lite',
    tier[1],
  ]
  # It polled describe until ACTIVE, reporting each state once.
  seen = re.findall(rf'Queued resource {tier[0]}: (\w+)', result.stderr)
  assert seen == ['WAITING_FOR_RESOURCES', 'PROVISIONING', 'ACTIVE']
  calls = (home / 'gcloud_calls').read_text().split()
  assert calls == ['qr_describe', 'qr_create'] + ['qr_describe'] * 3
  assert (home / 'state').read_text().strip() == 'READY'
  # A second create finds it; delete removes the queued resource and its VM.
  out = run_script('tpu_pod.sh', 'create', *TPU, *flags, env=env).stderr
  assert 'TPU my-tpu exists (READY' in out
  run_script('tpu_pod.sh', 'delete', *TPU, *flags, env=env)
  args = (home / 'qr_delete_args').read_text().splitlines()
  assert args[3:] == [
    'delete',
    tier[0],
    '--zone=us-central2-b',
    '--force',
    '--quiet',
  ]
  assert not (home / 'state').exists()


def test_tpu_pod_queued_rejects_preemptible():
  result = run_script(
    'tpu_pod.sh',
    'create',
    *TPU,
    '--queued',
    '--preemptible',
    '--dry_run',
    check=False,
  )
  assert result.returncode == 2
  assert 'use --spot or --reserved' in result.stderr


def test_tpu_pod_refuses_a_workdir_the_workers_cannot_share(tmp_path):
  home, env = fake_worker(tmp_path, ['0'], state=None)
  local = ['--config=configs/bert.py:size=base', '--workdir=/tmp/w']
  for accel in ('v4-32', 'v5litepod-16', 'v9-64'):
    result = run_script(
      'tpu_pod.sh',
      'run',
      *TPU,
      f'--accelerator_type={accel}',
      *local,
      env=env,
      check=False,
    )
    assert result.returncode == 2, accel
    assert '--workdir=/tmp/w is not on storage all workers' in result.stderr
    assert 'gs://' in result.stderr and '--shared_fs=DIR' in result.stderr
  # Refused before anything was created.
  assert not (home / 'gcloud_calls').exists()
  for args in (
    ['--accelerator_type=v4-32', *MAIN_ARGS],  # gs://
    ['--accelerator_type=v4-32', '--shared_fs=/tmp', *local],
    ['--accelerator_type=v4-8', *local],  # one host
    ['--accelerator_type=v5litepod-8', *local],
  ):
    run_script('tpu_pod.sh', 'run', '--dry_run', *TPU, *args)
  # A VM that exists says how many workers it has, whatever the flags say.
  home, env = fake_worker(tmp_path / 'b', [], worker_codes=[['0']] * 4)
  result = run_script('tpu_pod.sh', 'start', *TPU, *local, env=env, check=False)
  assert result.returncode == 2
  assert 'TPU my-tpu (4 workers)' in result.stderr
  assert not (home / 'pretrain_lm_job').exists()


def test_slurm_dry_run_prints_the_srun_command():
  out = run_script(
    'slurm.sbatch',
    *MAIN_ARGS,
    env={'DRY_RUN': '1', 'SRUN_ARGS': '--mpi=none --gpus-per-task=1'},
  ).stdout
  assert shlex.split(out) == [
    'srun',
    '--kill-on-bad-exit=1',  # one failed task stops the step
    '--mpi=none',
    '--gpus-per-task=1',
    'launch/slurm_task.sh',
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
    'PRETRAIN_LM_TASK_DIR': str(tmp_path / 'tasks'),
  }
  result = run_script('slurm.sbatch', *MAIN_ARGS, env={**env, 'CODE': '75'})
  assert (tmp_path / 'scontrol.calls').read_text() == 'requeue 123\n'
  assert (tmp_path / 'srun.args').read_text().splitlines()[1:] == [
    'launch/slurm_task.sh',
    '.venv/bin/python',
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


# srun's stand-in: runs the task command once per code in $CODES, with
# SLURM_PROCID set, and exits with the highest code, as srun does.
FAKE_SRUN = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$OUT/srun.args"
while [[ "$1" == -* ]]; do shift; done
rc=0 i=0
for code in $CODES; do
  SLURM_PROCID=$i CODE=$code "$@" || { r=$?; (( r > rc )) && rc=$r; }
  i=$(( i + 1 ))
done
exit "$rc"
"""


@pytest.mark.parametrize(
  'codes, returncode, requeued',
  [('0 0 0 1', 1, False), ('75 75 2 75', 2, False), ('75 75 75 75', 0, True)],
)
def test_slurm_reports_the_failing_task_and_requeues_only_on_75(
  tmp_path, codes, returncode, requeued
):
  scripts = {
    'srun': FAKE_SRUN,
    'scontrol': '#!/usr/bin/env bash\necho "$@" >> "$OUT/scontrol.calls"\n',
    'python': '#!/usr/bin/env bash\nexit "$CODE"\n',
  }
  for name, text in scripts.items():
    (tmp_path / name).write_text(text)
    (tmp_path / name).chmod(0o755)
  env = {
    'SRUN': str(tmp_path / 'srun'),
    'SCONTROL': str(tmp_path / 'scontrol'),
    'PRETRAIN_LM_PYTHON': str(tmp_path / 'python'),
    'PRETRAIN_LM_TASK_DIR': str(tmp_path / 'tasks'),
    'OUT': str(tmp_path),
    'SLURM_JOB_ID': '7',
    'CODES': codes,
  }
  result = run_script('slurm.sbatch', *MAIN_ARGS, env=env, check=False)
  assert result.returncode == returncode, result.stderr
  srun_args = (tmp_path / 'srun.args').read_text().splitlines()
  assert srun_args[0] == '--kill-on-bad-exit=1'
  assert (tmp_path / 'scontrol.calls').exists() == requeued
  if not requeued:
    task = codes.split().index(str(returncode))
    host = os.uname().nodename
    assert f'task {task} on {host} exited {returncode}' in result.stderr
    assert f'Task {task} on {host} exited {returncode}.' in result.stderr
    assert 'not requeueing' in result.stderr
  assert not (tmp_path / 'tasks').exists()
