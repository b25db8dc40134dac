"""Exact resume for every objective, and restores onto smaller meshes.

Training 2N steps equals training N, stopping, and training N more in a new
process: params, optimizer state, dropout RNG and the next batch agree bit
for bit on the (data, fsdp, tensor) = (2, 2, 2) mesh of 8 fake devices.
The checkpoint written there also restores onto 4 devices and onto 1.

Compiling dominates on CPU, so two child processes (this file run as a
script) do the work for a list of objectives at once, sharing a persistent
compilation cache (the suite's, where conftest made one): `straight`
trains 2N steps, saving at N, and writes its final state and next batch;
`resume` restores step N in a new process, trains N steps and writes the
same; this process compares the files.

What an objective adds to a resume is its model's state (each model class
has its own parameters and optimizer state) and its input stream (masking,
spans, prefixes, denoisers); the step's draws (dropout, ELECTRA's samples,
XLNet's permutations) are folded from the state's RNG and step. The
default run checks every objective's stream restarting at its batch here,
and configs_test restores every preset's whole state bit for bit; this
file resumes MLM across processes (with the restores onto smaller meshes),
and every other objective under `make test-all` (slow: the ten together
take several times what MLM with its restores does;
experiments/benchmarks/README.md, Test-suite time).
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 2  # steps before and after the restart
# objective.name -> the config preset that trains it.
PRESETS = {
  'mlm': ('bert', 'size=tiny'),
  'clm': ('gpt', 'size=tiny'),
  'reconstruct': ('t5', 'size=tiny'),
  'electra': ('electra', 'size=tiny'),
  'prefix_lm': ('gpt', 'size=tiny,objective=prefix_lm'),
  'bilm': ('bilm', 'size=tiny'),
  'plm': ('xlnet', 'size=tiny'),
  'span_corruption': ('t5', 'size=tiny'),
  'ul2': ('ul2', 'size=tiny'),
  'ul2_decoder': ('ul2', 'size=tiny,decoder'),
  'denoising': ('bart', 'size=tiny'),
}
# The objective resumed across processes in the default run, whose
# checkpoint is also restored onto smaller meshes.
MESH_OBJECTIVE = 'mlm'
OTHERS = tuple(o for o in PRESETS if o != MESH_OBJECTIVE)
SMALLER_MESHES = {4: (2, 2, 1), 1: (1, 1, 1)}  # devices -> (data, fsdp, tensor)


def tiny_config(objective: str, tokenizer_path: str):
  """The objective's preset as configs_test trains it (the same shapes, so
  the suite's compilation cache compiles its step once for both files)."""
  from configs_test import shrunk

  c = shrunk(*PRESETS[objective], tokenizer_path)
  c.objective.name = objective
  c.data.shuffle_buffer = 16
  c.checkpoint.every = N
  c.checkpoint.async_save = False
  return c


