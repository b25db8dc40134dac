"""Where the test suite's own processes spend their JAX time, test by test.

As a pytest plugin it turns on `jax_log_compiles` and writes every trace,
lowering and backend-compile message, with the id of the test that was
running, to one log file per process under $COMPILE_LOG_DIR:

  COMPILE_LOG_DIR=/tmp/compile_log PYTHONPATH=experiments/benchmarks \\
      .venv/bin/python -m pytest -q -n 2 -p compile_log

As a script it sums those logs: compile, trace and lowering seconds by
function, by test file and by test, and the persistent-cache hits:

  python experiments/benchmarks/compile_log.py /tmp/compile_log

Child processes (the CLI tests' runs, notebook kernels) are not logged.
The figures are in README.md, Test-suite time.
"""

import collections
import glob
import logging
import os
import re
import sys

_JAX_LOGGERS = (
  'jax._src.dispatch',
  'jax._src.interpreters.pxla',
  'jax._src.compiler',
  'jax._src.pjit',
  'jax._src.compilation_cache',
)
_running = ['<collection>']


# --- The pytest plugin.


def pytest_configure(config):
  import jax  # noqa: PLC0415 (the aggregation below needs no JAX)

  directory = os.environ.get('COMPILE_LOG_DIR', '/tmp/compile_log')
  os.makedirs(directory, exist_ok=True)
  handler = logging.FileHandler(os.path.join(directory, f'{os.getpid()}.log'))
  handler.setFormatter(
    logging.Formatter('%(created).3f\t%(test_id)s\t%(message)s')
  )

  def tag(record):
    record.test_id = _running[0]
    return True

  handler.addFilter(tag)
  handler.setLevel(logging.DEBUG)
  jax.config.update('jax_log_compiles', True)
  for name in _JAX_LOGGERS:
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


def pytest_runtest_logstart(nodeid, location):
  _running[0] = nodeid


# --- The summary.

_COMPILE = re.compile(r'Finished XLA compilation of jit\((.*?)\) in (\S+) sec')
_TRACE = re.compile(r'Finished tracing (.*?) for jit in (\S+) sec')
_LOWER = re.compile(
  r'Finished jaxpr to MLIR module conversion jit\((.*?)\) in (\S+) sec'
)


def summarize(directory: str, top: int = 20) -> str:
  compile_s, compiles = collections.Counter(), collections.Counter()
  trace_s, lower_s = collections.Counter(), collections.Counter()
  by_file, by_test = collections.Counter(), collections.Counter()
  hits = 0
  for path in glob.glob(os.path.join(directory, '*.log')):
    with open(path, errors='replace') as f:
      for line in f:
        parts = line.rstrip('\n').split('\t', 2)
        if len(parts) < 3:
          continue
        test, message = parts[1], parts[2]
        if 'cache hit' in message.lower():
          hits += 1
        if m := _COMPILE.match(message):
          seconds = float(m.group(2))
          compile_s[m.group(1)] += seconds
          compiles[m.group(1)] += 1
          by_file[test.split('::')[0]] += seconds
          by_test[test] += seconds
        elif m := _TRACE.match(message):
          trace_s[m.group(1)] += float(m.group(2))
        elif m := _LOWER.match(message):
          lower_s[m.group(1)] += float(m.group(2))
  lines = [
    f'backend compiles {sum(compile_s.values()):.0f} s '
    f'({sum(compiles.values())}), tracing {sum(trace_s.values()):.0f} s, '
    f'lowering {sum(lower_s.values()):.0f} s, persistent-cache hits {hits}',
    '',
    'compile seconds, count, by function:',
  ]
  lines += [
    f'{s:8.1f} {compiles[k]:6d}  {k}' for k, s in compile_s.most_common(top)
  ]
  lines += ['', 'compile seconds by test file:']
  lines += [f'{s:8.1f}  {k}' for k, s in by_file.most_common(top)]
  lines += ['', 'compile seconds by test:']
  lines += [f'{s:8.1f}  {k}' for k, s in by_test.most_common(top)]
  lines += ['', 'tracing seconds by function:']
  lines += [f'{s:8.1f}  {k}' for k, s in trace_s.most_common(top)]
  return '\n'.join(lines)


if __name__ == '__main__':
  if len(sys.argv) != 2:
    sys.exit(f'usage: {sys.argv[0]} COMPILE_LOG_DIR')
  print(summarize(sys.argv[1]))
