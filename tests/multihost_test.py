"""Multi-process runs: jax.distributed start-up, host agreement, preemption.

The end-to-end test starts 2 processes on 127.0.0.1 with 4 fake CPU devices
each and checks them against one process with 8 devices fed the same global
batches (each host's shard, concatenated in process order).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import COMPILE_FLAGS, REPO, load_config, read_metrics

import pretrain_lm
from pretrain_lm import distributed, objectives, sharding, train
from pretrain_lm.data import pipeline
from pretrain_lm.training import loop

BERT = os.path.join(REPO, 'configs', 'bert.py')
STEPS = 12
# tests/conftest.py's tiny_workdir, on a (data, fsdp, tensor) = 2x2x2 mesh.
OVERRIDES = {
  'model.vocab_size': 640,
  'model.max_len': 128,
  'data.seq_len': 64,
  'data.batch_size': 8,
  'data.shuffle_buffer': 64,
  'data.eval_batches': 1,
  'optimizer.warmup_steps': 1,
  'train.num_steps': STEPS,
  'train.log_every': 1,
  'train.eval_every': 1000,
  'train.progress_bar': False,
  'checkpoint.every': 1000,
  'mesh.data': 2,
  'mesh.fsdp': 2,
  'mesh.tensor': 2,
}


# --- Start-up decisions (pure; nothing is initialized) ---


def test_plan_single_process_without_cluster():
  assert distributed.plan({}) is None
  assert distributed.plan({'SLURM_JOB_ID': '1'}) is None
  # A one-task SLURM step is a single process too.
  slurm_one = {v: '0' for v in distributed.SLURM_VARIABLES}
  assert distributed.plan({**slurm_one, 'SLURM_NTASKS': '1'}) is None
  assert distributed.plan({'TPU_WORKER_ID': '0'}, mode='off') is None


def test_plan_from_flags():
  init = distributed.plan(
    {'SLURM_NTASKS': '4'},  # explicit flags win over the environment
    coordinator_address='10.0.0.1:1234',
    num_processes=2,
    process_id=1,
    local_device_ids=['0', '1'],
  )
  assert init == distributed.Init(
    'flags',
    {
      'coordinator_address': '10.0.0.1:1234',
      'num_processes': 2,
      'process_id': 1,
      'local_device_ids': [0, 1],
    },
  )


@pytest.mark.parametrize(
  'kwargs, expected',
  [
    (dict(coordinator_address='h:1'), '--num_processes, --process_id'),
    (dict(num_processes=2, process_id=2, coordinator_address='h:1'), '[0, '),
    (dict(mode='off', process_id=0), '--distributed=off'),
  ],
)
def test_plan_rejects_bad_flags(kwargs, expected):
  with pytest.raises(ValueError, match=expected.replace('[', r'\[')):
    distributed.plan({}, **kwargs)


def test_plan_from_slurm():
  env = {
    'SLURM_JOB_ID': '77',
    'SLURM_STEP_NODELIST': 'gpu[01-04]',
    'SLURM_NTASKS': '32',
    'SLURM_PROCID': '9',
    'SLURM_LOCALID': '1',
  }
  init = distributed.plan(env)
  # JAX derives coordinator, count and id, and one GPU per task.
  assert init == distributed.Init(
    'slurm', {'cluster_detection_method': 'slurm'}
  )
  # One task per node: that task drives all the node's GPUs.
  one_per_node = {
    **env,
    'SLURM_NTASKS': '4',
    'SLURM_NTASKS_PER_NODE': '1',
    'SLURM_GPUS_ON_NODE': '8',
  }
  assert distributed.plan(one_per_node).kwargs['local_device_ids'] == list(
    range(8)
  )
  # The batch script itself (no srun step) is not a task.
  del env['SLURM_STEP_NODELIST']
  assert distributed.plan(env) is None


def test_plan_on_cloud_tpu():
  workers = {'TPU_WORKER_HOSTNAMES': 'w0,w1,w2,w3', 'TPU_WORKER_ID': '2'}
  assert distributed.plan(workers) == distributed.Init('tpu', {})
  # GCE TPU VMs may only show their chips; JAX asks the metadata server.
  assert distributed.plan({}, tpu_chips=True) == distributed.Init('tpu', {})
  assert distributed.plan({}, mode='on') == distributed.Init('on', {})


def test_mismatch_message_names_processes_and_fields():
  same = distributed.fingerprint('{"a": 1}', 'abc123', '/w')
  assert distributed.mismatch_message([same, same, same]) is None
  other_config = distributed.fingerprint('{"a": 2}', 'abc123', '/w')
  other_commit = distributed.fingerprint('{"a": 1}', 'def456+dirty', '/w')
  message = distributed.mismatch_message([same, other_config, other_commit])
  assert 'config: process 0 has' in message
  assert f'process 1: {other_config["config"]}' in message
  assert 'commit: process 0 has abc123, but process 2: def456+dirty' in message
  assert '(1 of 3 processes differ)' in message
  assert 'workdir:' not in message


def test_git_commit_from_launcher_environment(monkeypatch):
  from pretrain_lm import workdir as workdir_lib

  # A copy of the code without .git (launch/tpu_pod.sh) is told its commit.
  monkeypatch.setenv('PRETRAIN_LM_GIT_COMMIT', 'abc123+dirty')
  assert workdir_lib.git_commit() == 'abc123+dirty'


# --- Two processes on this machine ---


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def compile_cache(tmp_path_factory):
  """A persistent compilation cache, so a relaunch skips most compiling."""
  return str(tmp_path_factory.mktemp('jax_cache'))


def launch(workdir, overrides, cache, num_processes=2, extra=None):
  """Starts `python -m pretrain_lm.main` as process 0..n-1 of one run.

  The 8 devices of OVERRIDES' mesh are split evenly over the processes.
  """
  port = free_port()
  devices = 8 // num_processes
  env = dict(
    os.environ,
    XLA_FLAGS=f'--xla_force_host_platform_device_count={devices} '
    f'{COMPILE_FLAGS}',
    JAX_PLATFORMS='cpu',
    JAX_COMPILATION_CACHE_DIR=cache,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
  )
  procs = []
  for i in range(num_processes):
    flags = {**overrides, **((extra or {}).get(i, {}))}
    cmd = [
      sys.executable,
      '-m',
      'pretrain_lm.main',
      f'--config={BERT}:size=tiny',
      f'--workdir={workdir}',
      f'--coordinator_address=127.0.0.1:{port}',
      f'--num_processes={num_processes}',
      f'--process_id={i}',
      *[f'--config.{k}={v}' for k, v in flags.items()],
    ]
    procs.append(
      subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  return procs


def finish(procs, timeout=300):
  """Waits for every process; returns [(exit code, output)]."""
  results = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    results.append((p.returncode, out))
  return results


def reference_run(workdir, overrides):
  """One process, 8 devices, fed both hosts' shards: the expected run."""
  c = load_config('bert', 'size=tiny')
  for key, value in overrides.items():
    section, field = key.split('.')
    c[section][field] = value
  trainer = train.Trainer(c, workdir)
  state = trainer.initial_state()
  hosts = [
    pipeline.train_iterator(
      c,
      trainer.tokenizer,
      objectives.row_transform(c),
      process_index=i,
      process_count=2,
    )
    for i in range(2)
  ]
  losses = {}
  with trainer.context():
    for step in range(1, STEPS + 1):
      parts = [next(h) for h in hosts]
      batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
      state, metrics = trainer._p_train_step(
        state, sharding.host_to_global(batch, trainer.mesh)
      )
      losses[step] = float(metrics['loss'])
  return losses, jax.device_get(state.params)


