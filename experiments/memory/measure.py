r"""Peak memory per device of the compiled train step, per remat policy.

Compiles (never runs) the train step of BERT-base/large, GPT-2 small/medium
and T5-base at their presets' batch and sequence length, for a mesh of 8
fake CPU devices (fsdp=8: batch, parameters and optimizer state split 8
ways), with scanned layers, and reads XLA's memory analysis of each
compiled program. Writes the table to experiments/memory/README.md.

  nice python experiments/memory/measure.py             # everything
  python experiments/memory/measure.py --models=bert_base --policies=none

Takes tens of minutes on a laptop CPU (every compile is a full XLA
compile). The numbers are XLA:CPU's buffer assignment; a TPU or GPU
compile fuses differently, so treat them as estimates of the relative
effect of each policy, and of the order of magnitude.
"""

import os
import sys

# Must be set before JAX is imported.
os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
)
os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pretrain_lm import configlib, sharding, train  # noqa: E402
from pretrain_lm.convert import hf  # noqa: E402
from pretrain_lm.data import tokenizer as tokenizer_lib  # noqa: E402
from pretrain_lm.models import transformer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
MODELS = {
  'bert_base': ('BERT-base', 'configs/bert.py:size=base'),
  'bert_large': ('BERT-large', 'configs/bert.py:size=large'),
  'gpt2_small': ('GPT-2 small', 'configs/gpt.py:size=small'),
  'gpt2_medium': ('GPT-2 medium', 'configs/gpt.py:size=medium'),
  't5_base': ('T5-base', 'configs/t5.py:size=base'),
}
POLICIES = ('none', *transformer.REMAT_POLICIES)
MESH = {'data': 1, 'fsdp': 8, 'tensor': 1}


def abstract_batch(config, tokenizer) -> dict:
  """The preset's global batch as ShapeDtypeStructs (no data is read)."""
  spec = hf.batch_spec(config, tokenizer)
  return {
    k: jax.ShapeDtypeStruct((config.data.batch_size, *shape), np.dtype(dtype))
    for k, (shape, dtype) in spec.items()
  }


def measure(spec: str, remat: str, tokenizer, dtype: str, seq_len: int):
  """Compiles one step and returns its memory analysis, in bytes."""
  c = configlib.load_file(os.path.join(REPO, spec))
  if seq_len:  # e.g. BERT's first stage; data.seq_len is its longest
    c.data.seq_len, c.data.seq_len_schedule = seq_len, ''
  c.model.scan_layers = True  # one layer body to compile, not 12-24
  c.model.remat = remat
  c.model.dtype = dtype
  mesh = sharding.make_mesh(MESH)
  start = time.time()
  compiled = train.lower_train_step(
    c, mesh, abstract_batch(c, tokenizer)
  ).compile()
  m = compiled.memory_analysis()
  # Donated state buffers are both argument and output: count them once.
  peak = (
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
    + m.temp_size_in_bytes
  )
  return {
    'batch': f'{c.data.batch_size} x {c.data.seq_len}',
    'argument': m.argument_size_in_bytes,
    'temp': m.temp_size_in_bytes,
    'peak': peak,
    'seconds': time.time() - start,
  }


def gib(n: int) -> str:
  return f'{n / 2**30:.2f}'


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--models', default=','.join(MODELS))
  parser.add_argument('--policies', default=','.join(POLICIES))
  parser.add_argument('--dtype', default='float32', help='model.dtype')
  parser.add_argument(
    '--seq_len', type=int, default=0, help='data.seq_len (0: the preset)'
  )
  parser.add_argument(
    '--out', default=os.path.join(os.path.dirname(__file__), 'README.md')
  )
  args = parser.parse_args(argv)
  models = args.models.split(',')
  policies = args.policies.split(',')
  with tempfile.TemporaryDirectory() as tmp:
    # Feature shapes do not depend on the tokenizer: any small one will do.
    tokenizer = tokenizer_lib.train_tokenizer(
      ['The quick brown fox jumps over the lazy dog.\n'],
      os.path.join(tmp, 'chars.json'),
      vocab_size=64,
      model_type='char',
    )
    results = {}
    for name in models:
      for remat in policies:
        r = measure(MODELS[name][1], remat, tokenizer, args.dtype, args.seq_len)
        results[name, remat] = r
        # Kept as it goes: a long run that dies still leaves its numbers.
        with open(args.out + '.partial.json', 'a') as f:
          f.write(json.dumps({'model': name, 'remat': remat, **r}) + '\n')
        print(
          f'{name:12s} remat={remat:14s} peak {gib(r["peak"])} GiB '
          f'(state {gib(r["argument"])}, temp {gib(r["temp"])}) '
          f'compiled in {r["seconds"]:.0f} s',
          flush=True,
        )
  write_table(args, models, policies, results)
  os.remove(args.out + '.partial.json')


def write_table(args, models, policies, results) -> None:
  header = '| model | batch x length | ' + ' | '.join(policies) + ' |'
  rows = [header, '|' + '---|' * (len(policies) + 2)]
  for name in models:
    cells = [gib(results[name, p]['peak']) for p in policies]
    batch = results[name, policies[0]]['batch']
    rows.append(f'| {MODELS[name][0]} | {batch} | ' + ' | '.join(cells) + ' |')
  state = ['| model | params + optimizer state per device (GiB) |', '|---|---|']
  for name in models:
    state.append(
      f'| {MODELS[name][0]} | {gib(results[name, policies[0]]["argument"])} |'
    )
  command = ' '.join(['python experiments/memory/measure.py', *sys.argv[1:]])
  text = f"""# Peak memory per device of the train step, per remat policy

Peak = arguments + outputs - donated (aliased) buffers + temporaries, in GiB,
from `jax.jit(train_step).lower(...).compile().memory_analysis()` on
XLA:CPU (`train.lower_train_step`: abstract inputs, nothing allocated or
run). Mesh: 8 fake CPU devices as `fsdp=8` (batch, parameters and
optimizer state split 8 ways), so "per device" is one of 8 chips. Each
preset with its own optimizer (AdamW; T5: Adafactor, whose factored
moments make its state the smallest) at its global batch and sequence
length (below; BERT's is the 512 of its last 10% of steps, the longest
stage of `data.seq_len_schedule`), `model.scan_layers=True`,
`model.dtype={args.dtype}`, float32 parameters and optimizer state, one
microbatch (`train.grad_accum_steps=1`). Columns are `model.remat`:

- `none`: keep every activation for the backward pass;
- `full`: keep only each layer's input, recompute the layer;
- `dots`: keep matmul outputs, recompute element-wise ops;
- `dots_no_batch`: keep matmuls without dot-general batch dimensions (the
  weight projections), recompute attention scores and element-wise ops.

{chr(10).join(rows)}

{chr(10).join(state)}

XLA:CPU's buffer assignment, not a TPU's or GPU's: fusion differs by
backend, so read the table for each policy's relative saving and the order
of magnitude. Activations dominate at these batches: lower them with
`train.grad_accum_steps` (memory scales with the microbatch), a larger
mesh, `model.dtype=bfloat16`, or remat.

Command (from the repository root, {datetime.date.today().isoformat()}):

    {command}

Machine: a {os.cpu_count()}-core {platform.machine()} CPU
({platform.system()} {platform.release()}); jax {jax.__version__}.
"""
  with open(args.out, 'w') as f:
    f.write(text)
  print(f'Wrote {args.out}')


if __name__ == '__main__':
  main(sys.argv[1:])
