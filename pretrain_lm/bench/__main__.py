r"""Benchmarks every family against the hardware limit and a peer.

  python -m pretrain_lm.bench --config=configs/bert.py:size=base [--steps=N]
      [--what=train|pipeline|decode] [--batch_size=N] [--peer=auto|none]

Runs on whatever backend JAX finds, prints a table, then one JSON line.

- train: the config's train step (the one `pretrain_lm.main` runs), at the
  first stage of data.seq_len_schedule (BERT: 128), timed after --warmup
  steps: step_s is the median of --steps, compile_s separate. MFU is
  model_flops_per_token x tokens_per_s / peak_tflops, with model FLOPs
  counted as the model computes them (see pretrain_lm.models.transformer.
  stack_flops_per_token: 6N plus attention, the MLM head at the masked
  positions only). The peak is the datasheet's on GPU/TPU and, on CPU, the
  best float32/bf16 matmul XLA reaches in this process (bench/peak.py);
  there an n x n matmul is also timed after each round of steps, and
  mfu_in_turn is the median of each round's step FLOP/s over that
  matmul's, a ratio a drifting machine moves little. For BERT-like
  masked LMs the peer, Hugging Face's Flax BERT, is timed on the same
  batch (bench/peer.py), one step of each alternately, so that a machine
  whose speed drifts slows both alike.
- pipeline: tokens/s of the training input pipeline from raw text and from
  cached token ids (or from a prepared corpus), per core, the fraction of
  non-pad tokens, and first_batch_s: the time from building the stream at
  --start_step to its first batch (what a resume there costs).
- decode: a decoder's KV-cached generation against full recomputation.

With --profile_dir=D the train run traces two more steps of ours under
jax.profiler into D and prints where their time went: each op's share of
the busy time and, on the CPU, each matrix-product form (operand shapes,
contracted dims in braces) with its time, GFLOP and FLOP rate inside the
step (bench/profile.py product_rates); the JSON line gets the rows.

On CPU the train step's global batch defaults to 8 rows (a preset's 256
would take minutes a step); --batch_size sets it on any backend.
"""

