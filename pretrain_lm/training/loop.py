"""The training loop: one for pretraining and fine-tuning.

A job (pretrain_lm.train.Trainer, pretrain_lm.finetune.trainer.Trainer)
builds its model, its jitted step and its data; `run(job)` trains it:
step t + 1 is dispatched before step t's metrics are read, metrics are
logged every train.log_every steps, the job evaluates every `eval_every`,
checkpoints are saved every `save_every`, and the run stops cleanly on a
signal, at train.exit_interval, or after train.max_consecutive_skips
non-finite steps in a row.
"""

import dataclasses
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf

from pretrain_lm import goodput, sharding
from pretrain_lm import metrics as metrics_lib
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.training.state import TrainState
from pretrain_lm.training.step import shapes_key

# Exit code of a run stopped by a signal or train.exit_interval after
# saving its checkpoint: "resume me" (EX_TEMPFAIL in sysexits.h);
# launchers rerun on it.
EXIT_RESUME = 75
# Exit code of a run stopped by train.max_consecutive_skips non-finite steps
# (EX_DATAERR): a failure to look at, not to rerun blindly.
EXIT_NONFINITE = 65


@dataclasses.dataclass(frozen=True)
class StepCost:
  """What one step trains on, for the logged speeds."""

  tokens: int  # tokens fed to the model (encoder's and decoder's)
  flops: float | None  # model FLOPs; None: no tflops or MFU logged
  examples: int | None = None  # rows; None: no examples_per_s logged


class Job(Protocol):
  """What the loop needs of a job: its parts and its own hooks."""

  config: ml_collections.ConfigDict  # its train.* fields are read
  workdir: str
  is_chief: bool
  mesh: jax.sharding.Mesh
  goodput: goodput.Accountant
  num_steps: int
  eval_every: int  # steps between evaluations
  save_every: int  # steps between checkpoints
  # checkpoint.keep_best of pretraining: every evaluated state is saved,
  # its metrics with it, for retention to rank.
  save_evaluated: bool
  # Saved to: the first every save_every steps; all waited for at the end.
  checkpointers: tuple[Any, ...]
  train_step: Callable  # jitted (state, global batch) -> (state, metrics)

  def context(self): ...
  def initial_state(self) -> TrainState: ...
  def on_start(self, writer: metrics_lib.MetricWriter, step: int) -> None: ...

  def data(
    self, step: int, writer: metrics_lib.MetricWriter
  ) -> tuple[Iterator[dict], int, dict]:
    """Host batches from `step`, the step they end at, their shapes."""

  def step_cost(self, shapes: dict[str, tuple]) -> StepCost: ...
  def log_metrics(self, step: int, logged: dict) -> dict: ...
  def evaluate(self, state: TrainState, step: int) -> dict[str, float]: ...

  def on_eval(
    self, writer, step: int, state: TrainState, scores: dict, last: bool
  ) -> None: ...

  def checkpoint_meta(self, state: TrainState) -> dict[str, Any]: ...


@dataclasses.dataclass
class Outcome:
  """How a run ended: its state and step, and why it stopped early."""

  state: TrainState
  step: int
  preempted: bool = False  # a signal: exit with EXIT_RESUME
  nonfinite: bool = False  # skipped steps: exit with EXIT_NONFINITE


