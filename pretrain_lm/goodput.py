"""Where a run's wall time goes: goodput, badput by cause, input waiting.

Each start of a run splits its wall time, from the Trainer's creation, into

  productive  - train steps that count, with their logging;
  compile     - the first step of each row shape (tracing and compiling);
  input       - waiting for the next batch (tf.data or prepared reads, and
                the copy onto the devices);
  checkpoint  - saving, the blocking part (an async save writes on in the
                background) and the wait for the last one;
  restore     - restoring the latest checkpoint;
  eval        - evaluation;
  profile     - writing a trace (train.profile_steps);
  startup     - the rest of the time before the first step (tokenizer,
                model, pipeline, jax.distributed).

and, across restarts, lost: steps a start trained past its last checkpoint
and the next start trains again. Their time (the steps times the previous
start's productive time per step) moves from productive to lost.

Each logged step writes this start's totals as `goodput_*` fields of
metrics.jsonl (and TensorBoard); `summarize` adds every start up, and
`python -m pretrain_lm.describe WORKDIR` prints it. A start that died
counts up to its last logged step, which is also as far as its lost steps
can be known.

`InputWatch` says once, in plain words, when steps wait for their batches
more than train.input_bound_share of their time.
"""

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

CAUSES = (
  'compile',
  'input',
  'checkpoint',
  'restore',
  'eval',
  'profile',
  'startup',
)
PREFIX = 'goodput_'


class Accountant:
  """This start's wall time by cause; productive is what is left."""

  def __init__(self, clock: Callable[[], float] = time.monotonic):
    self._clock = clock
    self._t0 = clock()
    self.start_time = time.time()  # names the start in metrics.jsonl
    self.seconds = dict.fromkeys(CAUSES, 0.0)
    self.steps = 0  # trained by this start
    self.lost_steps = 0
    self.lost_seconds = 0.0

  @contextlib.contextmanager
  def timing(self, cause: str):
    """Books the time inside the block to `cause`."""
    t = self._clock()
    try:
      yield
    finally:
      self.seconds[cause] += self._clock() - t

  def resumed(self, workdir: str, step: int) -> None:
    """Counts what the previous start trained past `step` as lost."""
    self.lost_steps, self.lost_seconds = lost_work(read_records(workdir), step)

  def add(self, cause: str, seconds: float) -> None:
    self.seconds[cause] += seconds

  def end_startup(self) -> None:
    """Books the time since creation, less what was booked, as startup."""
    elapsed = self._clock() - self._t0
    self.seconds['startup'] = max(0.0, elapsed - sum(self.seconds.values()))

  def record(self) -> dict[str, float]:
    """This start's totals so far, as metrics.jsonl fields."""
    wall = self._clock() - self._t0
    productive = max(0.0, wall - sum(self.seconds.values()))
    out = {
      f'{PREFIX}start': self.start_time,
      f'{PREFIX}steps': float(self.steps),
      f'{PREFIX}wall_s': wall,
      f'{PREFIX}productive_s': productive,
      **{f'{PREFIX}{k}_s': v for k, v in self.seconds.items()},
      f'{PREFIX}lost_steps': float(self.lost_steps),
      f'{PREFIX}lost_s': self.lost_seconds,
    }
    out['goodput'] = productive / wall if wall > 0 else 0.0
    return out