def read_losses(workdir):
  return {m['step']: m['loss'] for m in read_metrics(workdir) if 'loss' in m}


def assert_run_matches(workdir, want_losses, want_params):
  """The run logged every step's loss as the reference run and ended with
  its params (to the round-off of another mesh's reductions)."""
  got_losses = read_losses(workdir)
  assert sorted(got_losses) == sorted(want_losses), got_losses
  np.testing.assert_allclose(
    [got_losses[s] for s in sorted(want_losses)],
    [want_losses[s] for s in sorted(want_losses)],
    rtol=1e-5,
  )
  got_params = jax.device_get(pretrain_lm.load(workdir).params)
  for a, b in zip(
    jax.tree.leaves(want_params), jax.tree.leaves(got_params), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_two_processes_preempted_resume_as_two_slices_and_match_one(
  tmp_path, tokenizer_path, compile_cache
):
  """Preempted on one 2x2x2 mesh over two processes, the run resumes with
  each process as a slice (mesh.dcn_data=2: the data axis spans the two
  processes, one block each; fsdp and tensor stay inside a process), and
  is the one-process run."""
  overrides = {**OVERRIDES, 'data.tokenizer': tokenizer_path}
  workdir = str(tmp_path / 'multi')
  metrics = os.path.join(workdir, 'metrics.jsonl')

  # Preempt process 1 only: both must stop at the same step, save together
  # and ask to be resumed.
  procs = launch(workdir, overrides, compile_cache)
  deadline = time.time() + 300
  while time.time() < deadline and not (
    os.path.exists(metrics) and os.path.getsize(metrics) > 0
  ):
    assert all(p.poll() is None for p in procs), finish(procs)
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)
  results = finish(procs)
  for code, out in results:
    assert code == loop.EXIT_RESUME, out
  assert 'Exiting with code 75' in results[0][1]
  steps = os.listdir(os.path.join(workdir, 'checkpoints'))
  assert len(steps) == 1 and 0 < int(steps[0]) < STEPS, steps
  # The signalled process says it will save, the chief where it stopped,
  # and no step ran past the one saved.
  assert 'saving a checkpoint' in results[1][1], results[1][1]
  assert f'Stopping at step {steps[0]}' in results[0][1], results[0][1]
  assert max(read_losses(workdir)) == int(steps[0])

  # The rerun, as two slices, restores on both hosts and finishes.
  sliced = {**overrides, 'mesh.data': 1, 'mesh.dcn_data': 2}
  results = finish(launch(workdir, sliced, compile_cache))
  for code, out in results:
    assert code == 0, out
  chief, other = results[0][1], results[1][1]
  assert f'Resumed from {workdir}/checkpoints at step {steps[0]}' in chief
  assert 'step ' not in other and 'Resumed' not in other, other  # quiet
  want_losses, want_params = reference_run(str(tmp_path / 'ref'), overrides)
  assert_run_matches(workdir, want_losses, want_params)


