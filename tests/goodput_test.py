"""Goodput accounting, input-bound detection and profiles of the real run."""

import glob
import itertools
import os
import time

import jax
import pytest
from conftest import load_config, read_metrics

from pretrain_lm import describe, goodput, sharding, train, validate


class FakeClock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_accountant_books_causes_and_productive_is_the_rest():
  clock = FakeClock()
  acct = goodput.Accountant(clock)
  with acct.timing('restore'):
    clock.now += 2
  clock.now += 3  # building the model, the pipeline
  acct.end_startup()
  with acct.timing('compile'):
    clock.now += 10
  acct.add('input', 1.5)
  clock.now += 20  # steps
  with acct.timing('checkpoint'):
    clock.now += 4
  acct.steps = 50
  r = acct.record()
  assert r['goodput_restore_s'] == 2 and r['goodput_startup_s'] == 3
  assert r['goodput_compile_s'] == 10 and r['goodput_checkpoint_s'] == 4
  assert r['goodput_wall_s'] == 39
  # The steps' 20 s less the 1.5 s of input waiting booked within them.
  assert r['goodput_productive_s'] == pytest.approx(18.5)
  assert r['goodput'] == pytest.approx(18.5 / 39)


def start_records(start, steps, productive, wall, logged, **causes):
  base = {
    'goodput_start': start,
    'goodput_steps': steps,
    'goodput_wall_s': wall,
    'goodput_productive_s': productive,
    **{f'goodput_{c}_s': v for c, v in causes.items()},
  }
  return [{'step': s, 'loss': 1.0, **base} for s in logged]


def test_lost_work_and_summary_over_restarts():
  # Start 1 logged steps 1..50, checkpointed at 40 and was killed: 100 s
  # of productive time for 50 steps, 2 s each.
  first = start_records(1.0, 50, 100.0, 130.0, range(10, 51, 10), compile=30)
  assert goodput.lost_work(first, 40) == (10, 20.0)
  assert goodput.lost_work([], 40) == (0, 0.0)
  second = start_records(
    2.0, 60, 150.0, 180.0, [50, 100], compile=20, restore=10
  )
  for r in second:
    r.update(goodput_lost_steps=10, goodput_lost_s=20.0)
  s = goodput.summarize([{'step': 1, 'eval_loss': 2.0}, *first, *second])
  assert s['starts'] == 2 and s['wall_s'] == 310
  assert s['seconds']['productive'] == 250 - 20
  assert s['seconds']['lost'] == 20 and s['lost_steps'] == 10
  assert s['seconds']['compile'] == 50 and s['seconds']['restore'] == 10
  assert s['goodput'] == pytest.approx(230 / 310)
  text = goodput.format_summary(s)
  assert 'Goodput: 74.2% of 5.2 min over 2 start(s), 110 steps.' in text
  assert (
    'compile 16.1%' in text and 'lost 6.5% (10 steps trained twice)' in text
  )
  assert goodput.summarize([{'step': 1, 'loss': 2.0}]) is None


def test_input_watch_judges_windows_of_steps_and_says_it_once():
  said = []
  watch = goodput.InputWatch(0.25, said.append, min_steps=4)
  for step in range(1, 4):  # 3 steps, one of them slow: no verdict yet
    watch.add(step, 0.9 if step == 2 else 0.0, 1.0)
  assert watch.share() == pytest.approx(0.3) and not said
  watch.add(4, 0.0, 1.0)  # steps 1-4: 0.9 of 4 s waiting, under 0.25
  assert not said
  for step in range(5, 13):  # steps 5-8, then 9-12, half the time waiting
    watch.add(step, 0.5, 1.0)
  assert len(said) == 1
  assert 'steps 5-8 waited for their batches 50%' in said[0]
  assert 'pretrain_lm.data.prepare' in said[0]
  assert watch.share() == pytest.approx(4 / 9)  # steps 4-12 since the last
  assert watch.share() is None
  off = goodput.InputWatch(0.0, said.append, min_steps=1)
  off.add(1, 1.0, 1.0)
  assert len(said) == 1


@pytest.mark.parametrize(
  ('field', 'value', 'message'),
  [
    ('profile_steps', '0:2', 'START >= 1'),
    ('profile_steps', '5', 'START:COUNT'),
    ('profile_hosts', 'some', r"'some' is not one of \('chief', 'all'\)"),
    ('input_bound_share', 1.5, 'train.input_bound_share=1.5 must be in'),
  ],
)
def test_profile_and_input_fields_are_checked(field, value, message):
  c = load_config('bert', 'size=tiny')
  c.train[field] = value
  with pytest.raises(ValueError, match=message):
    validate.check_config(c)


def tiny_config(tokenizer_path, **train_fields):
  c = load_config('bert', 'size=tiny')
  c.model.vocab_size = 640
  c.model.max_len = 128
  c.data.tokenizer = tokenizer_path
  c.data.seq_len = 64
  c.data.batch_size = 8
  c.data.shuffle_buffer = 64
  c.data.eval_batches = 1
  c.optimizer.warmup_steps = 1
  c.train.log_every = 1
  c.train.eval_every = 1000
  c.train.progress_bar = False
  c.checkpoint.async_save = False
  c.mesh.data = 1
  for k, v in train_fields.items():
    c.train[k] = v
  return c


def wrap_input(trainer, wrap):
  """Routes the trainer's batches through wrap(iterator)."""
  stage_data = trainer._stage_data

  def stage(step):
    it, end, shapes = stage_data(step)
    return wrap(it), end, shapes

  trainer._stage_data = stage


