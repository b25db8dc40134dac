"""Checkpoint storage: checksums, corruption, strict restore, retention."""

import glob
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import assert_trees_equal, read_metrics
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pretrain_lm import checkpoint as ckpt
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.checkpoint import integrity


def make_state(step: int, mesh=None) -> dict:
  """A small state whose values are a function of `step`, maybe sharded."""
  rng = np.random.RandomState(step)
  state = {
    'params': {
      'dense': {'kernel': rng.standard_normal((64, 16)).astype(np.float32)},
      'norm': {'scale': rng.standard_normal(16).astype(jnp.bfloat16)},
    },
    'opt': [{'count': np.int32(step)}, {'mu': np.zeros((64, 16), np.float32)}],
    'rng': rng.randint(0, 2**31, size=2).astype(np.uint32),
    'step': np.int32(step),
  }
  if mesh is None:
    return jax.tree.map(jnp.asarray, state)
  row = NamedSharding(mesh, P('data'))
  rep = NamedSharding(mesh, P())
  return jax.tree.map(
    lambda x: jax.device_put(x, row if x.ndim == 2 else rep), state
  )


def abstract_of(state):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    state,
  )


@pytest.fixture
def mesh():
  return jax.make_mesh((8,), ('data',), devices=jax.devices()[:8])


def saved(directory, steps, mesh=None, **kwargs) -> ckpt.Checkpointer:
  c = ckpt.Checkpointer(directory, keep=0, async_save=False, **kwargs)
  for s in steps:
    c.save(s, make_state(s, mesh), {'step': s})
  c.close()
  # A new one, as a restarted process has: it has saved nothing itself.
  return ckpt.Checkpointer(directory, keep=0, **kwargs)


def data_files(directory, step):
  """Step `step`'s array data files, largest first."""
  pattern = os.path.join(directory, str(step), 'state', '**', 'd', '*')
  files = glob.glob(pattern, recursive=True)
  return sorted(files, key=os.path.getsize, reverse=True)


# --- Retention (a pure function).


def test_retention_policy_unions_latest_best_and_permanent():
  steps = list(range(100, 1100, 100))
  metric = {s: 1.0 for s in steps}
  metric[300], metric[600], metric[700] = 0.1, 0.2, float('nan')
  metric[1000] = None
  keep = lambda **kw: ckpt.retained_steps(steps, metrics=metric, **kw)
  assert keep(keep=2) == {900, 1000}
  assert keep(keep=0) == set(steps)  # 0: keep all
  # Best 2 by the lowest metric; NaN and missing metrics are never ranked.
  assert keep(keep=1, keep_best=2) == {300, 600, 1000}
  assert keep(keep=1, keep_best=1, best_mode='max') == {900, 1000}
  assert keep(keep=1, keep_every=400) == {400, 800, 1000}
  assert keep(keep=2, keep_best=1, keep_every=500) == {300, 500, 900, 1000}
  # The newest survives whatever the policies say.
  assert 1000 in keep(keep=1, keep_best=1)
  assert ckpt.retained_steps([5], keep=1, keep_best=1, metrics={}) == {5}
  assert ckpt.retained_steps([], keep=1) == set()


# --- Checksums.


def test_checksums_are_sharding_invariant_and_see_every_change(mesh):
  state = make_state(3)
  sums = ckpt.checksums(state)
  assert sums == ckpt.checksums(make_state(3, mesh))
  assert sums == ckpt.checksums(jax.device_get(state))
  assert set(sums) == {
    'params/dense/kernel',
    'params/norm/scale',
    'opt/0/count',
    'opt/1/mu',
    'rng',
    'step',
  }
  kernel = np.asarray(state['params']['dense']['kernel'])
  flipped = kernel.view(np.uint32).copy()
  flipped[17, 3] ^= 1 << 20  # one bit of one element
  swapped = kernel.copy()
  swapped[[0, 1]] = swapped[[1, 0]]  # same values, other places
  for changed in (flipped.view(np.float32), swapped):
    other = ckpt.checksums({'k': changed})['k']
    assert other != ckpt.checksums({'k': kernel})['k']
  # Small dtypes too: one bf16 element, one bool.
  scale = state['params']['norm']['scale']
  assert ckpt.checksums(scale) != ckpt.checksums(scale.at[5].add(1))
  flags = jnp.zeros(7, bool)
  assert ckpt.checksums(flags) != ckpt.checksums(flags.at[6].set(True))


