"""Where a compiled step's time goes: a profiler trace summed per op; jax only.

  state, summary = trace_summary.profile_steps(step, state, batch, steps=2,
                                               directory=D)
  print(trace_summary.report(summary, step))

Runs a few steps under `jax.profiler.trace`, reads the Perfetto trace it
writes (`*.trace.json.gz`) and sums the duration of each op on each
timeline. On a GPU or TPU the timelines are the device's (its streams and
the per-HLO-op line the profiler derives from them); on the CPU, the
threads that run XLA's thunks, summed over threads (so busy time can
exceed the wall time). On a device, a stream's busy time against the
steps' wall time says how much of a step it sat idle (host overhead,
launch gaps). `group_times` sorts the ops into the groups the GPU table
reports (GEMM, attention, element-wise and reduction fusions, copies,
collectives, other) and the idle time. run_exported.py imports this on
machines without our input stack: jax and the standard library only.
"""

import collections
import glob
import gzip
import json
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
  """Runs `steps` steps under the profiler, each dispatched while the last
  runs and waited for once at the end, as the training loop runs them (so
  the idle time is the device's, not a wait per step).

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


# Kernel (or HLO op) name -> group, the first pattern that matches, tried
# in this order on the lower-cased name. The names are cuBLAS's (nvjet_*,
# *gemm*, cublasLt's split-K reduction), cuDNN's (fused attention; its
# layer norm when XLA is asked for it), XLA's fusions (loop_*, input_*,
# fusion_N, wrapped_*) and copies (memcpy*, Memset), NCCL's collectives,
# and on the CPU the HLO ops of XLA's thunks.
GROUPS = ('gemm', 'attention', 'fusions', 'copies', 'collectives', 'other')
_PATTERNS = (
  (
    'collectives',
    r'nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]scatter|all[-_]to[-_]all'
    r'|collective[-_]permute',
  ),
  ('fusions', r'cudnn.*norm|norm.*cudnn'),
  ('attention', r'sdpa|fmha|flash|attention|cudnn'),
  ('gemm', r'gemm|nvjet|xmma|cutlass|cublas|splitkreduce|^ynn|^dot\b|^dot[._]'),
  ('copies', r'memcpy|memset|^copy\b|^copy[._]'),
  ('fusions', r'fusion|^loop_|^input_|^wrapped_|^triton|reduce|convert|rng'),
)
# XLA names a fusion after its ops ('input_concatenate_fusion_10'); one
# made of these alone only moves data, so it counts as a copy.
_MOVES = {
  'copy',
  'transpose',
  'concatenate',
  'slice',
  'dynamic',
  'update',
  'pad',
  'bitcast',
  'reshape',
  'broadcast',
}


def op_group(name: str) -> str:
  """The GROUPS entry a kernel or HLO op named `name` belongs to."""
  lower = name.lower()
  words = re.sub(r'^(loop|input|output|wrapped)_|_fusion.*$|_\d+$', '', lower)
  if lower != words and set(words.split('_')) <= _MOVES:
    return 'copies'
  for group, pattern in _PATTERNS:
    if re.search(pattern, lower):
      return group
  return 'other'


def device_timelines(summary: dict) -> list[str]:
  """The timelines whose ops are the device's kernels: the GPU's streams,
  else the CPU's thunk threads."""
  streams = [n for n in summary['timelines'] if n.startswith('Stream')]
  return streams or [n for n in summary['timelines'] if n == 'CPU thunks']


def group_times(summary: dict) -> dict:
  """Milliseconds per step in each of GROUPS, and idle, from a profile.

  `idle` is the steps' wall time that no kernel covered: the wall time
  less the busiest timeline's busy time (none below 0; on the CPU, whose
  threads run side by side, busy time can exceed the wall). `shares` are
  each group's and idle's part of the wall time, `top` the largest ops
  of each group (ms per step), so a table can name what fills a group.
  """
  steps = summary.get('steps', 1)
  wall_ms = summary['wall_s'] * 1e3 / steps
  ms = dict.fromkeys(GROUPS, 0.0)
  top = {g: {} for g in GROUPS}
  lines = device_timelines(summary)
  for line in lines:
    for op, total in summary['timelines'][line]['ops'].items():
      group = op_group(op)
      ms[group] += total / steps
      top[group][op] = top[group].get(op, 0.0) + total / steps
  busy = max(
    (summary['timelines'][n]['busy_ms'] / steps for n in lines), default=0.0
  )
  ms['idle'] = max(wall_ms - busy, 0.0)
  return {
    'wall_ms': wall_ms,
    'kernel_ms': sum(ms[g] for g in GROUPS),
    'ms': ms,
    'shares': {g: t / wall_ms for g, t in ms.items()} if wall_ms else {},
    'top': {
      g: dict(sorted(ops.items(), key=lambda kv: -kv[1])[:3])
      for g, ops in top.items()
      if ops
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


def report(summary: dict, compiled: Any) -> str:
  """The table for a profile of `compiled` (a jax Compiled step): per
  timeline, its ops with the shape and jax operation each came from."""
  return format_summary(summary, sources=hlo_sources(compiled.as_text()))