def one_device_trainer(c, workdir):
  return train.Trainer(
    c, workdir, sharding.make_mesh(c.mesh, jax.devices()[:1])
  )


def test_resumed_run_reports_lost_steps_and_restore_time(
  tmp_path, tokenizer_path
):
  c = tiny_config(tokenizer_path, num_steps=8)
  c.checkpoint.every = 3
  workdir = str(tmp_path / 'run')

  def crash_after_five(it):  # a worker lost after step 5 was logged
    yield from itertools.islice(it, 5)
    raise RuntimeError('host lost')

  trainer = one_device_trainer(c, workdir)
  wrap_input(trainer, crash_after_five)
  with pytest.raises(RuntimeError, match='host lost'):
    trainer.run()
  trainer.checkpointer.close()

  one_device_trainer(c, workdir).run()  # resumes at the checkpoint of 3
  records = read_metrics(workdir)
  second = [r for r in records if r.get('goodput_lost_steps')]
  assert second and {r['goodput_lost_steps'] for r in second} == {2}
  assert all(r['goodput_restore_s'] > 0 for r in second)
  summary = goodput.summarize(records)
  assert summary['starts'] == 2 and summary['lost_steps'] == 2
  assert summary['steps'] == 5 + 5  # steps 1-5, then 4-8
  assert summary['seconds']['lost'] > 0 and summary['seconds']['restore'] > 0
  assert 0 < summary['goodput'] < 1
  shares = sum(summary['share'].values())
  assert shares == pytest.approx(1.0)
  text = describe.format_text(describe.describe(workdir))
  assert 'over 2 start(s), 10 steps' in text
  assert '(2 steps trained twice)' in text and 'restore ' in text


def test_slow_input_is_reported_and_fast_input_is_not(
  tmp_path, tokenizer_path, capsys
):
  c = tiny_config(tokenizer_path, num_steps=25, log_every=5)
  slow = one_device_trainer(c, str(tmp_path / 'slow'))

  def sleepy(it):
    for batch in it:
      time.sleep(0.2)
      yield batch

  wrap_input(slow, sleepy)
  slow.run()
  out = capsys.readouterr().out
  assert out.count('Input-bound: steps') == 1, out
  shares = [
    r['input_wait_share']
    for r in read_metrics(str(tmp_path / 'slow'))
    if 'input_wait_share' in r
  ]
  assert shares and min(shares) > 0.5

  fast = one_device_trainer(c, str(tmp_path / 'fast'))
  # Every batch already in memory.
  wrap_input(fast, lambda it: iter(list(itertools.islice(it, 25))))
  fast.run()
  assert 'Input-bound' not in capsys.readouterr().out
  shares = [
    r['input_wait_share']
    for r in read_metrics(str(tmp_path / 'fast'))
    if 'input_wait_share' in r
  ]
  assert shares and max(shares) < 0.2


def test_profile_steps_trace_those_steps_into_tensorboard(
  tmp_path, tokenizer_path
):
  """TensorBoard's profile plugin lists every <run>/<host>.xplane.pb under
  <logdir>/plugins/profile; the trace holds exactly the chosen steps."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2

  c = tiny_config(tokenizer_path, num_steps=5, profile_steps='2:2')
  workdir = str(tmp_path / 'run')
  one_device_trainer(c, workdir).run()
  logdir = os.path.join(workdir, 'tensorboard', 'plugins', 'profile')
  traces = glob.glob(os.path.join(logdir, '*', '*.xplane.pb'))
  assert len(traces) == 1, traces
  space = xplane_pb2.XSpace()
  with open(traces[0], 'rb') as f:
    space.ParseFromString(f.read())
  dispatches = []  # (start, end) of each call of the step, nested or not
  for plane in space.planes:
    names = {k: v.name for k, v in plane.event_metadata.items()}
    for line in plane.lines:
      dispatches += [
        (e.offset_ps, e.offset_ps + e.duration_ps)
        for e in line.events
        if names.get(e.metadata_id) == 'PjitFunction(train_step)'
      ]
  outermost = [
    (a, b)
    for a, b in dispatches
    if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in dispatches)
  ]
  assert len(outermost) == 2
  records = read_metrics(workdir)
  assert max(r.get('goodput_profile_s', 0) for r in records) > 0


def test_fine_tuning_profiles_and_accounts_its_time(tiny_workdir, tmp_path):
  from pretrain_lm.finetune import trainer as ft_trainer

  c = load_config('finetune/glue', 'task=sst2')
  c.init.workdir = tiny_workdir('bert')
  c.task.seq_len = 32
  c.task.max_train_examples = 32
  c.task.max_eval_examples = 16
  c.data.batch_size = 8
  c.train.num_steps = 6
  c.train.log_every = 3
  c.train.progress_bar = False
  c.train.profile_steps = '3:2'
  c.checkpoint.async_save = False
  workdir = str(tmp_path / 'ft')
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  ft_trainer.Trainer(c, workdir, mesh).run()
  traces = glob.glob(
    os.path.join(workdir, 'tensorboard', 'plugins', 'profile', '*', '*.pb')
  )
  assert len(traces) == 1, traces
  summary = goodput.summarize(read_metrics(workdir))
  assert summary['steps'] == 6 and summary['starts'] == 1
  for cause in ('compile', 'eval', 'checkpoint', 'profile'):
    assert summary['seconds'][cause] > 0, cause
