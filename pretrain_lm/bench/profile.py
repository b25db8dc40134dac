"""Where a compiled step's time goes: a profiler trace summed per op; jax only.

  summary = profile.profile_steps(step, state, batch, steps=2, directory=D)
  print(profile.format_summary(summary))

Runs a few steps under `jax.profiler.trace`, reads the Perfetto trace it
writes (`*.trace.json.gz`) and sums the duration of each op on each
timeline. On a GPU or TPU the timelines are the device's (its streams and
the per-HLO-op line the profiler derives from them); on the CPU, the
threads that run XLA's thunks, summed over threads (so busy time can
exceed the wall time). On a device, a stream's busy time against the
steps' wall time says how much of a step it sat idle (host overhead,
launch gaps). run_exported imports this on machines without our
input stack: jax and the standard library only.

On the CPU, product_rates joins the trace with the optimized HLO: each
matrix-product form's time, FLOPs and FLOP rate inside the step, the
question behind most of experiments/benchmarks/README.md's levers.

  text, products = profile.report(summary, compiled)  # both tables
"""

import collections
import glob
import gzip
import json
import math
import os
import re
import time
from typing import Any

import jax

# Profiler bookkeeping on the CPU's thunk threads, not ops.
_CPU_NOT_OPS = (
  'ThunkExecutor',
  'ThreadpoolListener',
  'SlinkyThreadPool',
  'end: ',
  '$',
)


def profile_steps(
  step: Any, state: Any, batch: Any, *, steps: int, directory: str
) -> tuple[Any, dict]:
  """Runs `steps` steps (each waited for) under the profiler.

  Returns the new state and `summarize`'s summary, with `wall_s` the
  steps' total wall time.
  """
  os.makedirs(directory, exist_ok=True)
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = step(state, batch)
      jax.block_until_ready((state, metrics))
    wall_s = time.perf_counter() - start
  paths = glob.glob(
    os.path.join(directory, '**', '*.trace.json.gz'), recursive=True
  )
  if not paths:
    raise FileNotFoundError(f'the profiler wrote no trace under {directory}')
  summary = summarize(max(paths, key=os.path.getmtime))
  return state, {**summary, 'wall_s': wall_s, 'steps': steps}


def _timeline(process: str, thread: str) -> str | None:
  """The timeline an event belongs to, or None if it holds no ops."""
  if process.startswith('/device:'):
    # One timeline per kind of line: 'Stream #13(Compute)' -> 'Stream'.
    return re.sub(r'\s*#?\d.*$', '', thread) or thread
  if process.startswith('/host:') and thread.startswith('tf_XLA'):
    return 'CPU thunks'
  return None


def op_events(trace_path: str):
  """(timeline, op name, milliseconds) of each op event in a trace."""
  with gzip.open(trace_path, 'rt') as f:
    events = json.load(f)['traceEvents']
  processes, threads = {}, {}
  for e in events:
    if e.get('ph') == 'M' and e.get('name') == 'process_name':
      processes[e['pid']] = e['args']['name']
    elif e.get('ph') == 'M' and e.get('name') == 'thread_name':
      threads[e['pid'], e['tid']] = e['args']['name']
  for e in events:
    if e.get('ph') != 'X' or 'dur' not in e:
      continue
    line = _timeline(
      processes.get(e['pid'], ''), threads.get((e['pid'], e['tid']), '')
    )
    if line is None or (
      line == 'CPU thunks' and e['name'].startswith(_CPU_NOT_OPS)
    ):
      continue
    yield line, e['name'], e['dur'] / 1e3


def summarize(trace_path: str) -> dict:
  """{'timelines': {name: {'busy_ms', 'events', 'ops': {op: ms},
  'merged': {op: how many numbered ops it sums}}}, 'trace': trace_path},
  ops in decreasing time.

  An op's name drops a trailing `.N` (XLA's numbering of clones), so the
  forty `fusion.N`s of one kind add up; names are the profiler's (kernel
  names on GPU streams, HLO op names on its 'XLA Ops' line).
  """
  ops = collections.defaultdict(collections.Counter)
  names = collections.defaultdict(set)  # the numbered names of each op
  counts = collections.Counter()
  for line, name, ms in op_events(trace_path):
    op = re.sub(r'\.\d+$', '', name)
    ops[line][op] += ms
    names[line, op].add(name)
    counts[line] += 1
  return {
    'trace': trace_path,
    'timelines': {
      line: {
        'busy_ms': sum(c.values()),
        'events': counts[line],
        'ops': dict(c.most_common()),
        'merged': {
          op: len(names[line, op]) for op in c if len(names[line, op]) > 1
        },
      }
      for line, c in ops.items()
    },
  }