def _flat(tree, prefix: str) -> dict:
  import jax

  leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
  return {prefix + jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def _train(trainer, state, batches, count: int):
  """`count` steps on `batches`, as Trainer.run takes them; + the losses."""
  from pretrain_lm import sharding

  losses = []
  with trainer.context():
    for _ in range(count):
      batch = sharding.host_to_global(next(batches), trainer.mesh)
      state, metrics = trainer._p_train_step(state, batch)
      losses.append(float(metrics['loss']))
  return state, losses


def _dump(path: str, state, next_batch: dict) -> None:
  np.savez(
    path,
    **_flat(state, 'state'),
    **{f'batch/{k}': v for k, v in next_batch.items()},
  )


def child(mode: str, root: str, tokenizer_path: str, objectives: str) -> None:
  """The `straight` or `resume` half, for each of the comma-separated
  objectives."""
  import jax

  from pretrain_lm import sharding, train

  for objective in objectives.split(','):
    c = tiny_config(objective, tokenizer_path)
    workdir = os.path.join(root, objective)
    trainer = train.Trainer(c, workdir)
    state = trainer.initial_state()
    if mode == 'straight':
      assert int(state.step) == 0, 'the straight run must start afresh'
      batches = trainer._stage_data(0)[0]
      state, _ = _train(trainer, state, batches, N)
      # What Trainer.run saves at step N; the stream goes on regardless.
      trainer.checkpointer.save(N, state, trainer.checkpoint_meta(state))
      trainer.checkpointer.wait()
      _dump(os.path.join(workdir, 'at_n.npz'), state, {})
    else:
      assert int(state.step) == N, int(state.step)
      batches = trainer._stage_data(N)[0]  # where Trainer.run reopens it
    state, losses = _train(trainer, state, batches, N)
    _dump(os.path.join(workdir, f'{mode}.npz'), state, next(batches))
    trainer.checkpointer.close()
    if mode != 'resume' or objective != MESH_OBJECTIVE:
      continue
    # Step N, written on 8 devices, restored onto 4 and onto 1.
    result = {8: losses}
    for devices, shape in SMALLER_MESHES.items():
      c.mesh.data, c.mesh.fsdp, c.mesh.tensor = shape
      mesh = sharding.make_mesh(c.mesh, jax.devices()[:devices])
      trainer = train.Trainer(c, workdir, mesh)
      state = trainer.initial_state()
      leaf = state.params['token_embed']['embedding']
      assert leaf.sharding.mesh.devices.size == devices
      _dump(os.path.join(workdir, f'restored_{devices}.npz'), state, {})
      batches = trainer._stage_data(N)[0]
      result[devices] = _train(trainer, state, batches, N)[1]
      trainer.checkpointer.close()
    with open(os.path.join(workdir, 'losses.json'), 'w') as f:
      json.dump(result, f)


def run_child(mode, root, tokenizer_path, cache, objectives):
  env = dict(
    os.environ,  # conftest's XLA_FLAGS: the same 8 fake devices
    JAX_PLATFORMS='cpu',
    JAX_COMPILATION_CACHE_DIR=cache,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
  )
  result = subprocess.run(
    [
      sys.executable,
      __file__,
      mode,
      root,
      tokenizer_path,
      ','.join(objectives),
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stdout + result.stderr


def load(path):
  with np.load(path) as f:
    return dict(f)


def resume_in_two_processes(tmp_path, tokenizer_path, objectives) -> str:
  """Both halves in their processes; then the files agree bit for bit.
  Returns the runs' root directory."""
  root = str(tmp_path / 'runs')
  cache = os.environ.get('JAX_COMPILATION_CACHE_DIR') or str(
    tmp_path / 'jax_cache'
  )
  run_child('straight', root, tokenizer_path, cache, objectives)
  run_child('resume', root, tokenizer_path, cache, objectives)

  for objective in objectives:
    workdir = os.path.join(root, objective)
    straight = load(os.path.join(workdir, 'straight.npz'))
    resumed = load(os.path.join(workdir, 'resume.npz'))
    assert straight.keys() == resumed.keys(), objective
    for key, want in straight.items():
      np.testing.assert_array_equal(resumed[key], want, err_msg=objective + key)
    # Every state leaf (step, params, optimizer state, RNG) and the batch.
    assert any('opt_state' in k for k in straight), straight.keys()
    assert any(k.startswith('batch/') for k in straight), straight.keys()
    assert straight['state.step'] == 2 * N
    # Resumed from step N's checkpoint, not trained from scratch.
    assert glob.glob(os.path.join(workdir, 'checkpoints', str(N))), objective
  return root


def test_resume_is_bitwise_and_restores_on_other_meshes(
  tmp_path, tokenizer_path
):
  root = resume_in_two_processes(tmp_path, tokenizer_path, [MESH_OBJECTIVE])

  # Restoring onto 4 devices and onto 1 gives back the values saved on 8
  # bit for bit, and the same first loss to float32 round-off (the
  # reductions are split differently); Adam then magnifies the round-off.
  workdir = os.path.join(root, MESH_OBJECTIVE)
  saved = load(os.path.join(workdir, 'at_n.npz'))
  with open(os.path.join(workdir, 'losses.json')) as f:
    losses = json.load(f)
  for devices in SMALLER_MESHES:
    restored = load(os.path.join(workdir, f'restored_{devices}.npz'))
    assert restored.keys() == saved.keys()
    for key, want in saved.items():
      np.testing.assert_array_equal(restored[key], want, err_msg=key)
    got, want = losses[str(devices)], losses['8']
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=0)
    np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.slow
def test_resume_is_bitwise_for_the_other_objectives(tmp_path, tokenizer_path):
  # Covered in the default run by the parts a resume is made of: every
  # preset's state restoring bit for bit (configs_test), every objective's
  # stream restarting at its batch (below), and MLM's resume above.
  resume_in_two_processes(tmp_path, tokenizer_path, OTHERS)


def test_every_objectives_stream_restarts_at_its_batch(
  tmp_path, tokenizer_path
):
  """The stream a resume at step N reopens (pipeline.train_dataset from
  batch N, as Trainer._stage_data builds it) is the fresh stream's batches
  from N on, for every objective: its masking, spans, prefixes or
  denoisers depend on the batch's index, not on what came before."""
  from pretrain_lm import objectives
  from pretrain_lm.data import pipeline
  from pretrain_lm.data import tokenizer as tokenizer_lib

  assert set(PRESETS) == set(objectives.OBJECTIVES)
  for objective in PRESETS:
    c = tiny_config(objective, tokenizer_path)
    tokenizer = tokenizer_lib.setup_tokenizer(
      c.data,
      vocab_size=c.model.vocab_size,
      workdir=str(tmp_path / objective),
      reserved_ids=objectives.num_reserved_ids(
        objectives.OBJECTIVES[objective], c.objective
      ),
    )

    def batches(start, count, c=c, tokenizer=tokenizer):
      ds = pipeline.train_dataset(
        c, tokenizer, objectives.row_transform(c), start_batch=start
      )
      return list(ds.take(count).as_numpy_iterator())

    fresh, restarted = batches(0, N + 2), batches(N, 2)
    for want, got in zip(fresh[N:], restarted, strict=True):
      assert want.keys() == got.keys(), objective
      for key in want:
        np.testing.assert_array_equal(got[key], want[key], f'{objective}/{key}')
    # The restart is not the start: the check can tell batches apart.
    assert any(not np.array_equal(fresh[0][k], fresh[N][k]) for k in want)


if __name__ == '__main__':
  child(*sys.argv[1:5])