def test_host_sum_equals_the_on_device_sum():
  """CPU arrays are summed in NumPy, shard by shard; XLA's sum is the spec.

  Shards split along every axis, partly replicated (only replica 0 counts)
  and whole; every word size, keys, scalars.
  """
  mesh = jax.make_mesh((2, 2, 2), ('a', 'b', 'c'), devices=jax.devices()[:8])
  x = np.random.RandomState(0).standard_normal((6, 8, 4)).astype(np.float32)

  def put(value, *spec):
    return jax.device_put(value, NamedSharding(mesh, P(*spec)))

  flat = ckpt.flatten(
    {
      'split_3_ways': put(x, 'a', 'b', 'c'),
      'split_and_replicated': put(x, None, ('a', 'c')),
      'replicated': put(x, None),
      'bf16': put(x.astype(jnp.bfloat16), 'b'),
      'bool': jnp.asarray(x > 0),
      'int8': jnp.asarray((10 * x).astype(np.int8)),
      'uint16': jnp.arange(10, dtype=jnp.uint16),
      'scalar': jnp.int32(7),
      'typed_key': jax.random.key(3),
      'raw_key': jax.random.PRNGKey(3),
    }
  )
  assert all(integrity._on_host(v) for v in flat.values())
  on_device = integrity._device_checksums(flat)
  assert {k: integrity._host_checksum(v) for k, v in flat.items()} == on_device
  assert ckpt.checksums(flat) == on_device
  # Sharding changes nothing; the values do.
  assert on_device['split_3_ways'] == on_device['replicated']
  assert on_device['split_3_ways'] != integrity._host_checksum(put(-x, 'a'))


def test_host_sum_equals_the_on_device_sum_for_64_bit_words():
  """8-byte elements are two words each: NumPy's view and XLA's bitcast
  must put them in the same order, or an x64 run's checksums would
  disagree between the CPU and a device."""
  mesh = jax.make_mesh((2, 4), ('a', 'b'), devices=jax.devices()[:8])
  rng = np.random.RandomState(0)
  with jax.enable_x64(True):
    doubles = rng.standard_normal((4, 8))
    longs = rng.randint(-(2**62), 2**62, (4, 8), dtype=np.int64)
    flat = ckpt.flatten(
      {
        'float64': jax.device_put(doubles, NamedSharding(mesh, P('a', 'b'))),
        'int64': jax.device_put(longs, NamedSharding(mesh, P(None, 'b'))),
        'uint64': jnp.asarray(longs.view(np.uint64)),
      }
    )
    assert flat['float64'].dtype == jnp.float64
    on_device = integrity._device_checksums(flat)
    assert {
      k: integrity._host_checksum(v) for k, v in flat.items()
    } == on_device
    # Swapping the two words of one element changes the sum.
    swapped = longs.copy()
    swapped.view(np.uint32).reshape(4, 8, 2)[0, 0] = swapped.view(
      np.uint32
    ).reshape(4, 8, 2)[0, 0, ::-1]
    assert integrity._host_checksum(jnp.asarray(swapped)) != on_device['int64']


def test_one_process_writes_replicated_shards_whole(tmp_path):
  """Orbax's replica-parallel slicing is off in a single process.

  It would cut each replicated shard into one slice per replica (each a
  small XLA compile on the first save); whole shards are written instead,
  and they restore to the same values and shardings.
  """
  mesh = jax.make_mesh((2, 4), ('data', 'model'), devices=jax.devices()[:8])
  state = {
    'rows': jax.device_put(  # 4 replicas of each of 2 row blocks
      jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16),
      NamedSharding(mesh, P('data')),
    ),
    'replicated': jax.device_put(
      jnp.arange(32, dtype=jnp.float32), NamedSharding(mesh, P())
    ),
  }
  c = ckpt.Checkpointer(str(tmp_path), keep=0, async_save=False)
  c.save(1, state, {'step': 1})
  c.wait()
  tree = c.manager.item_metadata(1)['state'].tree
  for name, x in state.items():
    shard = x.sharding.shard_shape(x.shape)
    assert tree[name].storage.write_shape == shard, name
  restored, _ = c.restore(1, abstract_of(state))
  assert_trees_equal(restored, state)
  assert restored['rows'].sharding == state['rows'].sharding
  c.close()


# --- Round trip, corruption, fallback.