def run(job: Job) -> Outcome:
  """Trains `job` from its initial state to job.num_steps or a stop."""
  # Long by design: the one training loop, kept whole to read top to bottom.
  cfg = job.config
  state = job.initial_state()
  start = int(state.step)
  writer = open_writer(job, start)
  job.on_start(writer, start)
  stop = StopSignal()
  skips = SkipGuard(cfg.train.max_consecutive_skips, writer)
  acct = job.goodput
  if start and job.is_chief:
    acct.resumed(job.workdir, start)
  logdir = os.path.join(job.workdir, 'tensorboard')
  monitor = goodput.Monitor(acct, cfg.train, logdir, writer.print)
  peak = metrics_lib.peak_flops_per_device(cfg.train.peak_flops_per_device)
  acct.end_startup()

  # The job's data is opened at `start` and again where it says its
  # batches end (pretraining's seq-len stages); a new shape retraces.
  out = Outcome(state, start)
  step, pending, window, data_end = start, None, [], start
  while step < job.num_steps:
    if step == data_end:
      with acct.timing('input'):
        batches, data_end, shapes = job.data(step, writer)
      perf = Throughput(job.step_cost(shapes), peak)
    with monitor.input():
      batch = sharding.host_to_global(next(batches), job.mesh)
    monitor.before_step(step + 1, shapes_key(batch))
    with job.context():
      state, step_metrics = job.train_step(state, batch)
    monitor.dispatched(step_metrics)
    step += 1
    # Read step t-1's metrics only after step t is dispatched, so the host
    # never leaves the device idle waiting for a transfer.
    if pending is not None:
      window.append(skips.observe(step - 1, jax.device_get(pending)))
    pending = step_metrics
    monitor.end_step(step, (state, step_metrics))
    writer.advance()

    last = step == job.num_steps
    log_now = step % cfg.train.log_every == 0 or last
    # One more skip would stop the run: read this step's verdict now, so
    # that no step after the last skip is dispatched before the stop.
    if log_now or skips.near_limit:
      window.append(skips.observe(step, jax.device_get(pending)))
      pending = None
    if log_now:
      logged = perf.summarize(window, step)
      logged.update(job.log_metrics(step, logged))
      writer.write(
        step, {**logged, **monitor.input_share(), **monitor.record()}
      )
      window = []
    evaluated = None  # this step's eval metrics, if it has them
    if step % job.eval_every == 0 or last:
      with acct.timing('eval'):
        evaluated = job.evaluate(state, step)
      job.on_eval(writer, step, state, evaluated, last)
    signalled = stop.requested()
    exit_interval = cfg.train.exit_interval
    exiting = (
      signalled
      or skips.exhausted
      or (exit_interval and step % exit_interval == 0)
    )
    best_due = job.save_evaluated and evaluated is not None
    if step % job.save_every == 0 or last or exiting or best_due:
      with acct.timing('checkpoint'):
        job.checkpointers[0].save(
          step, state, job.checkpoint_meta(state), metrics=evaluated
        )
    if skips.exhausted:
      # The steps since the last log, the skipped ones too.
      unlogged = perf.summarize(window, step) if window else None
      _stop_nonfinite(writer, step, skips, unlogged)
      out.nonfinite = True
      break
    if exiting and not last:
      out.preempted = signalled
      writer.print(
        f'Stopping at step {step} (checkpoint saved); run the same '
        'command again to continue.'
      )
      break

  monitor.close()
  with acct.timing('checkpoint'):
    for checkpointer in job.checkpointers:
      checkpointer.wait()
      checkpointer.close()
  stop.restore()
  writer.print(f'Checkpoint: {job.checkpointers[0].directory}/{step}')
  # This start's final account (the steps since the last log included).
  writer.write(step, acct.record(), console=False)
  writer.close()
  out.state, out.step = state, step
  return out


def exit_if_stopped(job) -> None:
  """Ends a program whose job's run stopped early with its exit code: 65
  after too many non-finite steps (a failure launchers must not rerun), 75
  after a signal (rerun to resume)."""
  if job.nonfinite_stop:
    sys.exit(EXIT_NONFINITE)
  if job.preempted:
    print(f'Exiting with code {EXIT_RESUME}: rerun to resume.')
    sys.exit(EXIT_RESUME)


def open_writer(job: Job, start: int) -> metrics_lib.MetricWriter:
  """The run's metric writer (chief only); says where a resume starts."""
  t = job.config.train
  writer = metrics_lib.MetricWriter(
    job.workdir,
    total_steps=job.num_steps,
    initial_step=start,
    enabled=job.is_chief,
    progress_bar=t.progress_bar,
    wandb_project=t.wandb_project,
    wandb_entity=t.wandb_entity,
    config=job.config.to_dict(),
  )
  if start:
    directory = job.checkpointers[0].directory
    writer.print(f'Resumed from {directory} at step {start}.')
  return writer


def _stop_nonfinite(writer, step: int, skips, unlogged) -> None:
  """Ends the run after too many skipped steps, saying what to do."""
  # Skipped steps never touch the weights, so the checkpoint just saved
  # holds the last good ones; at this step, so a rerun reads on past the
  # bad batches rather than replaying them.
  if unlogged:
    writer.write(step, unlogged)
  writer.print(
    f'Stopping at step {step}: the last {skips.consecutive} steps had '
    'a non-finite loss or gradient and were skipped. The checkpoint '
    f'at step {step} holds the weights of the last good step. Look '
    'at the learning rate and the data, or raise '
    'train.max_consecutive_skips (0: never stop).'
  )


