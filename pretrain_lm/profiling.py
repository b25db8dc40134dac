"""A jax.profiler trace of chosen train steps of the real run.

`train.profile_steps='START:COUNT'` traces steps START to START+COUNT-1
(steps count from 1, as in metrics.jsonl) into the workdir's TensorBoard
directory, where TensorBoard's profile plugin lists it
(`tensorboard/plugins/profile/<run>/<host>.xplane.pb`, local or gs://).
Pick START past the first step, which compiles. `train.profile_hosts`:
'chief' traces process 0, 'all' every process (one file per host).
A run resumed past START traces nothing.
"""

import jax

HOSTS = ('chief', 'all')


def parse_steps(text: str) -> tuple[int, int] | None:
  """'START:COUNT' -> (START, COUNT); '' -> None. Raises ValueError."""
  if not text:
    return None
  start, sep, count = text.partition(':')
  try:
    start, count = int(start), int(count)
  except ValueError:
    start = count = 0
  if not sep or start < 1 or count < 1:
    raise ValueError(
      f'train.profile_steps={text!r} must be START:COUNT with START >= 1 '
      "and COUNT >= 1, e.g. '100:3' (or '' for no profile)."
    )
  return start, count


class StepProfiler:
  """Starts and stops the trace around the chosen steps."""

  def __init__(self, steps: str, hosts: str, logdir: str):
    parsed = parse_steps(steps)
    if hosts not in HOSTS:
      raise ValueError(f'train.profile_hosts={hosts!r} is not one of {HOSTS}.')
    traced_here = hosts == 'all' or jax.process_index() == 0
    self.first, count = parsed if parsed and traced_here else (0, 0)
    self.last = self.first + count - 1
    self.logdir = logdir
    self.active = False

  def before(self, step: int) -> None:
    """Called before dispatching `step`."""
    if self.first and step == self.first:
      jax.profiler.start_trace(self.logdir)
      self.active = True

  def after(self, step: int, outputs) -> bool:
    """Called after dispatching `step`; True when it stopped the trace
    (the time that took is the caller's to book)."""
    if not (self.active and step == self.last):
      return False
    jax.block_until_ready(outputs)  # the traced steps run inside the trace
    jax.profiler.stop_trace()
    self.active = False
    return True

  def close(self) -> None:
    if self.active:  # the run stopped inside the traced steps
      jax.profiler.stop_trace()
      self.active = False
