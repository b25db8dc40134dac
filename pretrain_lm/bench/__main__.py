r"""Benchmarks a config's train step, input pipeline or decoding.

  python -m pretrain_lm.bench --config=configs/bert.py:size=base [--steps=N]
      [--what=train|pipeline|decode] [--batch_size=N]

Runs on whatever backend JAX finds, prints a table, then one JSON line.

- train: the config's train step (the one `pretrain_lm.main` runs), at the
  first stage of data.seq_len_schedule (BERT: 128), timed after --warmup
  steps: step_s is the median of --steps, compile_s separate. MFU is
  model_flops_per_token x tokens_per_s / peak, with model FLOPs counted as
  the model computes them (pretrain_lm.models.transformer.
  stack_flops_per_token: 6N plus attention, the MLM head at the masked
  positions only) and the peak the device kind's datasheet figure
  (metrics.PEAK_FLOPS) or --config.train.peak_flops_per_device. A CPU has
  no datasheet figure: give its peak (experiments/benchmarks/
  matmul_peak.py measures one) or read tokens/s alone.
- pipeline: tokens/s of the training input pipeline from raw text and from
  cached token ids (or from a prepared corpus), per core, the fraction of
  non-pad tokens, and first_batch_s: the time from building the stream at
  --start_step to its first batch (what a resume there costs).
- decode: a decoder's KV-cached generation against full recomputation.

On CPU the train step's global batch defaults to 8 rows (a preset's 256
would take minutes a step); --batch_size sets it on any backend.
"""

import json
import shutil
import sys
import tempfile

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from pretrain_lm import validate, xla_flags
from pretrain_lm.bench import machine

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Config file, e.g. configs/bert.py:size=base.'
)
_WHAT = flags.DEFINE_enum(
  'what', 'train', ['train', 'pipeline', 'decode'], 'What to time.'
)
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed train steps.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps after compiling.')
_PIPELINED = flags.DEFINE_integer(
  'pipelined_steps',
  None,
  'Train steps timed after the waited ones, dispatched back to back as '
  'the training loop runs them (default: --steps on an accelerator; 0 on '
  'the CPU, where the two timings agree).',
  lower_bound=0,
)
_BATCH = flags.DEFINE_integer(
  'batch_size', 0, 'Global batch (0: the config, capped at 8 on CPU).'
)
_PIPELINE_BATCHES = flags.DEFINE_integer(
  'pipeline_batches', 100, 'Batches timed per pipeline variant.'
)
_START_STEP = flags.DEFINE_integer(
  'start_step',
  0,
  'Pipeline: the step the stream starts at (a resume there); first_batch_s '
  'is the time from building it to its first batch.',
  lower_bound=0,
)
_PIPELINE_CACHED = flags.DEFINE_bool(
  'pipeline_cached',
  True,
  'Pipeline, raw text: also time the stream with data.cache_tokens (reads '
  'an epoch first).',
)
_DECODE_BATCHES = flags.DEFINE_list(
  'decode_batch_sizes', ['1', '32'], 'Batch sizes for --what=decode.'
)
_DECODE_LENGTH = flags.DEFINE_integer(
  'decode_length', 512, 'Tokens per decoded row, prompt included.'
)
_REPEATS = flags.DEFINE_integer(
  'repeats', 2, 'Timed runs per decode measurement (median).'
)
_WORKDIR = flags.DEFINE_string(
  'workdir', '', 'Where the tokenizer is trained (default: a temp dir).'
)
flags.mark_flags_as_required(['config'])

CPU_BATCH = 8


def run_train(config, workdir: str) -> dict:
  """Our step's time, throughput and MFU."""
  from pretrain_lm.bench import step, timing  # noqa: PLC0415

  ours = step.TrainBench(config, workdir)
  logging.info('Timing %d steps.', _STEPS.value)
  timing.time_in_turn([ours.run], steps=_STEPS.value, warmup=_WARMUP.value)
  result = ours.figures()
  pipelined = _PIPELINED.value
  if pipelined is None:
    pipelined = 0 if jax.default_backend() == 'cpu' else _STEPS.value
  if pipelined:
    # Each waited step above includes its dispatch; the training loop
    # dispatches a step while the last one runs, so that a GPU does not sit
    # idle between steps.
    step_s = timing.time_pipelined(ours.run, steps=pipelined)
    result['step_s_pipelined'] = step_s
    result['tokens_per_s_pipelined'] = result['tokens_per_step'] / step_s
    if 'mfu' in result:
      result['mfu_pipelined'] = result['mfu'] * result['step_s'] / step_s
  return result


def run_pipeline(config, workdir: str) -> dict:
  """Input pipeline throughput for the config's data and objective."""
  from pretrain_lm import train  # noqa: PLC0415
  from pretrain_lm.bench import inputs, step  # noqa: PLC0415

  trainer = train.Trainer(config, workdir)
  shapes = {k: v.shape for k, v in trainer.batch_shapes.items()}
  tokens = step.tokens_per_row(shapes) * config.data.batch_size
  flops = trainer.model.train_flops(trainer.model_config, shapes) / tokens
  return inputs.bench_pipeline(
    config,
    trainer.tokenizer,
    batches=_PIPELINE_BATCHES.value,
    model_flops_per_token=flops,
    start_step=_START_STEP.value,
    cached=_PIPELINE_CACHED.value,
  )


def run_decode(config, workdir: str) -> dict:
  """Cached against uncached decoding for each --decode_batch_sizes."""
  del workdir  # random weights: no tokenizer needed
  from pretrain_lm.bench import decode  # noqa: PLC0415

  return decode.bench_decode(
    config,
    batch_sizes=tuple(int(b) for b in _DECODE_BATCHES.value),
    length=_DECODE_LENGTH.value,
    repeats=_REPEATS.value,
  )


RUNS = {'train': run_train, 'pipeline': run_pipeline, 'decode': run_decode}


def print_table(result: dict) -> None:
  """One figure per line, grouped as they come; nested dicts indented."""

  def lines(d, indent=''):
    for k, v in d.items():
      if isinstance(v, dict):
        print(f'{indent}{k}:')
        lines(v, indent + '  ')
      else:
        print(f'{indent}{k:40s} {f"{v:.4g}" if isinstance(v, float) else v}')

  lines(result)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config = _CONFIG.value
  xla_flags.apply_gpu_defaults()  # before JAX starts a backend
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  if _BATCH.value:
    config.data.batch_size = _BATCH.value
  elif _WHAT.value == 'train' and jax.default_backend() == 'cpu':
    config.data.batch_size = min(config.data.batch_size, CPU_BATCH)
  try:
    if _WHAT.value == 'decode':  # imports no TensorFlow (gpu/ scripts)
      validate.check_fields(config)
      validate.check_devices(config)
    else:
      from pretrain_lm.bench import step  # noqa: PLC0415

      step.prepare(config)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix='pretrain_lm_bench_')
  try:
    result = RUNS[_WHAT.value](config, workdir)
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  finally:
    if not _WORKDIR.value:
      shutil.rmtree(workdir, ignore_errors=True)
  result = {
    'what': _WHAT.value,
    'args': ' '.join(sys.argv[1:]),
    **machine.describe(),
    **result,
  }
  print_table(result)
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
