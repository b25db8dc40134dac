"""Metric output (TensorBoard, metrics.jsonl, console, Weights & Biases) and
MFU accounting.

Only process 0 writes; other processes get a writer that drops everything.
Weights & Biases receives the same scalars when train.wandb_project is set
(`WANDB_MODE=offline`, then `wandb sync`, where the hosts have no
internet). A restarted run logs to the same W&B run: its id is kept in the
workdir.
"""

import json
import math
import os
import sys
import uuid
from typing import Any

import jax
import tqdm

# Peak dense bf16 FLOP/s of one device (vendor datasheets), matched against
# jax's device_kind. Unknown kinds (CPUs) give no MFU unless
# train.peak_flops_per_device is set.
PEAK_FLOPS = (
  ('TPU v6', 918e12),
  ('TPU v5p', 459e12),
  ('TPU v5', 197e12),  # v5e reports 'TPU v5 lite'
  ('TPU v4', 275e12),
  ('TPU v3', 123e12),
  ('H200', 989e12),
  ('H100', 989e12),
  ('A100', 312e12),
  ('L4', 121e12),
)


def peak_flops_per_device(override: float = 0.0) -> float | None:
  """The configured peak, else the table's entry for this device kind."""
  if override:
    return float(override)
  kind = jax.devices()[0].device_kind
  for name, flops in PEAK_FLOPS:
    if name.lower() in kind.lower():
      return flops
  return None


class MetricWriter:
  """Writes scalars to TensorBoard and workdir/metrics.jsonl; shows progress."""

  def __init__(
    self,
    workdir: str,
    *,
    total_steps: int,
    initial_step: int,
    enabled: bool,
    progress_bar: bool = True,
    wandb_project: str = '',
    wandb_entity: str = '',
    config: dict | None = None,
  ):
    self.enabled = enabled
    self._bar = None
    self._wandb = None
    if not enabled:
      return
    if wandb_project:
      self._wandb = _open_wandb(workdir, wandb_project, wandb_entity, config)
    # Imported here: the peaks and MFU helpers above serve code that runs
    # where only JAX is installed (the bench's decode and matmul timings).
    import tensorflow as tf  # noqa: PLC0415

    self._scalar = tf.summary.scalar
    self._tb = tf.summary.create_file_writer(
      os.path.join(workdir, 'tensorboard')
    )
    # Append: a resumed run continues the same file.
    self._jsonl = tf.io.gfile.GFile(os.path.join(workdir, 'metrics.jsonl'), 'a')
    # The bar only on a terminal: a batch job's log (Slurm, a TPU pod's
    # nohup file) would get a redraw every 0.1 s; it keeps the step lines.
    if progress_bar and sys.stderr.isatty():
      self._bar = tqdm.tqdm(
        total=total_steps,
        initial=initial_step,
        unit='step',
        dynamic_ncols=True,
        smoothing=0.1,
      )

  def write(
    self, step: int, scalars: dict[str, Any], console: bool = True
  ) -> None:
    """Records one logged step's scalars (NaN-free JSON: None for missing).

    With console=False they go only to metrics.jsonl and TensorBoard (the
    caller prints its own line).
    """
    if not self.enabled:
      return
    clean = {k: _to_float(v) for k, v in scalars.items()}
    with self._tb.as_default(step=step):
      for k, v in clean.items():
        if v is not None:
          self._scalar(k, v)
    self._tb.flush()
    self._jsonl.write(json.dumps({'step': step, **clean}) + '\n')
    self._jsonl.flush()
    if self._wandb is not None:
      logged = {k: v for k, v in clean.items() if v is not None}
      self._wandb.log(logged, step=step)
    if not console:
      return
    if self._bar is not None and clean.get('loss') is not None:
      self._bar.set_postfix_str(f'loss={_fmt(clean["loss"])}', refresh=False)
    # The console shows a NaN or inf loss as it is; only JSON needs null.
    line = ' '.join(
      f'{k}={_fmt(float(v))}'
      for k, v in scalars.items()
      if k in _CONSOLE and v is not None
    )
    self.print(f'step {step}: {line}')

  def advance(self, steps: int = 1) -> None:
    if self._bar is not None:
      self._bar.update(steps)

  def print(self, message: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(message)
    else:
      print(message, flush=True)

  def close(self) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.close()
    self._jsonl.close()
    self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()


WANDB_ID_FILE = 'wandb_run_id'


def _open_wandb(workdir: str, project: str, entity: str, config: dict | None):
  """The workdir's W&B run: created on the first start, resumed after."""
  try:
    import wandb  # noqa: PLC0415 - optional: only runs that log to W&B
  except ImportError as e:
    raise ImportError(
      f'train.wandb_project={project!r} needs the wandb package '
      "(pip install wandb), or set train.wandb_project=''."
    ) from e
  import tensorflow as tf  # noqa: PLC0415

  path = os.path.join(workdir, WANDB_ID_FILE)
  if tf.io.gfile.exists(path):
    with tf.io.gfile.GFile(path) as f:
      run_id = f.read().strip()
  else:
    run_id = uuid.uuid4().hex[:12]
    with tf.io.gfile.GFile(path, 'w') as f:
      f.write(run_id)
  # W&B's local files go to a local directory even for a gs:// workdir.
  local = workdir if '://' not in workdir else None
  return wandb.init(
    project=project,
    entity=entity or None,
    name=os.path.basename(workdir.rstrip('/')),
    id=run_id,
    resume='allow',
    config=config,
    dir=local,
  )


_CONSOLE = (
  'loss',
  'mlm_accuracy',
  'perplexity',
  'learning_rate',
  'grad_norm',
  'tokens_per_s',
  'mfu',
  'goodput',
  'eval_loss',
  'eval_mlm_accuracy',
  'eval_perplexity',
)


def _to_float(v: Any) -> float | None:
  if v is None:
    return None
  v = float(v)
  return v if math.isfinite(v) else None


def _fmt(v: float) -> str:
  return f'{v:.4g}' if not math.isfinite(v) or abs(v) < 1e5 else f'{v:.3e}'