def read_records(workdir: str) -> list[dict[str, Any]]:
  """metrics.jsonl's records (a line cut short by a kill is skipped)."""
  import tensorflow as tf  # noqa: PLC0415 - the summary alone needs no TF

  path = os.path.join(workdir, 'metrics.jsonl')
  if not tf.io.gfile.exists(path):
    return []
  records = []
  with tf.io.gfile.GFile(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except ValueError:
        continue
  return records


def last_per_start(records: Iterable[dict]) -> list[dict]:
  """The last goodput record of each start, in start order."""
  last = {}
  for r in records:
    if f'{PREFIX}start' in r:
      last[r[f'{PREFIX}start']] = r
  return [last[k] for k in sorted(last)]


def lost_work(records: list[dict], resumed_at: int) -> tuple[int, float]:
  """(steps, seconds) the previous start trained past `resumed_at`.

  The steps are those it logged beyond the checkpoint the new start
  resumes from; each costs the previous start's productive time per step.
  """
  starts = last_per_start(records)
  if not starts:
    return 0, 0.0
  previous = starts[-1]
  logged = [
    int(r['step'])
    for r in records
    if r.get(f'{PREFIX}start') == previous[f'{PREFIX}start'] and 'step' in r
  ]
  lost = max(0, max(logged, default=resumed_at) - resumed_at)
  steps = previous[f'{PREFIX}steps']
  per_step = previous[f'{PREFIX}productive_s'] / steps if steps else 0.0
  return lost, lost * per_step


def summarize(records: list[dict]) -> dict[str, Any] | None:
  """Every start's time added up: goodput and badput by cause.

  Returns None when no record has goodput fields. Shares are of the total
  wall time; productive excludes the lost work.
  """
  starts = last_per_start(records)
  if not starts:
    return None

  def total(key: str) -> float:
    return sum(r.get(f'{PREFIX}{key}', 0.0) for r in starts)

  wall = total('wall_s')
  lost = total('lost_s')
  seconds = {'productive': total('productive_s') - lost, 'lost': lost}
  seconds.update({c: total(f'{c}_s') for c in CAUSES})
  share = {k: (v / wall if wall else 0.0) for k, v in seconds.items()}
  return {
    'starts': len(starts),
    'wall_s': wall,
    'goodput': share['productive'],
    'seconds': seconds,
    'share': share,
    'steps': int(total('steps')),
    'lost_steps': int(total('lost_steps')),
  }


def _duration(seconds: float) -> str:
  if seconds < 120:
    return f'{seconds:.0f} s'
  if seconds < 7200:
    return f'{seconds / 60:.1f} min'
  return f'{seconds / 3600:.1f} h'


def format_summary(s: dict[str, Any]) -> str:
  """summarize()'s dict as two lines of text (causes under 0.05% left out)."""
  badput = ', '.join(
    f'{cause} {s["share"][cause]:.1%}'
    for cause in (*CAUSES, 'lost')
    if s['share'][cause] >= 0.0005
  )
  lost = f' ({s["lost_steps"]} steps trained twice)' if s['lost_steps'] else ''
  return (
    f'Goodput: {s["goodput"]:.1%} of {_duration(s["wall_s"])} over '
    f'{s["starts"]} start(s), {s["steps"]} steps.\n'
    f'Badput: {badput or "none"}{lost}.'
  )


class InputWatch:
  """The share of step time spent waiting for batches.

  `add` takes each step's wait and its whole time (batch, dispatch and the
  wait for the previous step's results; evaluation and saves are not step
  time). `share` gives it over the steps since its last call (the log
  window). The verdict is over windows of at least `min_steps` steps, so
  one slow batch is not a bottleneck: over the limit, it says once, in
  plain words, what to do.
  """

  def __init__(self, limit: float, say, min_steps: int = 20):
    self.limit = limit
    self._say = say
    self._min_steps = min_steps
    self._log = [0.0, 0.0]  # wait, elapsed since the last share()
    self._judge = [0.0, 0.0, 0, 0]  # wait, elapsed, steps, first step
    self.warned = False

  def add(self, step: int, wait: float, elapsed: float) -> None:
    self._log[0] += wait
    self._log[1] += elapsed
    judge = self._judge
    if not judge[2]:
      judge[3] = step
    judge[0] += wait
    judge[1] += elapsed
    judge[2] += 1
    if judge[2] >= self._min_steps:
      self._check(judge[0] / judge[1] if judge[1] > 0 else 0.0, judge[3], step)
      self._judge = [0.0, 0.0, 0, 0]

  def share(self) -> float | None:
    """The share waiting for input since the last call; None if no step."""
    wait, elapsed = self._log
    self._log = [0.0, 0.0]
    return wait / elapsed if elapsed > 0 else None

  def _check(self, share: float, first: int, last: int) -> None:
    if self.warned or not self.limit or share <= self.limit:
      return
    self.warned = True
    self._say(
      f'Input-bound: steps {first}-{last} waited for their batches '
      f'{share:.0%} of the time (train.input_bound_share={self.limit:g}); '
      'the accelerators idle meanwhile. Prepare the corpus once (python -m '
      'pretrain_lm.data.prepare, then data.source=prepared:DIR), which '
      'reads packed rows by index, or give tf.data more host CPU; '
      'data.cache_tokens=True keeps a raw-text corpus tokenized after the '
      'first epoch.'
    )


class Monitor:
  """A training loop's view of one start: its Accountant, InputWatch and
  StepProfiler, called around each step:

    with monitor.input():                    # booked as input waiting
      batch = ...
    monitor.before_step(n, shape)            # n counts from 1
    outputs = train_step(state, batch)
    monitor.dispatched(outputs)              # a new shape: compile time
    ...read the previous step's metrics...
    monitor.end_step(n, outputs)             # step time, the profile

  `record()` is the goodput fields to log; `close()` ends a trace the run
  stopped inside.
  """

  def __init__(self, accountant: Accountant, train_config, logdir: str, say):
    from pretrain_lm import profiling  # noqa: PLC0415 - imports jax

    self.accountant = accountant
    self.watch = InputWatch(train_config.input_bound_share, say)
    self.profiler = profiling.StepProfiler(
      train_config.profile_steps, train_config.profile_hosts, logdir
    )
    self._compiled = set()  # the batch shapes the step was compiled for
    self._began = self._waited = self._dispatched = 0.0
    self._compiling = False

  @contextlib.contextmanager
  def input(self):
    self._began = time.monotonic()
    try:
      yield
    finally:
      self._waited = time.monotonic() - self._began
      self.accountant.add('input', self._waited)

  def before_step(self, step: int, shape: Any) -> None:
    self.profiler.before(step)
    self._compiling = shape not in self._compiled
    self._compiled.add(shape)
    self._dispatched = time.monotonic()

  def dispatched(self, outputs: Any) -> None:
    """The step is dispatched; a first step of its shape compiled, and its
    time until the outputs are ready is booked as compile."""
    if self._compiling:
      import jax  # noqa: PLC0415

      jax.block_until_ready(outputs)
      self.accountant.add('compile', time.monotonic() - self._dispatched)
    self.accountant.steps += 1

  def end_step(self, step: int, outputs: Any) -> None:
    if not self._compiling:
      self.watch.add(step, self._waited, time.monotonic() - self._began)
    with self.accountant.timing('profile'):
      self.profiler.after(step, outputs)

  def input_share(self) -> dict[str, float]:
    """The log window's input_wait_share, if it had steps."""
    share = self.watch.share()
    return {} if share is None else {'input_wait_share': share}

  def record(self) -> dict[str, float]:
    return self.accountant.record()

  def close(self) -> None:
    self.profiler.close()
