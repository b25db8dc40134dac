"""Times a train step exported by export.py; jax + numpy only.

  PYTHONPATH=. python3 experiments/benchmarks/gpu/run_exported.py DIR \
      [DIR ...] [--steps=N] [--compile_only] [--profile_dir=D]
      [--init=random] [--deadline=UNIX_TIME]

Run from the repository root (PYTHONPATH=. makes pretrain_lm importable
where it is not installed). Deserializes DIR's init and step, builds the
state on the default device, compiles the step with the state donated,
and times it the way `python -m pretrain_lm.bench` does (each step waited
for; the median of --steps after --warmup). Prints one JSON line per DIR
with the bench's figures; MFU is against this device kind's datasheet
peak (metrics.PEAK_FLOPS). Of pretrain_lm it imports only
bench.timing, xla_flags and metrics (whose TensorFlow import waits for a
MetricWriter), so it runs where only JAX is installed. On a GPU it adds
xla_flags.GPU_DEFAULTS to XLA_FLAGS, as the training commands do.

--compile_only compiles DIR's init and step from their shapes alone (no
device memory, no run) and reports the compile times: with JAX's
persistent compilation cache on, several of them can compile side by side
in separate processes, and the timing run that follows loads the programs
from the cache. --profile_dir traces two more steps after the timed ones
and adds where their time went (trace_summary.py: per op, and grouped) to
the JSON line. --init=random fills the state with small random values of
its shapes instead of compiling and running the initialisation: a step's
kernels and their time do not depend on the values, and an unrolled
model's initialisation compiles longer than its step. --deadline skips the
DIRs not started by then (a JSON line says so), so a run planned for a
fixed time on a lent machine ends inside it. The plan's labels in the
manifest ('meta': row, variant, levers) are copied into each line.
"""

import argparse
import json
import os
import platform
import sys
import time

import jax
import numpy as np
import trace_summary  # this directory's, beside the script

from pretrain_lm import metrics as metrics_lib
from pretrain_lm import xla_flags
from pretrain_lm.bench import timing


def load(directory: str):
  """(manifest, init Exported, step Exported, host batch) from DIR."""
  with open(os.path.join(directory, 'manifest.json')) as f:
    manifest = json.load(f)
  exported = []
  for name in ('init.bin', 'step.bin'):
    with open(os.path.join(directory, name), 'rb') as f:
      exported.append(jax.export.deserialize(bytearray(f.read())))
  with np.load(os.path.join(directory, 'batch.npz')) as z:
    batch = {k: z[k] for k in z.files}
  return manifest, exported[0], exported[1], batch


def log(message: str) -> None:
  """Progress on stderr with the time, so stdout keeps only the JSON."""
  print(f'[{time.strftime("%H:%M:%S")}] {message}', file=sys.stderr, flush=True)


def random_state(init) -> list[jax.Array]:
  """The state's leaves, of init's output shapes and dtypes: floating ones
  |N(0, 0.02^2)| (the models' initialiser scale; positive, as the
  optimizers' second moments must be), the rest 0."""
  rng = np.random.default_rng(0)
  leaves = []
  for aval in init.out_avals:
    if jax.numpy.issubdtype(aval.dtype, jax.numpy.floating):
      x = np.abs(0.02 * rng.standard_normal(aval.shape)).astype(aval.dtype)
    else:
      x = np.zeros(aval.shape, aval.dtype)
    leaves.append(jax.device_put(x))
  return jax.tree.unflatten(init.out_tree, leaves)


def compile_only(directory: str, *, init_random: bool = False) -> dict:
  """Compiles DIR's step (and its init unless `init_random`) for their
  shapes; returns the times."""
  manifest, init, step, batch = load(directory)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
  start = time.perf_counter()
  if not init_random:
    jax.jit(init.call).lower(batch).compile()
  init_compile_s = time.perf_counter() - start
  # The init's outputs are committed to the device: so is the step's state.
  leaves = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
    jax.tree.unflatten(init.out_tree, init.out_avals),
  )
  start = time.perf_counter()
  compiled = jax.jit(step.call, donate_argnums=0).lower(leaves, batch).compile()
  return {
    'what': 'compile',
    **_setting(directory, manifest),
    'init_compile_s': init_compile_s,
    'compile_s': time.perf_counter() - start,
    'memory_gib': timing.peak_memory_gib(compiled),
  }


def _setting(directory: str, manifest: dict) -> dict:
  """What both commands' results record about the step and the machine."""
  return {
    'exported': directory,
    'backend': jax.default_backend(),
    'device_kind': jax.devices()[0].device_kind,
    'jax': jax.__version__,
    'xla_flags': os.environ.get('XLA_FLAGS', ''),
    'batch_size': manifest['batch_size'],
    **manifest.get('meta', {}),
  }