def hlo_sources(hlo_text: str) -> dict[str, str]:
  """{kernel name: 'shape op_name'} for the fusions and custom calls of an
  optimized HLO module (`compiled.as_text()`).

  XLA:GPU names a fusion's kernel after its instruction with '.' and '-'
  made '_' (`loop_add_fusion.3` runs as `loop_add_fusion_3`); the
  instruction's metadata names the jax operation it came from.
  """
  sources = {}
  instruction = re.compile(
    r'^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) (?:fusion|custom-call)\('
  )
  for line in hlo_text.splitlines():
    m = instruction.match(line)
    if m:
      op_name = re.search(r'op_name="([^"]*)"', line)
      kernel = re.sub(r'[.\-]', '_', m.group(1))
      # The step's own name scopes, without the export's wrappers.
      where = (
        re.sub(r'^.*jit\(train_step\)/', '', op_name.group(1))
        if op_name
        else ''
      )
      sources[kernel] = f'{m.group(2)} {where}'
  return sources


def format_summary(
  summary: dict, *, top: int = 25, sources: dict[str, str] | None = None
) -> str:
  """A readable table per timeline: busy time against the wall time, then
  the `top` ops with their share of that timeline (and, from `sources`,
  the shape and jax operation each came from)."""
  wall_ms = summary.get('wall_s', 0.0) * 1e3
  steps = summary.get('steps', 1)
  lines = [f'{steps} step(s), {wall_ms:.1f} ms wall']
  for name, t in summary['timelines'].items():
    busy = t['busy_ms']
    share = f', {busy / wall_ms:.0%} of the wall time' if wall_ms else ''
    lines.append(
      f'== {name}: {busy:.1f} ms busy in {t["events"]} events{share}'
    )
    for op, ms in list(t['ops'].items())[:top]:
      lines.append(f'{ms / steps:10.2f} ms/step {ms / busy:6.1%}  {op[:110]}')
      if sources and op in sources and op not in t['merged']:
        lines.append(f'{"":27}<- {sources[op][:200]}')
  return '\n'.join(lines)


# An HLO instruction: `%name = type op(operands), attributes`.
_INSTRUCTION = re.compile(
  r'^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\((.*?)\)(.*)$'
)


def _dims(shape: str) -> list[int]:
  """f32[2048,768]{1,0} -> [2048, 768]."""
  m = re.match(r'\w+\[([\d,]*)\]', shape)
  return [int(d) for d in m.group(1).split(',') if d] if m else []


def _bare(shape: str) -> str:
  """The type without its layout: f32[2048,768]{1,0} -> f32[2048,768]."""
  return re.sub(r'\{.*$', '', shape)


def products(hlo_text: str) -> dict[str, dict]:
  """{instruction: {'flops', 'form', 'fused'}} for every top-level dot and
  every fusion holding dots, of an optimized HLO module (CPU).

  `flops` is 2 x the result's elements x the contracted size, summed over
  the dots a fusion holds; `form` names the operands and the result, the
  contracted dims marked: `f32[2048,{768}] x f32[50257,{768}] ->
  f32[2048,50257]` is x . W^T. `fused` says whether the product runs as a
  fusion (XLA:CPU's YNNPACK or oneDNN fusions) or as a plain `dot` (Eigen).
  """
  shapes, current = {}, None
  dots = {}  # name -> (computation, shape, operands, attributes)
  calls = {}  # fusion name -> the computation it calls
  for line in hlo_text.splitlines():
    head = re.match(r'^(?:ENTRY )?%?([\w.\-]+) \(.*\{$', line)
    if head:
      current = head.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, shape, op, operands, attrs = m.groups()
    shapes[name] = shape
    if op == 'dot':
      dots[name] = (current, shape, operands, attrs)
    elif op == 'fusion':
      called = re.search(r'calls=%?([\w.\-]+)', attrs)
      if called:
        calls[name] = called.group(1)
  in_fusions = collections.defaultdict(list)
  for computation, *dot in dots.values():
    in_fusions[computation].append(dot)

  def dot_terms(shape, operands, attrs):
    if '%' in operands:  # `%a, %b`, or with types: `f32[2,3]{1,0} %a, ...`
      lhs, rhs = re.findall(r'%([\w.\-]+)', operands)
    else:
      lhs, rhs = (o.strip() for o in operands.split(','))
    contracting = [
      [
        int(d)
        for d in re.search(rf'{side}_contracting_dims={{([\d,]*)}}', attrs)
        .group(1)
        .split(',')
        if d
      ]
      for side in ('lhs', 'rhs')
    ]
    lhs_dims, rhs_dims = _dims(shapes[lhs]), _dims(shapes[rhs])
    k = math.prod(lhs_dims[d] for d in contracting[0])

    def marked(dims, contracted):
      return ','.join(
        f'{{{n}}}' if i in contracted else str(n) for i, n in enumerate(dims)
      )

    dtype = lambda s: re.match(r'\w+', s).group(0)  # noqa: E731
    form = (
      f'{dtype(shapes[lhs])}[{marked(lhs_dims, contracting[0])}] x '
      f'{dtype(shapes[rhs])}[{marked(rhs_dims, contracting[1])}] -> '
      f'{_bare(shape)}'
    )
    return 2 * math.prod(_dims(shape)) * k, form

  result = {}
  for name, called in calls.items():
    if in_fusions.get(called):
      terms = [dot_terms(*d) for d in in_fusions[called]]
      result[name] = {
        'flops': sum(f for f, _ in terms),
        'form': ' + '.join(form for _, form in terms),
        'fused': True,
      }
  fusion_bodies = set(calls.values())
  for name, (computation, *dot) in dots.items():
    if computation not in fusion_bodies:
      flops, form = dot_terms(*dot)
      result[name] = {'flops': flops, 'form': form, 'fused': False}
  return result


