"""SIGKILL during checkpoint saves: the latest committed one always restores.

The test starts this file as a child process (`python tests/fault_test.py
child DIR SAVES`) that restores the latest checkpoint of DIR, checks it, then
saves one asynchronous, sharded checkpoint per step whose values are a
function of the step, and kills it at many points of those saves.
"""

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def expected_state(step: int) -> dict:
  """What checkpoint `step` holds (~1 MB: a save takes a while)."""
  rng = np.random.RandomState(step)
  import ml_dtypes

  return {
    'params': {
      'w': rng.standard_normal((256, 512)).astype(np.float32),
      'b': rng.standard_normal(4096).astype(ml_dtypes.bfloat16),
    },
    'opt': [
      {'mu': rng.standard_normal((256, 512)).astype(np.float32)},
      {'count': np.int32(step)},
    ],
    'step': np.int32(step),
  }


def lost_bytes(got, want) -> int:
  """The bytes of `want`'s arrays that `got` does not hold exactly."""
  import jax

  lost = 0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    if np.asarray(a).tobytes() != np.asarray(b).tobytes():
      lost += np.asarray(b).nbytes
  return lost


def child(directory: str, saves: int) -> None:
  """Restores and checks the latest checkpoint, then saves until killed."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from pretrain_lm import checkpoint as ckpt

  mesh = jax.make_mesh((4,), ('data',))
  spec = lambda x: NamedSharding(mesh, P('data') if x.ndim == 2 else P())
  c = ckpt.Checkpointer(directory, keep=2, keep_every=4, async_save=True)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec(x)),
    expected_state(0),
  )
  restored = c.restore_latest(abstract)
  step = 0
  if restored is not None:
    step, state, _ = restored
    if lost_bytes(state, expected_state(step)):
      print(f'MISMATCH at step {step}', flush=True)
      sys.exit(3)
  print(f'ready {step} {json.dumps(c.leftovers())}', flush=True)
  end = step + saves if saves else float('inf')
  while step < end:
    step += 1
    state = jax.tree.map(
      lambda x: jax.device_put(x, spec(x)), expected_state(step)
    )
    c.save(step, state, {'step': step})
    # The save's background write is in flight now.
    print(f'saving {step}', flush=True)
  c.close()
  print('done', flush=True)


class Child:
  """A child process whose stdout lines are read with a deadline."""

  def __init__(self, directory: str, saves: int = 0):
    env = dict(
      os.environ,
      XLA_FLAGS='--xla_force_host_platform_device_count=4',
      JAX_PLATFORMS='cpu',
    )
    self.proc = subprocess.Popen(
      [sys.executable, __file__, 'child', directory, str(saves)],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    self.lines = []
    self._stderr = []
    # Drained in the background, so a chatty child never blocks on it.
    threading.Thread(
      target=lambda: self._stderr.extend(self.proc.stderr), daemon=True
    ).start()

  def read_until(self, prefix: str, timeout: float = 120) -> str:
    killer = threading.Timer(timeout, self.proc.kill)
    killer.start()
    try:
      for line in self.proc.stdout:
        self.lines.append(line.strip())
        if line.startswith(prefix):
          return line.strip()
        assert not line.startswith('MISMATCH'), line
    finally:
      killer.cancel()
    raise AssertionError(
      f'child ended before {prefix!r}: {self.lines}\n'
      + ''.join(self._stderr[-30:])
    )

  def kill(self) -> None:
    self.proc.send_signal(signal.SIGKILL)
    assert self.proc.wait(timeout=60) == -signal.SIGKILL


# Where each fault strikes: right as the first save starts, right after
# save() returned (the async write in flight), and at delays spread over
# the following save cycle (writes, commits, retention's deletes).
FAULTS = (
  [('after ready', 0.0)]
  + [('write in flight', n) for n in (1, 2, 3, 1)]
  + [('delay', d) for d in (0.0, 0.03, 0.08, 0.15, 0.3)]
)


def phase(directory: str) -> str:
  """What the kill interrupted, from what it left on disk."""
  names = os.listdir(directory) if os.path.isdir(directory) else []
  if any('.orbax-checkpoint-tmp' in n for n in names):
    return 'mid-write'
  if any(n.startswith('deleting-') for n in names):
    return 'mid-delete'
  return 'between saves'


def test_sigkill_during_saves_loses_no_committed_checkpoint(tmp_path):
  import jax

  from pretrain_lm import checkpoint as ckpt

  directory = str(tmp_path / 'checkpoints')
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), expected_state(0)
  )
  phases = collections.Counter()
  recovered = bytes_lost = checked = 0
  want = 0  # the step the next start must resume from
  proc = Child(directory)
  for i, (kind, arg) in enumerate(FAULTS):
    ready = proc.read_until('ready').split(' ', 2)
    start = int(ready[1])
    # A restart resumed the latest committed step, after removing what
    # the kill left half-written.
    if i and start == want and json.loads(ready[2]) == []:
      recovered += 1
    if kind == 'write in flight':
      proc.read_until(f'saving {start + arg}')
    elif kind == 'delay':
      proc.read_until(f'saving {start + 2}')
      time.sleep(arg)
    proc.kill()
    phases[phase(directory)] += 1
    # Every committed checkpoint holds exactly what was saved.
    reader = ckpt.Checkpointer(directory, keep=0, read_only=True)
    for step in reader.all_steps():
      checked += 1
      try:
        state, _ = reader.restore(step, abstract)
        bytes_lost += lost_bytes(state, expected_state(step))
      except ckpt.CorruptCheckpointError:
        bytes_lost += sum(x.nbytes for x in jax.tree.leaves(expected_state(0)))
    want = max(reader.all_steps(), default=0)
    reader.close()
    # After the last fault: resume, save three more, finish cleanly.
    proc = Child(directory, saves=3 if i == len(FAULTS) - 1 else 0)

  ready = proc.read_until('ready').split(' ', 2)
  if int(ready[1]) == want and json.loads(ready[2]) == []:
    recovered += 1
  proc.read_until('done')
  assert proc.proc.wait(timeout=60) == 0
  reader = ckpt.Checkpointer(directory, keep=0, read_only=True)
  assert reader.latest_step() == want + 3
  state, _ = reader.restore(want + 3, abstract)
  assert not lost_bytes(state, expected_state(want + 3))
  reader.close()

  faults = len(FAULTS)
  print(
    f'\nfault injection: {faults} SIGKILLs during async sharded saves '
    f'({dict(phases)}); {recovered}/{faults} restarts resumed the latest '
    f'committed step with no leftovers; {checked} committed checkpoints '
    f'checked, {bytes_lost} bytes lost.'
  )
  assert recovered == faults
  assert bytes_lost == 0
  # The kills did land inside saves, not only between them.
  assert phases['mid-write'] >= 3, phases


if __name__ == '__main__' and sys.argv[1:2] == ['child']:
  child(sys.argv[2], int(sys.argv[3]))