def run(
  directory: str,
  *,
  steps: int,
  warmup: int,
  profile_dir: str | None = None,
  init_random: bool = False,
) -> dict:
  """Times DIR's step; returns the figures (and the profile's summary if
  `profile_dir` is given)."""
  manifest, init, step, batch = load(directory)
  batch = jax.device_put(batch)
  start = time.perf_counter()
  if init_random:
    log(f"{directory}: a random state of the init's shapes")
    init_compile_s = 0.0
    leaves = jax.block_until_ready(random_state(init))
  else:
    log(f'{directory}: compiling and running the initialisation')
    init_compiled = jax.jit(init.call).lower(batch).compile()
    init_compile_s = time.perf_counter() - start
    start = time.perf_counter()
    leaves = jax.block_until_ready(init_compiled(batch))
  init_run_s = time.perf_counter() - start
  log(f'{directory}: compiling and timing the step')
  jitted = jax.jit(step.call, donate_argnums=0)
  timed = timing.compile_run(jitted, leaves, batch)
  timing.time_in_turn([timed], steps=steps, warmup=warmup)
  tokens, flops = manifest['tokens_per_step'], manifest['model_flops_per_step']
  peak = metrics_lib.peak_flops_per_device()
  figures = timing.run_figures(timed, tokens, flops, peak)
  # As the training loop runs: each step dispatched while the last runs.
  figures['step_s_pipelined'] = timing.time_pipelined(timed, steps=steps)
  result = {
    'what': 'train',
    **_setting(directory, manifest),
    'family': manifest['family'],
    'objective': manifest['objective'],
    'attention_impl': manifest['attention_impl'],
    'dtype': manifest['dtype'],
    'jax_exported_with': manifest['jax_exported_with'],
    'prng_impl': manifest.get('prng_impl', 'not recorded'),
    'host': platform.node(),
    'date': time.strftime('%Y-%m-%d'),
    'state': 'random' if init_random else 'init',
    'shapes': manifest['shapes'],
    'tokens_per_step': tokens,
    'init_compile_s': init_compile_s,
    'init_run_s': init_run_s,
    **figures,
    'pad_fraction': manifest['pad_fraction'],
  }
  if peak:
    result['peak_source'] = 'datasheet'
    result['mfu_pipelined'] = flops / figures['step_s_pipelined'] / peak
  if profile_dir:
    name = os.path.basename(os.path.normpath(directory))
    log(f'{directory}: profiling two steps')
    try:
      timed.state, summary = trace_summary.profile_steps(
        timed.step,
        timed.state,
        batch,
        steps=2,
        directory=os.path.join(profile_dir, name),
      )
    except Exception as e:  # noqa: BLE001 (the timing stands without it)
      result['profile_error'] = f'{type(e).__name__}: {e}'
      log(f'{directory}: no profile: {result["profile_error"]}')
    else:
      result['profile'] = summary
      result['profile_groups'] = trace_summary.group_times(summary)
      table = trace_summary.report(summary, timed.step)
      print(f'== {name}\n{table}', file=sys.stderr)
  return result


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('dirs', nargs='+', help='Directories export wrote.')
  parser.add_argument('--steps', type=int, default=10, help='Timed steps.')
  parser.add_argument('--warmup', type=int, default=2, help='Untimed steps.')
  parser.add_argument(
    '--compile_only',
    action='store_true',
    help='Compile the init and step from their shapes; time nothing.',
  )
  parser.add_argument(
    '--profile_dir',
    default=None,
    help='Trace two steps after the timed ones here and summarise them.',
  )
  parser.add_argument(
    '--init',
    choices=('compiled', 'random'),
    default='compiled',
    help="The state: the exported init's, or random values of its shapes.",
  )
  parser.add_argument(
    '--deadline',
    type=float,
    default=0.0,
    help='Unix time after which no further DIR is started (0: none).',
  )
  args = parser.parse_args(argv)
  xla_flags.apply_gpu_defaults()  # before JAX starts a backend
  failed = 0
  init_random = args.init == 'random'
  for directory in args.dirs:
    if args.deadline and time.time() > args.deadline:
      print(json.dumps({'exported': directory, 'skipped': 'deadline'}))
      continue
    try:
      if args.compile_only:
        result = compile_only(directory, init_random=init_random)
      else:
        result = run(
          directory,
          steps=args.steps,
          warmup=args.warmup,
          profile_dir=args.profile_dir,
          init_random=init_random,
        )
    except Exception as e:  # noqa: BLE001 (report it, time the others)
      error = f'{type(e).__name__}: {e}'
      print(f'{directory}: {error}', file=sys.stderr)
      print(json.dumps({'exported': directory, 'error': error[:2000]}))
      failed += 1
      continue
    print(json.dumps(result), flush=True)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