def test_async_sharded_round_trip_stores_checksums(tmp_path, mesh):
  c = ckpt.Checkpointer(str(tmp_path), keep=0, async_save=True)
  state = make_state(7, mesh)
  c.save(7, state, {'step': 7})
  c.wait()
  restored, meta = c.restore(7, abstract_of(state))
  assert_trees_equal(restored, state)
  assert restored['params']['dense']['kernel'].sharding == (
    state['params']['dense']['kernel'].sharding
  )
  assert meta['step'] == 7 and meta['checksums'] == ckpt.checksums(state)
  c.close()


def test_changed_content_is_detected_and_named(tmp_path):
  directory = str(tmp_path)
  c = saved(directory, [1, 2])
  abstract = abstract_of(make_state(2))
  # Step 1's arrays under step 2's checksums: readable, but not what step
  # 2 saved. Only the arrays that differ are named.
  shutil.rmtree(tmp_path / '2' / 'state')
  shutil.copytree(tmp_path / '1' / 'state', tmp_path / '2' / 'state')
  with pytest.raises(ckpt.CorruptCheckpointError) as e:
    c.restore(2, abstract)
  message = str(e.value)
  assert 'step 2' in message and directory in message, message
  assert 'params/dense/kernel' in message and 'checksum' in message
  assert 'opt/1/mu' not in message  # zeros at both steps
  assert e.value.step == 2


