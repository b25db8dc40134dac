"""Times a train step exported by pretrain_lm.bench.export; jax + numpy only.

  python -m pretrain_lm.bench.run_exported DIR [DIR ...] [--steps=N]

Deserializes DIR's init and step, builds the state on the default device,
compiles the step with the state donated, and times it the way
`python -m pretrain_lm.bench` does (each step waited for; the median of
--steps after --warmup). Prints one JSON line per DIR with the bench's
figures; MFU is against this device kind's datasheet peak
(metrics.PEAK_FLOPS). Of pretrain_lm it imports only bench.timing and
metrics (whose TensorFlow import waits for a MetricWriter), so it runs
where only JAX is installed.
"""

import argparse
import json
import os
import platform
import sys
import time

import jax
import numpy as np

from pretrain_lm import metrics as metrics_lib
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


def run(directory: str, *, steps: int, warmup: int) -> dict:
  """Times DIR's step; returns the figures."""
  manifest, init, step, batch = load(directory)
  batch = jax.device_put(batch)
  log(f'{directory}: compiling and running the initialisation')
  start = time.perf_counter()
  init_compiled = jax.jit(init.call).lower(batch).compile()
  init_compile_s = time.perf_counter() - start
  start = time.perf_counter()
  leaves = jax.block_until_ready(init_compiled(batch))
  init_run_s = time.perf_counter() - start
  log(f'{directory}: compiling and timing the step')
  timed = timing.compile_run(
    jax.jit(step.call, donate_argnums=0), leaves, batch
  )
  timing.time_in_turn([timed], steps=steps, warmup=warmup)
  tokens, flops = manifest['tokens_per_step'], manifest['model_flops_per_step']
  figures = timing.run_figures(timed, tokens, flops)
  peak = metrics_lib.peak_flops_per_device()
  result = {
    'what': 'train',
    'exported': directory,
    'family': manifest['family'],
    'objective': manifest['objective'],
    'attention_impl': manifest['attention_impl'],
    'dtype': manifest['dtype'],
    'backend': jax.default_backend(),
    'device_kind': jax.devices()[0].device_kind,
    'jax': jax.__version__,
    'jax_exported_with': manifest['jax_exported_with'],
    'prng_impl': manifest.get('prng_impl', 'not recorded'),
    'host': platform.node(),
    'batch_size': manifest['batch_size'],
    'shapes': manifest['shapes'],
    'tokens_per_step': tokens,
    'init_compile_s': init_compile_s,
    'init_run_s': init_run_s,
    **figures,
    'pad_fraction': manifest['pad_fraction'],
  }
  if peak:
    result['peak_tflops'] = peak / 1e12
    result['peak_source'] = 'datasheet'
    result['mfu'] = flops / figures['step_s'] / peak
  return result


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('dirs', nargs='+', help='Directories export wrote.')
  parser.add_argument('--steps', type=int, default=10, help='Timed steps.')
  parser.add_argument('--warmup', type=int, default=2, help='Untimed steps.')
  args = parser.parse_args(argv)
  failed = 0
  for directory in args.dirs:
    try:
      result = run(directory, steps=args.steps, warmup=args.warmup)
    except Exception as e:  # noqa: BLE001 (report it, time the others)
      print(f'{directory}: {type(e).__name__}: {e}', file=sys.stderr)
      failed += 1
      continue
    print(json.dumps(result), flush=True)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
