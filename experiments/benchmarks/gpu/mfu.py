r"""GPU step efficiency: the table's three rows, their levers, and where
each step's time goes.

  .venv/bin/python experiments/benchmarks/gpu/mfu.py export  # CPU host
  python3 experiments/benchmarks/gpu/mfu.py run              # GPU machine
  python3 experiments/benchmarks/gpu/mfu.py table OUT/gpu.jsonl

`export` (the package installed; about a minute per step on 2 cores)
lowers every step of the plan below for CUDA with gpu/export.py into
.gpu_export/<row>.<variant>/, each labelled with its row and levers.
`run` needs jax with its CUDA plugin and numpy, nothing else (the GPU
image has both; this checkout goes on PYTHONPATH); in one call of under 8
minutes on one H100 or H200 it

1. compiles every step side by side into JAX's persistent cache, one
   process each (XLA:GPU's compiles are mostly single-threaded);
2. times the rows' `before` and `after` steps with two profiled steps each
   (the state random, of the init's shapes: the kernels and their time do
   not depend on its values), then the A/B steps, one process per row and
   per XLA option, until --budget_s is spent (steps not started by then are
   listed as skipped);
3. writes $OUT/gpu.jsonl (a JSON line per step: step time waited for and
   pipelined, tokens/s, MFU against the datasheet peak, memory, and for
   the profiled ones the kernel time per group: GEMM, attention,
   element-wise and reduction fusions, copies, collectives, other, idle),
   $OUT/compile.jsonl, $OUT/machine.txt and $OUT/run.log, and prints
   `table`'s tables.

The plan: each row's `before` is the table's configuration (bf16, cuDNN
attention, attention dropout 0, hidden dropout 0.1); its `after` has every
candidate lever of the row on. Each lever is then taken out of `after`
alone (`without_<lever>`: does it still win the whole step?), the batch
grows (`batch_x2`, BERT's also `batch_x4`), and `after` runs under each
candidate XLA option (`xla_<option>`). `--rows` and `--variants` pick a
part of the plan; `--size`, `--batch`, `--attention` and `--platform`
shrink it for a CPU (tests/gpu_mfu_test.py runs the whole loop there).
"""

import argparse
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


@dataclasses.dataclass(frozen=True)
class Row:
  """A row of the GPU table: a config, its global batch and MFU target,
  the config levers that apply to it, and the larger batches tried with
  them (multiples of `batch` that the card's memory holds)."""

  config: str
  batch: int
  target: float
  levers: tuple[str, ...]
  larger: tuple[int, ...] = (2,)


ROWS = {
  'bert_base': Row(
    'configs/bert.py:size=base',
    256,
    0.50,
    ('rbg', 'fused_xent', 'vocab128'),
    larger=(2, 4),
  ),
  'gpt2_small': Row(
    'configs/gpt.py:size=small', 32, 0.45, ('rbg', 'fused_xent', 'vocab128')
  ),
  # 32,128 pieces: already a multiple of 128.
  't5_base': Row('configs/t5.py:size=base', 128, 0.40, ('rbg', 'fused_xent')),
}
# What every step shares: bf16 compute, and attention without dropout so
# that cuDNN's fused kernel runs it (`--attention`).
COMMON = {'model.dtype': 'bfloat16', 'model.attention_dropout_rate': 0.0}
# Config levers: each one config field (experiments/benchmarks/README.md,
# Train step: GPU, says what each does).
LEVERS = {
  'rbg': {'train.prng_impl': 'unsafe_rbg'},
  'fused_xent': {'objective.cross_entropy': 'fused'},
  'vocab128': {'model.vocab_multiple': 128},
}
# XLA's GPU options, each tried on `after` (pretrain_lm/xla_flags.py keeps
# the ones that win as GPU defaults).
XLA_LEVERS = {
  'cublaslt': '--xla_gpu_enable_cublaslt=true',
  'command_buffer': (
    '--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL'
  ),
  'cudnn_layer_norm': '--xla_gpu_enable_cudnn_layer_norm=true',
  'latency_hiding': '--xla_gpu_enable_latency_hiding_scheduler=true',
}