def test_hosts_with_different_configs_fail_at_start(
  tmp_path, tokenizer_path, compile_cache
):
  overrides = {**OVERRIDES, 'data.tokenizer': tokenizer_path}
  procs = launch(
    str(tmp_path / 'bad'),
    overrides,
    compile_cache,
    extra={1: {'optimizer.learning_rate': 0.5}},
  )
  for code, out in finish(procs):
    assert code != 0, out
    assert 'The hosts of this run disagree' in out, out
    assert 'config: process 0 has' in out and 'process 1:' in out, out
    assert 'commit:' not in out and 'workdir:' not in out, out


def test_prepared_run_saved_on_two_processes_resumes_on_one(
  tmp_path, tokenizer_path, compile_cache
):
  """A prepared stream's batches do not depend on the host count, so a run
  checkpointed by 2 processes resumes on 1 with the batches, and so the
  losses, of one process that was never interrupted."""
  from pretrain_lm.data import prepare

  c = load_config('bert', 'size=tiny')
  for key, value in OVERRIDES.items():
    section, field = key.split('.')
    c[section][field] = value
  c.data.tokenizer = tokenizer_path
  corpus = tmp_path / 'prepared'
  prepare.prepare(
    c,
    str(corpus),
    objectives.row_transform(c),
    range_mb=0.3,
    beam_options='--direct_running_mode=in_memory',
    progress=False,
  )
  overrides = {
    **OVERRIDES,
    'data.source': f'prepared:{corpus}',
  }
  workdir = str(tmp_path / 'run')
  stop = {'train.exit_interval': STEPS // 2}
  results = finish(launch(workdir, {**overrides, **stop}, compile_cache))
  assert [code for code, _ in results] == [0, 0], results
  assert f'Stopping at step {STEPS // 2}' in results[0][1], results[0][1]
  ((code, out),) = finish(launch(workdir, overrides, compile_cache, 1))
  assert code == 0, out
  assert f'at step {STEPS // 2}' in out, out

  ref = load_config('bert', 'size=tiny')
  for key, value in overrides.items():
    section, field = key.split('.')
    ref[section][field] = value
  trainer = train.Trainer(ref, str(tmp_path / 'ref'))
  trainer.run()
  want, got = read_losses(str(tmp_path / 'ref')), read_losses(workdir)
  assert sorted(got) == list(range(1, STEPS + 1)), got
  np.testing.assert_allclose(
    [got[s] for s in sorted(want)], [want[s] for s in sorted(want)], rtol=1e-5
  )


# --- gs:// workdirs: every file goes through tf.io.gfile ---


def test_workdir_files_use_gfile_not_local_paths():
  """ram:// is gfile's in-memory filesystem: a local os/open call would miss."""
  import tensorflow as tf

  from pretrain_lm import checkpoint, metrics
  from pretrain_lm import workdir as workdir_lib

  workdir = 'ram://multihost_test/run'
  assert workdir_lib.absolute(workdir) == workdir
  assert workdir_lib.absolute('gs://bucket/run') == 'gs://bucket/run'
  c = load_config('bert', 'size=tiny')
  loop.write_run_files(c, workdir)
  meta = workdir_lib.read_json(f'{workdir}/run_metadata.json')
  assert len(meta['starts']) == 1
  assert workdir_lib.read_json(f'{workdir}/config.json') == json.loads(
    json.dumps(c.to_dict())
  )
  assert checkpoint.checkpoint_dir(workdir) == workdir
  tf.io.gfile.makedirs(f'{workdir}/checkpoints')
  assert checkpoint.checkpoint_dir(workdir) == f'{workdir}/checkpoints'
  writer = metrics.MetricWriter(
    workdir, total_steps=1, initial_step=0, enabled=True, progress_bar=False
  )
  writer.write(1, {'loss': 2.5}, console=False)
  writer.close()
  with tf.io.gfile.GFile(f'{workdir}/metrics.jsonl') as f:
    assert json.loads(f.read()) == {'step': 1, 'loss': 2.5}
  assert tf.io.gfile.listdir(f'{workdir}/tensorboard')
  assert not os.path.exists('ram:')