class Throughput:
  """Turns a window of per-step metrics into logged averages and speeds."""

  def __init__(self, cost: StepCost, peak_flops_per_device: float | None):
    self.cost = cost
    self.peak_total = (
      peak_flops_per_device * jax.device_count()
      if peak_flops_per_device
      else None
    )
    self.last_time, self.last_step = time.perf_counter(), None

  def summarize(self, window: list[dict], step: int) -> dict[str, float]:
    now = time.perf_counter()
    # Each metric over the steps that report it (cross-view training's
    # unlabelled steps report their own).
    keys = dict.fromkeys(k for m in window for k in m)
    out = {k: float(np.mean([m[k] for m in window if k in m])) for k in keys}
    if 'skipped_total' in out:  # a running count, not a per-step value
      out['skipped_total'] = float(window[-1]['skipped_total'])
    # The first window includes compilation; speed is reported from the next.
    if self.last_step is not None:
      steps_per_s = (step - self.last_step) / (now - self.last_time)
      tokens_per_s = steps_per_s * self.cost.tokens
      out['tokens_per_s'] = tokens_per_s
      if self.cost.examples is not None:
        out['examples_per_s'] = steps_per_s * self.cost.examples
      if self.cost.flops is not None:
        flops_per_s = steps_per_s * self.cost.flops
        out['model_tflops_per_s'] = flops_per_s / 1e12
        if self.peak_total:
          out['mfu'] = flops_per_s / self.peak_total
    self.last_time, self.last_step = now, step
    return out


class SkipGuard:
  """Follows the steps skipped for a non-finite loss or gradient."""

  def __init__(self, limit: int, writer: metrics_lib.MetricWriter):
    self.limit = limit  # consecutive skips that stop the run; 0: never
    self.writer = writer
    self.consecutive = 0

  def observe(self, step: int, metrics: dict) -> dict:
    """Counts step `step`'s verdict (in step order); returns `metrics`."""
    if not metrics.get('skipped'):
      self.consecutive = 0
      return metrics
    self.consecutive += 1
    self.writer.print(
      f'Step {step}: non-finite loss or gradient; update skipped '
      f'({self.consecutive} in a row).'
    )
    return metrics

  @property
  def near_limit(self) -> bool:
    return self.limit > 0 and self.consecutive + 1 >= self.limit

  @property
  def exhausted(self) -> bool:
    return self.limit > 0 and self.consecutive >= self.limit


class StopSignal:
  """Turns SIGTERM (preemption, `kill`) and Ctrl-C into a clean save + exit."""

  def __init__(self):
    self._requested = False
    self._pending = None  # the all-host OR dispatched at the last step
    self._previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. in a notebook worker)
        pass

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame):
    del frame
    if self._requested:  # a second Ctrl-C stops at once
      raise KeyboardInterrupt
    self._requested = True
    print(
      f'\nSignal {signum} received: saving a checkpoint at the end of '
      'this step, then exiting.',
      flush=True,
    )

  def requested(self) -> bool:
    """Whether to stop after this step: the same answer on every host."""
    # All hosts must agree, or some would wait forever in the save.
    if jax.process_count() == 1:
      return self._requested
    # Dispatch this step's all-host OR and read the previous step's, so the
    # host never waits for the device here (a stop comes one step later).
    previous, self._pending = self._pending, self._any_host(self._requested)
    return previous is not None and bool(previous)

  @functools.cached_property
  def _any_host(self):
    """flag -> replicated OR over all processes, without blocking."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ('all',))
    flags = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('all'))
    any_ = jax.jit(jnp.any, out_shardings=sharding.replicated(mesh))

    def gather(flag: bool) -> jax.Array:
      local = [jax.device_put(np.array([flag]), d) for d in jax.local_devices()]
      return any_(
        jax.make_array_from_single_device_arrays((len(devices),), flags, local)
      )

    return gather


def use_compilation_cache(path: str) -> None:
  """Points jax's persistent compilation cache at `path` ('' : leave it).

  Every compile of more than a second (jax's default threshold) is stored
  there, keyed by the program, its shardings, the devices and the jax
  version, and later processes load it instead of compiling.
  """
  if not path:
    return
  if '://' not in path:
    path = os.path.abspath(os.path.expanduser(path))
  tf.io.gfile.makedirs(path)
  jax.config.update('jax_compilation_cache_dir', path)


def write_run_files(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Stores the resolved config and, per start, commit and versions."""
  tf.io.gfile.makedirs(workdir)
  workdir_lib.write_json(os.path.join(workdir, 'config.json'), config.to_dict())
  path = os.path.join(workdir, 'run_metadata.json')
  starts = (
    workdir_lib.read_json(path)['starts'] if tf.io.gfile.exists(path) else []
  )
  starts.append(workdir_lib.run_metadata(jax.devices(), jax.process_count()))
  workdir_lib.write_json(path, {'starts': starts})