import datetime
import json
import os
import platform
import re
import shutil
import sys
import tempfile

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from pretrain_lm import validate, xla_flags

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
_PEER = flags.DEFINE_enum(
  'peer', 'auto', ['auto', 'none'], 'Time the peer too where there is one.'
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
_PEAK_SIZES = flags.DEFINE_list(
  'peak_sizes',
  [],
  'CPU: the n of the n x n matmuls timed for the peak (default: '
  'bench/peak.py SIZES, 1024-4096; smaller is quicker and lower).',
)
flags.register_validator(
  'peak_sizes',
  lambda sizes: all(n.isdigit() and int(n) > 0 for n in sizes),
  '--peak_sizes must be positive integers, e.g. --peak_sizes=512,1024',
)
_PROFILE_DIR = flags.DEFINE_string(
  'profile_dir',
  '',
  'Train: trace two more steps of ours here and print where their time '
  'went, per op and (CPU) per matrix-product form with its FLOP rate.',
)
_WORKDIR = flags.DEFINE_string(
  'workdir', '', 'Where the tokenizer is trained (default: a temp dir).'
)
flags.mark_flags_as_required(['config'])

CPU_BATCH = 8


def cpu_model() -> dict[str, str]:
  """The CPU's model name, family and widest vector extension (/proc/cpuinfo).

  CPU figures depend on them: XLA's float32 matmul runs several times
  faster with AVX-512 than with AVX2 alone. A model name such as "AMD
  EPYC" does not tell AMD's generations apart; the family does: 26 is Zen
  5 (512-bit units), 25 is Zen 3 (no AVX-512) or Zen 4 (AVX-512 on
  256-bit units). `amx_bf16` (Intel's bf16 matrix tiles) is named first
  where the CPU exposes it: bf16 products run on them, so a bf16 model
  there can outrun the float32 one (experiments/benchmarks/README.md,
  Train step: CPU).
  """
  try:
    with open('/proc/cpuinfo') as f:
      info = f.read()
  except OSError:  # not Linux
    return {}

  def field(key):
    found = re.search(rf'^{key}\s*:\s*(.*)$', info, re.MULTILINE)
    return found.group(1).strip() if found else ''

  flags = set(field('flags').split())
  widest = ('amx_bf16', 'avx512_bf16', 'avx512f', 'avx2', 'avx')
  return {
    'cpu_model': field('model name'),
    'cpu_family': f'{field("cpu family")}/{field("model")}'.strip('/'),
    'cpu_simd': next((x for x in widest if x in flags), 'none'),
  }


def describe_machine() -> dict[str, str | int]:
  """What the figures were measured on."""
  return {
    'backend': jax.default_backend(),
    'device_kind': jax.devices()[0].device_kind,
    'devices': jax.device_count(),
    'cpu': platform.processor() or platform.machine(),
    **cpu_model(),
    'cpu_cores': len(os.sched_getaffinity(0)),
    'jax': jax.__version__,
    'prng_impl': jax.config.jax_default_prng_impl,
    'date': datetime.date.today().isoformat(),
  }


def set_batch(config) -> None:
  """Applies --batch_size, or the CPU default, to the train step's batch."""
  if _BATCH.value:
    config.data.batch_size = _BATCH.value
  elif jax.default_backend() == 'cpu':
    config.data.batch_size = min(config.data.batch_size, CPU_BATCH)


def run_train(config, workdir: str) -> dict:
  """Our step, its MFU, and the peer's step on the same batch, alternately."""
  from pretrain_lm.bench import peak, peer, step, timing  # noqa: PLC0415

  sizes = tuple(int(n) for n in _PEAK_SIZES.value) or peak.SIZES
  ours = step.TrainBench(config, workdir)
  result = peak.peaks(config.model.dtype, sizes, ours.compiler_options)
  why_not = peer.unavailable(config) if _PEER.value == 'auto' else 'off'
  theirs = None if why_not else peer.PeerBench(config, ours.host_batch)
  runs = [ours.run] + ([theirs.run] if theirs else [])
  probe = None
  if result['peak_source'] == 'xla_matmul':
    probe = peak.InTurnMatmul(
      config.model.dtype, peak.in_turn_size(sizes), ours.compiler_options
    )
  logging.info('Timing %d steps of %d run(s) in turn.', _STEPS.value, len(runs))
  timing.time_in_turn(
    runs, steps=_STEPS.value, warmup=_WARMUP.value, each_round=probe
  )
  result.update(ours.figures())
  result['mfu'] = result['achieved_tflops'] / result['peak_tflops']
  if probe:
    step_flops = result['model_flops_per_token'] * result['tokens_per_step']
    result.update(peak.in_turn_figures(ours.run.times, probe.flops, step_flops))
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
    result['mfu_pipelined'] = (
      result['mfu'] * result['step_s'] / result['step_s_pipelined']
    )
  if 'best_matmul_tflops' in result:
    result['mfu_vs_best_matmul'] = (
      result['achieved_tflops'] / result['best_matmul_tflops']
    )
  if _PROFILE_DIR.value:
    result['profile'] = profile_run(ours.run, _PROFILE_DIR.value)
  if not theirs:
    result['peer'] = f'none ({why_not})'
    return result
  figures = theirs.figures()
  result['peer'] = peer.NAME
  result.update({f'peer_{k}': v for k, v in figures.items()})
  result['peer_mfu'] = figures['achieved_tflops'] / result['peak_tflops']
  result['speedup_vs_peer'] = result['tokens_per_s'] / figures['tokens_per_s']
  return result


def profile_run(run, directory: str) -> dict:
  """Two more steps of `run` under the profiler: prints where their time
  went (per op; on the CPU also per product form, with its FLOP rate) and
  returns the totals and the product rows."""
  from pretrain_lm.bench import profile  # noqa: PLC0415

  run.state, summary = profile.profile_steps(
    run.step, run.state, run.batch, steps=2, directory=directory
  )
  text, products = profile.report(summary, run.step)
  print(text)
  steps = summary['steps']
  figures = {
    'trace': summary['trace'],
    'step_s': summary['wall_s'] / steps,
    'busy_s': {
      line: t['busy_ms'] / steps / 1e3
      for line, t in summary['timelines'].items()
    },
  }
  if products is not None:
    figures['products'] = products
  return figures


def run_pipeline(config, workdir: str) -> dict:
  """Input pipeline throughput for the config's data and objective."""
  from pretrain_lm import train  # noqa: PLC0415
  from pretrain_lm.bench import inputs, step  # noqa: PLC0415

  trainer = train.Trainer(config, workdir)
  shapes = {k: v.shape for k, v in trainer.batch_shapes.items()}
  tokens = step.tokens_per_row(shapes) * config.data.batch_size
  flops = trainer.model.train_flops(trainer.model_config, shapes) / tokens
  result = inputs.bench_pipeline(
    config,
    trainer.tokenizer,
    batches=_PIPELINE_BATCHES.value,
    model_flops_per_token=flops,
    start_step=_START_STEP.value,
    cached=_PIPELINE_CACHED.value,
  )
  return result


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

  def fmt(v):
    if isinstance(v, float):
      return f'{v:.4g}'
    return str(v)

  def lines(d, indent=''):
    for k, v in d.items():
      if isinstance(v, dict):
        print(f'{indent}{k}:')
        lines(v, indent + '  ')
      elif isinstance(v, list) and v and isinstance(v[0], dict):
        print(f'{indent}{k:40s} {len(v)} rows (in the JSON line)')
      else:
        print(f'{indent}{k:40s} {fmt(v)}')

  lines(result)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config = _CONFIG.value
  xla_flags.apply_gpu_defaults()  # before JAX starts a backend
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  if _WHAT.value == 'train':
    set_batch(config)
  elif _BATCH.value:
    config.data.batch_size = _BATCH.value
  try:
    validate.check_fields(config)
    validate.check_devices(config)
    if _WHAT.value != 'decode':
      from pretrain_lm.bench import step  # noqa: PLC0415

      step.first_stage(config)
      validate.check_config(config)
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
    **describe_machine(),
    **result,
  }
  print_table(result)
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