# Orbax's async readers leave an 'Event loop is closed' behind a failed read.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
@pytest.mark.parametrize('damage', ['flip', 'truncate'])
def test_damaged_file_fails_naming_the_step(tmp_path, damage):
  c = saved(str(tmp_path), [1, 2])
  for path in data_files(str(tmp_path), 2):
    data = bytearray(pathlib.Path(path).read_bytes())
    if damage == 'flip':
      data[len(data) // 2] ^= 0x10
    else:
      data = data[: len(data) // 2]
    pathlib.Path(path).write_bytes(data)
  with pytest.raises(ckpt.CorruptCheckpointError, match='step 2 in'):
    c.restore(2, abstract_of(make_state(2)))
  # Step 1 is untouched and still restores.
  restored, _ = c.restore(1, abstract_of(make_state(1)))
  assert_trees_equal(restored, make_state(1))


def corrupt_latest(directory, step):
  """Flips a byte in the biggest array file of `step`; returns its bytes."""
  path = data_files(directory, step)[0]
  data = bytearray(pathlib.Path(path).read_bytes())
  data[len(data) // 2] ^= 0x10
  pathlib.Path(path).write_bytes(data)
  return bytes(data)


def test_on_corrupt_fail_changes_nothing_previous_moves_aside(tmp_path):
  directory = str(tmp_path)
  c = saved(directory, [1, 2, 3])
  damaged = corrupt_latest(directory, 3)
  abstract = abstract_of(make_state(3))
  with pytest.raises(ckpt.CorruptCheckpointError) as e:
    c.restore_latest(abstract)  # on_corrupt='fail' by default
  assert 'step 3' in str(e.value) and 'on_corrupt=previous' in str(e.value)
  assert c.all_steps() == [1, 2] + [3] and not c.leftovers()

  step, state, meta = c.restore_latest(abstract, on_corrupt='previous')
  assert (step, meta['step']) == (2, 2)
  assert_trees_equal(state, make_state(2))
  # Moved out of Orbax's sight, not deleted: its bytes are all there.
  assert c.all_steps() == [1, 2]
  assert c.leftovers() == ['corrupt-3']
  moved = data_files(directory, 'corrupt-3')
  assert damaged in [pathlib.Path(p).read_bytes() for p in moved]
  # The next save at step 3 does not collide with it.
  c.save(3, make_state(3), {'step': 3})
  c.wait()
  assert c.restore_latest(abstract)[0] == 3
  c.close()


def test_never_starts_over_on_top_of_checkpoints(tmp_path):
  directory = str(tmp_path / 'ckpt')
  abstract = abstract_of(make_state(1))
  # Nothing there: a fresh start is right.
  empty = ckpt.Checkpointer(directory, keep=0)
  assert empty.restore_latest(abstract) is None
  empty.close()
  c = saved(directory, [1, 2])
  for step in (1, 2):
    corrupt_latest(directory, step)
  with pytest.raises(ckpt.NoRestorableCheckpointError) as e:
    c.restore_latest(abstract, on_corrupt='previous')
  message = str(e.value)
  assert 'step 2:' in message and 'step 1:' in message, message
  assert 'refusing to start from scratch' in message
  # Later starts see only the moved-aside ones, and still refuse.
  again = ckpt.Checkpointer(directory, keep=0)
  assert again.all_steps() == []
  with pytest.raises(ckpt.NoRestorableCheckpointError, match='corrupt-1'):
    again.restore_latest(abstract, on_corrupt='previous')


# --- Strict restore.


def test_strict_restore_lists_every_difference(tmp_path):
  c = saved(str(tmp_path), [4])
  target = make_state(4)
  target['params']['dense']['kernel'] = jnp.zeros((64, 8), jnp.float32)
  target['params']['norm']['scale'] = jnp.zeros(16, jnp.float32)
  target['params']['extra'] = jnp.zeros(3)
  del target['rng']
  with pytest.raises(ckpt.TreeMismatchError) as e:
    c.restore(4, abstract_of(target))
  message = str(e.value)
  for text in (
    'step 4',
    '4 differences',
    'missing from the checkpoint: params/extra',
    'not in the target: rng (saved as uint32[2])',
    'shape of params/dense/kernel: saved (64, 16), the target expects (64, 8)',
    'dtype of params/norm/scale: saved bfloat16, the target expects float32',
  ):
    assert text in message, message

  # Params only: the params subtree must match exactly ...
  params = abstract_of(make_state(4)['params'])
  assert_trees_equal(c.restore_params(4, params), make_state(4)['params'])
  del params['norm']
  with pytest.raises(ckpt.TreeMismatchError, match='not in the target: norm'):
    c.restore_params(4, params)
  # ... unless partial: top-level entries may stay on disk (fine-tuning
  # drops the heads), what is restored must still match.
  got = c.restore_params(4, params, partial=True)
  assert_trees_equal(got, {'dense': make_state(4)['params']['dense']})
  params['dense']['kernel'] = jax.ShapeDtypeStruct((64, 16), jnp.bfloat16)
  with pytest.raises(ckpt.TreeMismatchError, match='dtype of dense/kernel'):
    c.restore_params(4, params, partial=True)


# --- Retention on disk, leftovers.


def test_retention_on_disk_and_leftover_cleanup(tmp_path):
  directory = str(tmp_path)
  c = ckpt.Checkpointer(
    directory, keep=2, keep_best=1, best_metric='eval_loss', keep_every=4
  )
  losses = {1: 3.0, 2: 1.0, 3: 2.0, 5: 0.5}
  for s in range(1, 8):
    metrics = {'eval_loss': losses[s]} if s in losses else None
    c.save(s, make_state(s), {'step': s}, metrics=metrics)
  c.close()
  # Latest 2 (6, 7), best eval_loss (5), multiples of 4 (4).
  assert sorted(os.listdir(directory)) == ['4', '5', '6', '7']
  meta = json.loads((tmp_path / '5' / 'meta' / 'metadata').read_text())
  assert meta['eval_metrics'] == {'eval_loss': 0.5}
  assert isinstance(meta['checksums']['step'], int)

  # What a killed save or delete leaves is removed by the next writer,
  # before it lists the steps; committed steps are never touched.
  (tmp_path / '8.orbax-checkpoint-tmp').mkdir()
  (tmp_path / '8.orbax-checkpoint-tmp' / 'half').write_text('x')
  (tmp_path / 'deleting-6').mkdir()
  reader = ckpt.Checkpointer(directory, keep=0, read_only=True)
  assert reader.leftovers() == ['8.orbax-checkpoint-tmp', 'deleting-6']
  writer = ckpt.Checkpointer(directory, keep=2, keep_best=1, keep_every=4)
  assert writer.leftovers() == []
  assert writer.all_steps() == [4, 5, 6, 7]
  # The best one is known again after the restart (read from its meta).
  writer.save(8, make_state(8), {'step': 8})
  writer.close()
  assert sorted(os.listdir(directory)) == ['4', '5', '7', '8']


def test_local_cleanup_is_done_when_the_constructor_returns(
  tmp_path, monkeypatch
):
  # Nothing may go on deleting in the background (Orbax's own cleanup pass):
  # it raced a later save into the same directory once.
  background = []
  monkeypatch.setattr(
    ocp.checkpoint_manager.temporary_paths,
    'cleanup_temporary_paths',
    lambda *args, **kwargs: background.append(args),
  )
  (tmp_path / '3.orbax-checkpoint-tmp').mkdir()
  c = ckpt.Checkpointer(str(tmp_path), keep=0)
  assert background == [] and c.leftovers() == []
  # Left open on purpose: a second one saves into the same directory.
  saved(str(tmp_path), [1, 2])
  assert sorted(os.listdir(tmp_path)) == ['1', '2']


# --- In a real run.


def tiny_config(**overrides):
  """configs/bert.py:size=tiny at its smallest, plus `section.field` items."""
  from conftest import load_config

  c = load_config('bert', 'size=tiny')
  c.model.vocab_size = 512 + 128
  c.model.num_layers = 1
  c.data.tokenizer_max_docs = 2000
  c.data.seq_len = 32
  c.data.batch_size = 8
  c.data.shuffle_buffer = 64
  c.data.eval_batches = 1
  c.optimizer.warmup_steps = 1
  c.train.progress_bar = False
  for key, value in overrides.items():
    section, field = key.split('.')
    c[section][field] = value
  return c


def test_trainer_retention_corruption_and_never_starting_over(tmp_path):
  from pretrain_lm import train

  workdir = str(tmp_path)
  run = {
    'train.num_steps': 6,
    'train.log_every': 6,
    'train.eval_every': 2,
    'checkpoint.every': 3,
    'checkpoint.keep': 1,
    'checkpoint.keep_best': 1,
    'checkpoint.best_mode': 'max',
    'checkpoint.keep_every': 3,
    'checkpoint.async_save': True,
  }
  train.train_and_evaluate(tiny_config(**run), workdir)
  directory = os.path.join(workdir, 'checkpoints')
  evals = {
    m['step']: m['eval_loss'] for m in read_metrics(workdir) if 'eval_loss' in m
  }
  # Saved at 3, 6 (checkpoint.every) and at every eval (2, 4, 6); kept:
  # the latest, the highest eval_loss, the multiples of 3.
  assert sorted(evals) == [2, 4, 6]
  worst = max(evals, key=lambda s: (evals[s], s))
  assert sorted(map(int, os.listdir(directory))) == sorted({6, worst, 3})
  meta = workdir_lib.read_json(
    os.path.join(directory, str(worst), 'meta', 'metadata')
  )
  assert meta['eval_metrics']['eval_loss'] == evals[worst]
  assert 'params/token_embed/embedding' in meta['checksums']

  # Another model: every differing path is listed, nothing is restored.
  wider = train.Trainer(tiny_config(**run, **{'model.num_layers': 2}), workdir)
  with pytest.raises(ckpt.TreeMismatchError) as e:
    wider.initial_state()
  assert 'missing from the checkpoint: params/encoder/layer_1/' in str(e.value)
  assert 'step 6' in str(e.value)

  corrupt_latest(directory, 6)
  trainer = train.Trainer(tiny_config(**run), workdir)
  with pytest.raises(ckpt.CorruptCheckpointError, match='step 6 in'):
    trainer.initial_state()
  previous = {**run, 'checkpoint.on_corrupt': 'previous'}
  trainer = train.Trainer(tiny_config(**previous), workdir)
  older = max({worst, 3})
  assert int(trainer.initial_state().step) == older
  assert 'corrupt-6' in os.listdir(directory)

  # Nothing restorable left: the run stops rather than start over.
  for step in {worst, 3}:
    corrupt_latest(directory, step)
  trainer = train.Trainer(tiny_config(**previous), workdir)
  with pytest.raises(ckpt.NoRestorableCheckpointError, match='from scratch'):
    trainer.initial_state()


@pytest.mark.parametrize(
  'field, value, expected',
  [
    ('on_corrupt', 'later', "checkpoint.on_corrupt='later'"),
    ('best_mode', 'lowest', "checkpoint.best_mode='lowest'"),
    ('keep_every', -1, 'checkpoint.keep_every=-1 must be >= 0'),
    ('best_metric', 'loss', "checkpoint.best_metric='loss' must name an eval"),
  ],
)
def test_bad_checkpoint_fields_are_named(field, value, expected):
  from pretrain_lm import validate

  c = tiny_config(**{'checkpoint.keep_best': 1, f'checkpoint.{field}': value})
  with pytest.raises(ValueError, match=expected.replace('.', r'\.')):
    validate.check_config(c)