def product_rates(
  trace_path: str, hlo_text: str, *, steps: int = 1
) -> list[dict]:
  """Each product form's time, FLOPs and rate over the profiled steps, on
  the CPU's thunk timeline, in decreasing time: [{'form', 'count',
  'ms_per_step', 'gflop_per_step', 'tflops'}]. `count` is how many of
  the program's instructions have that form; FLOPs count every time one
  ran (a loop over microbatches runs its body once per microbatch).

  Only fused products are timed: XLA:CPU's plain `dot` thunks hand their
  product to Eigen and return before it is done (an event of a fraction
  of a millisecond for gigaFLOPs), so a row for them, form 'Eigen dots
  (not timed)', gives their FLOPs alone. A fused product's time is its
  event's, which stretches when another op runs beside it on the other
  threads: the rates are what the products got inside the step, not
  what they reach alone.
  """
  found = products(hlo_text)
  times, runs = collections.Counter(), collections.Counter()
  for line, name, ms in op_events(trace_path):
    if line == 'CPU thunks' and name in found:
      times[name] += ms
      runs[name] += 1  # a loop's body (microbatches) runs more than once
  rows = {}
  for name, p in found.items():
    form = p['form'] if p['fused'] else 'Eigen dots (not timed)'
    row = rows.setdefault(form, {'form': form, 'count': 0, 'ms': 0.0, 'f': 0})
    row['count'] += 1
    row['ms'] += times[name] if p['fused'] else 0.0
    row['f'] += p['flops'] * runs[name]
  out = []
  for row in sorted(rows.values(), key=lambda r: -r['ms']):
    ms, flops = row.pop('ms') / steps, row.pop('f') / steps
    out.append(
      {
        **row,
        'ms_per_step': ms,
        'gflop_per_step': flops / 1e9,
        'tflops': flops / ms / 1e9 if ms else None,
      }
    )
  return out


def report(summary: dict, compiled: Any) -> tuple[str, list[dict] | None]:
  """The tables for a profile of `compiled` (a jax Compiled step): per op
  with each op's source and, on the CPU, per product form. Returns the
  text and, on the CPU, `product_rates`' rows (None elsewhere)."""
  hlo = compiled.as_text()
  text = format_summary(summary, sources=hlo_sources(hlo))
  if 'CPU thunks' not in summary['timelines']:
    return text, None
  products = product_rates(summary['trace'], hlo, steps=summary['steps'])
  return text + '\n' + format_products(products), products


def format_products(rows: list[dict], *, top: int = 25) -> str:
  """`product_rates`' rows as a table, with the timed products' total."""
  timed = [r for r in rows if r['tflops']]
  ms = sum(r['ms_per_step'] for r in timed)
  gflop = sum(r['gflop_per_step'] for r in timed)
  lines = [
    f'== products: {ms:.1f} ms/step for {gflop:.1f} GFLOP in the fused '
    f'ones ({gflop / ms:.3f} TFLOP/s)'
    if ms
    else '== products'
  ]
  for r in rows[:top]:
    rate = f'{r["tflops"]:6.3f} TFLOP/s' if r['tflops'] else f'{"":13}'
    lines.append(
      f'{r["ms_per_step"]:10.1f} ms/step {r["gflop_per_step"]:9.2f} GFLOP '
      f'{rate} {r["count"]:4d}x  {r["form"][:110]}'
    )
  return '\n'.join(lines)