@dataclasses.dataclass(frozen=True)
class Step:
  """One step of the plan: `export` is the directory name it is lowered
  into (XLA options share `after`'s), `profiled` whether run traces it."""

  row: str
  variant: str
  levers: tuple[str, ...]
  batch: int
  xla: str = ''

  @property
  def export(self) -> str:
    variant = 'after' if self.xla else self.variant
    return f'{self.row}.{variant}'

  @property
  def profiled(self) -> bool:
    return self.variant in ('before', 'after')

  @property
  def role(self) -> str:
    return self.variant if self.profiled else 'ab'


def plan(rows=None, variants=None, batch: int = 0) -> list[Step]:
  """The steps in the order they are timed: every row's before and after,
  then each row's A/B steps, then the XLA options on every row's after.
  `rows`/`variants` keep those names only; `batch` replaces the rows'."""
  steps = []
  for name, row in ROWS.items():
    b = batch or row.batch
    steps += [Step(name, 'before', (), b), Step(name, 'after', row.levers, b)]
  for name, row in ROWS.items():
    b = batch or row.batch
    for lever in row.levers:
      rest = tuple(x for x in row.levers if x != lever)
      steps.append(Step(name, f'without_{lever}', rest, b))
    for k in row.larger:
      steps.append(Step(name, f'batch_x{k}', row.levers, k * b))
  for option in XLA_LEVERS:
    for name, row in ROWS.items():
      b = batch or row.batch
      steps.append(Step(name, f'xla_{option}', row.levers, b, option))
  return [
    s
    for s in steps
    if (not rows or s.row in rows) and (not variants or s.variant in variants)
  ]


def step_config(step: Step, *, size: str = '', attention: str = 'cudnn'):
  """The run config of `step`: its row's config file (at `size` if given),
  COMMON, the attention kernel, its batch and its levers' fields."""
  from pretrain_lm import configlib  # noqa: PLC0415 (export's side only)

  spec = ROWS[step.row].config
  if size:
    spec = spec.split(':')[0] + f':size={size}'
  config = configlib.load_file(os.path.join(ROOT, spec))
  fields = {
    **COMMON,
    'model.attention_impl': attention,
    'data.batch_size': step.batch,
  }
  for lever in step.levers:
    fields.update(LEVERS[lever])
  for name, value in fields.items():
    section, field = name.split('.')
    config[section][field] = value
  return config


def export(args) -> int:
  """Lowers each step of the plan (XLA options reuse after's) with
  gpu/export.py, in this process."""
  import shutil  # noqa: PLC0415
  import tempfile  # noqa: PLC0415

  sys.path.insert(0, HERE)
  import export as export_lib  # noqa: PLC0415 (gpu/export.py)

  from pretrain_lm import workdir  # noqa: PLC0415
  from pretrain_lm.bench import step as step_lib  # noqa: PLC0415

  head, plus, dirty = workdir.git_commit().partition('+')
  commit = head[:7] + plus + dirty  # '0123abc' or '0123abc+dirty'
  failed = 0
  done = set()
  for step in plan(args.rows, args.variants, args.batch):
    if step.export in done:
      continue
    done.add(step.export)
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix='pretrain_lm_export_')
    try:
      config = step_config(step, size=args.size, attention=args.attention)
      step_lib.prepare(config)
      manifest, init, program, batch = export_lib.export_train(
        config, workdir, platform=args.platform
      )
    except (ValueError, FileNotFoundError) as e:
      print(f'{step.export}: error: {e}', flush=True)
      failed += 1
      continue
    finally:
      shutil.rmtree(workdir, ignore_errors=True)
    manifest['meta'] = {
      'row': step.row,
      'variant': step.variant,
      'role': step.role,
      'levers': list(step.levers),
      'target': ROWS[step.row].target,
      'commit': commit,
    }
    export_lib.write(
      os.path.join(args.dir, step.export), manifest, init, program, batch
    )
    print(
      f'{step.export}: {time.perf_counter() - start:.0f} s, step '
      f'{len(program) / 2**20:.1f} MiB, batch {manifest["shapes"]}',
      flush=True,
    )
  return 1 if failed else 0


class Runner:
  """The GPU machine's half: compile side by side, then time in turn."""

  def __init__(self, args):
    self.args = args
    self.start = time.time()
    self.deadline = self.start + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    self.log_file = open(os.path.join(args.out, 'run.log'), 'a')  # noqa: SIM115
    self.env = dict(os.environ)
    self.env['PYTHONPATH'] = os.pathsep.join(
      p for p in (ROOT, self.env.get('PYTHONPATH', '')) if p
    )
    self.env['PYTHONUNBUFFERED'] = '1'
    self.env.setdefault('JAX_COMPILATION_CACHE_DIR', '/tmp/jax_cache')
    self.env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'

  def log(self, message: str) -> None:
    line = f'[{time.time() - self.start:6.1f} s] {message}'
    print(line, file=sys.stderr, flush=True)
    self.log_file.write(line + '\n')
    self.log_file.flush()

  def _env(self, xla: str) -> dict:
    env = dict(self.env)
    if xla:
      env['XLA_FLAGS'] = f'{env.get("XLA_FLAGS", "")} {XLA_LEVERS[xla]}'
    return env

  def _python(self, script_args, xla: str, timeout: float, compile=False):
    """Runs run_exported.py; returns (rc, its JSON lines, stderr's tail).
    A compiling process takes no GPU memory up front (by default each
    would take 75% of it)."""
    env = self._env(xla)
    if compile:
      env['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
    command = [
      sys.executable,
      os.path.join(HERE, 'run_exported.py'),
      *script_args,
      '--init=random',
    ]
    try:
      result = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=max(timeout, 1),
      )
    except subprocess.TimeoutExpired as e:
      out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout
      return 124, _json_lines(out or ''), 'timed out'
    return result.returncode, _json_lines(result.stdout), result.stderr[-1500:]

  def machine(self) -> None:
    """What the run is on: the GPU, the driver, jax and its devices."""
    lines = []
    try:
      smi = subprocess.run(
        [
          'nvidia-smi',
          '--query-gpu=name,memory.total,driver_version,clocks.max.sm',
          '--format=csv',
        ],
        capture_output=True,
        text=True,
        timeout=30,
      )
      lines.append(smi.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
      lines.append('nvidia-smi: not found')
    probe = subprocess.run(
      [
        sys.executable,
        '-c',
        'import jax, numpy; print("jax", jax.__version__, "numpy", '
        'numpy.__version__, jax.default_backend(), jax.devices())',
      ],
      env=self.env,
      capture_output=True,
      text=True,
      timeout=120,
    )
    lines.append((probe.stdout + probe.stderr[-500:]).strip())
    text = '\n'.join(lines)
    with open(os.path.join(self.args.out, 'machine.txt'), 'w') as f:
      f.write(text + '\n')
    self.log(text)
    if probe.returncode != 0:
      raise SystemExit(f'error: jax does not start here:\n{text}')
    if ' gpu ' not in probe.stdout and not self.args.allow_cpu:
      raise SystemExit(
        'error: jax sees no GPU here (--allow_cpu times the steps on the CPU).'
      )

  def compile_all(self, steps: list[Step]) -> None:
    """Every (export, XLA option) compiled side by side into the cache."""
    jobs = sorted({(s.export, s.xla) for s in steps})
    limit = self.start + self.args.compile_budget_s
    if time.time() >= limit:
      self.log('no time left to compile side by side')
      return
    self.log(f'compiling {len(jobs)} steps, {self.args.jobs} at a time')

    def one(job):
      export, xla = job
      directory = os.path.join(self.args.dir, export)
      rc, lines, err = self._python(
        [directory, '--compile_only'], xla, limit - time.time(), compile=True
      )
      for line in lines:
        line['xla_lever'] = xla
      return job, rc, lines, err

    path = os.path.join(self.args.out, 'compile.jsonl')
    with (
      open(path, 'a') as f,
      concurrent.futures.ThreadPoolExecutor(self.args.jobs) as pool,
    ):
      for (export, xla), rc, lines, err in pool.map(one, jobs):
        for line in lines:
          f.write(json.dumps(line) + '\n')
        took = [f'{x.get("compile_s", 0):.0f} s' for x in lines]
        note = '' if rc == 0 else f': {err.strip()[-300:]}'
        self.log(f'compiled {export} {xla}: rc {rc} {" ".join(took)}{note}')

  def time_all(self, steps: list[Step]) -> list[dict]:
    """The steps timed in groups of one process each, in plan order."""
    groups = {}
    for s in steps:
      key = (s.xla, s.row if not s.xla else '', s.profiled)
      groups.setdefault(key, []).append(s)
    results = []
    for (xla, _, profiled), group in sorted(
      groups.items(), key=lambda kv: steps.index(kv[1][0])
    ):
      if time.time() > self.deadline:
        results += [_skipped(s) for s in group]
        continue
      dirs = [os.path.join(self.args.dir, s.export) for s in group]
      script_args = [
        *dirs,
        f'--steps={self.args.steps if profiled else self.args.ab_steps}',
        f'--warmup={self.args.warmup}',
        f'--deadline={self.deadline}',
      ]
      if profiled:
        script_args.append(f'--profile_dir={self.args.profile_dir}')
      names = ' '.join(s.export for s in group)
      self.log(f'timing {names} {xla}')
      rc, lines, err = self._python(
        script_args, xla, self.deadline + 60 - time.time()
      )
      by_dir = {line.get('exported'): line for line in lines}
      for s, d in zip(group, dirs, strict=True):
        line = by_dir.get(d) or {'exported': d, 'error': f'rc {rc}: {err}'}
        line.update(row=s.row, variant=s.variant, role=s.role, xla_lever=xla)
        results.append(line)
        self.log(_brief(line))
    return results

  def run(self) -> int:
    steps = plan(self.args.rows, self.args.variants)
    missing = sorted(
      {s.export for s in steps}
      - set(os.listdir(self.args.dir) if os.path.isdir(self.args.dir) else ())
    )
    if missing:
      raise SystemExit(
        f'error: {self.args.dir} lacks {missing}: run `mfu.py export` on a '
        'CPU host and carry the directory here.'
      )
    self.machine()
    self.compile_all(steps)
    results = self.time_all(steps)
    with open(os.path.join(self.args.out, 'gpu.jsonl'), 'a') as f:
      for line in results:
        f.write(json.dumps(line) + '\n')
    print(tables(results))
    self.log(f'done in {time.time() - self.start:.0f} s')
    timed = [r for r in results if 'step_s' in r]
    return 0 if len(timed) == len(results) else 1


def _json_lines(text: str) -> list[dict]:
  lines = []
  for line in text.splitlines():
    if line.startswith('{'):
      try:
        lines.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return lines


def _skipped(step: Step) -> dict:
  return {
    'row': step.row,
    'variant': step.variant,
    'role': step.role,
    'xla_lever': step.xla,
    'skipped': 'deadline',
  }


def _brief(line: dict) -> str:
  name = f'{line["row"]}.{line["variant"]}'
  if 'step_s' not in line:
    return f'{name}: {line.get("skipped") or line.get("error", "?")}'[:400]
  return (
    f'{name}: {line["step_s"] * 1e3:.1f} ms, '
    f'{line.get("step_s_pipelined", 0) * 1e3:.1f} ms pipelined, '
    f'MFU {line.get("mfu_pipelined", line.get("mfu", 0)):.1%}'
  )


def _mfu(r: dict) -> float:
  return r.get('mfu_pipelined', r.get('mfu', 0.0))


def tables(results: list[dict]) -> str:
  """Markdown: each row before and after; the grouped profile of each;
  every A/B step against its row's after."""
  timed = [r for r in results if 'step_s' in r]
  get = {(r['row'], r['variant']): r for r in timed}
  out = [
    '| row | variant | batch | step ms (waited / pipelined) | tokens/s '
    '(pipelined) | MFU (waited / pipelined) | target | GiB | device | '
    'commit | date |',
    '|---|---|---:|---:|---:|---:|---:|---:|---|---|---|',
  ]
  for r in timed:
    if r['role'] == 'ab':
      continue
    piped = r.get('step_s_pipelined', r['step_s'])
    out.append(
      f'| {r["row"]} | {r["variant"]} | {r["batch_size"]} | '
      f'{r["step_s"] * 1e3:.1f} / {piped * 1e3:.1f} | '
      f'{r["tokens_per_step"] / piped:,.0f} | '
      f'{r.get("mfu", 0):.1%} / **{_mfu(r):.1%}** | '
      f'{r.get("target", 0):.0%} | {r.get("memory_gib", 0):.1f} | '
      f'{r.get("device_kind", "?")} | `{r.get("commit", "?")}` | '
      f'{r.get("date", "?")} |'
    )
  groups = ('gemm', 'attention', 'fusions', 'copies', 'collectives', 'other')
  out += [
    '',
    '| row | variant | wall ms/step | '
    + ' | '.join(groups)
    + ' | idle | largest fusion |',
    '|---|---|---:|' + '---:|' * (len(groups) + 1) + '---|',
  ]
  for r in timed:
    g = r.get('profile_groups')
    if not g:
      continue
    shares = ' | '.join(
      f'{g["ms"][k]:.1f} ({g["shares"][k]:.0%})' for k in (*groups, 'idle')
    )
    fusion = next(iter(g['top'].get('fusions', {}).items()), None)
    largest = f'{fusion[0][:40]} {fusion[1]:.1f} ms' if fusion else ''
    out.append(
      f'| {r["row"]} | {r["variant"]} | {g["wall_ms"]:.1f} | {shares} | '
      f'{largest} |'
    )
  out += [
    '',
    '| row | step | pipelined ms | against after | MFU |',
    '|---|---|---:|---:|---:|',
  ]
  for r in results:
    if r.get('role') != 'ab':
      continue
    if 'step_s' not in r:
      why = r.get('skipped') or str(r.get('error', '?'))[:60]
      out.append(f'| {r["row"]} | {r["variant"]} | {why} | | |')
      continue
    after = get.get((r['row'], 'after'))
    piped = r.get('step_s_pipelined', r['step_s'])
    change = ''
    if after:
      base = after.get('step_s_pipelined', after['step_s'])
      per_token = piped / r['tokens_per_step']
      change = f'{per_token / (base / after["tokens_per_step"]) - 1:+.1%}'
    out.append(
      f'| {r["row"]} | {r["variant"]} | {piped * 1e3:.1f} | {change} | '
      f'{_mfu(r):.1%} |'
    )
  return '\n'.join(out)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('command', choices=('export', 'run', 'table'))
  parser.add_argument('files', nargs='*', help='table: gpu.jsonl files.')
  parser.add_argument('--dir', default=os.path.join(ROOT, '.gpu_export'))
  parser.add_argument('--rows', type=_names(ROWS), default=None)
  parser.add_argument('--variants', type=lambda s: s.split(','), default=None)
  # export: what to lower for.
  parser.add_argument('--platform', default='cuda')
  parser.add_argument('--attention', default='cudnn')
  parser.add_argument('--size', default='', help="Replace the rows' sizes.")
  parser.add_argument('--batch', type=int, default=0, help='Replace batches.')
  # run: where the results go, and the time it may take.
  parser.add_argument('--out', default=os.environ.get('OUT', '/tmp/gpu_out'))
  parser.add_argument('--profile_dir', default='/tmp/profile')
  parser.add_argument('--budget_s', type=float, default=450.0)
  parser.add_argument('--compile_budget_s', type=float, default=200.0)
  parser.add_argument('--jobs', type=int, default=12)
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--ab_steps', type=int, default=10)
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--allow_cpu', action='store_true')
  args = parser.parse_args(argv)
  if args.command == 'export':
    return export(args)
  if args.command == 'run':
    return Runner(args).run()
  results = []
  for path in args.files:
    with open(path) as f:
      results += [json.loads(line) for line in f if line.strip()]
  print(tables(results))
  return 0


def _names(table):
  def parse(text: str) -> list[str]:
    names = text.split(',')
    unknown = [n for n in names if n not in table]
    if unknown:
      raise argparse.ArgumentTypeError(
        f'unknown {unknown}; expected some of {list(table)}'
      )
    return names

  return parse


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
