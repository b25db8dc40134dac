"""Test setup: 8 fake CPU devices so sharding is exercised without hardware."""

import os

# Must happen before JAX is imported anywhere.
# The suite is mostly XLA compiles of tiny models: skipping LLVM's costly
# backend optimisations cuts the compile time by about a fifth and leaves
# what is tested (partitioning, numerics to float32 round-off) alone. (Level
# 1 runs steps faster but compiles slower: the whole suite was not faster,
# experiments/benchmarks/README.md, "Test-suite time".) Child processes
# that want JAX's one CPU device get these flags alone as their XLA_FLAGS.
COMPILE_FLAGS = (
  '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
)
os.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + (
  ' --xla_force_host_platform_device_count=8 ' + COMPILE_FLAGS
)
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ['JAX_PLATFORMS'] = 'cpu'

import atexit  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# One persistent compilation cache for the whole run. Its key is the
# computation, so a fresh Trainer (a fresh jit) for a program another test,
# worker or child process has compiled reads it back instead of compiling:
# resume_test trains configs_test's shapes for that (checked: its BERT
# preset's init and step are cache hits). JAX writes only compiles over 1 s.
# The xdist workers and child processes inherit the directory; the process
# that made it removes it. PRETRAIN_LM_TEST_CACHE=0 turns it off.
if os.environ.get('PRETRAIN_LM_TEST_CACHE', '1') != '0' and (
  'JAX_COMPILATION_CACHE_DIR' not in os.environ
):
  _cache = tempfile.mkdtemp(prefix='pretrain_lm_tests_xla_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Empties XLA:CPU's YNNPACK fusion list (what configs/bert.py sets at base):
# a compile option whose effect shows in the compiled HLO (and which jax's
# compilation cache keys on, unlike xla_dump_to, so the suite's shared
# cache cannot serve another compile).
NO_YNNPACK = 'xla_cpu_experimental_ynn_fusion_type='


def uses_ynnpack(compiled) -> bool:
  """Whether a compiled (CPU) program has a YNNPACK fusion."""
  return '"kind":"__ynn_fusion"' in compiled.as_text()


def read_metrics(workdir: str) -> list[dict]:
  """The records of a run's metrics.jsonl, in the order they were written."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def load_config(name: str, arg: str = ''):
  """`configs/<name>.py`'s get_config(arg), as main.py's --config loads it."""
  path = os.path.join(REPO, 'configs', f'{name}.py')
  spec = importlib.util.spec_from_file_location(f'{name}_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.fixture(scope='session')
def tokenizer_path(tmp_path_factory):
  """A 512-piece SentencePiece model of the bundled corpus (not under test).

  Shared by the tests that train small runs, so each trains no tokenizer of
  its own; a module may override it (train_test's has 1024 pieces).
  """
  from pretrain_lm.data import sources
  from pretrain_lm.data import tokenizer as tokenizer_lib

  path = str(tmp_path_factory.mktemp('tok') / 'tokenizer.model')
  c = load_config('bert', 'size=tiny')
  texts = sources.iter_texts(c.data, limit=2000)
  tokenizer_lib.train_tokenizer(texts, path, vocab_size=512)
  return path


@pytest.fixture(scope='session')
def tiny_workdir(tmp_path_factory):
  """A factory of small trained workdirs, one per (config, arg, steps).

  `tiny_workdir('bert', 'size=tiny')` trains the preset for `steps` steps
  with a 512-piece tokenizer, rows of 64 and batches of 8 on the 8 fake
  devices, and returns the workdir (built once per test session and worker;
  treat it as read-only).
  """
  cache = {}

  def make(name: str, arg: str = 'size=tiny', steps: int = 4, **overrides):
    key = (name, arg, steps, tuple(sorted(overrides.items())))
    if key in cache:
      return cache[key]
    from pretrain_lm import train

    c = load_config(name, arg)
    if c.data.tokenizer_type != 'char':
      # Room for the ids span corruption and UL2 reserve after the pieces.
      c.model.vocab_size = 512 + 128
      c.data.tokenizer_max_docs = 2000
    c.data.seq_len = 64
    c.model.max_len = max(c.model.max_len, 128)
    c.data.batch_size = 8
    c.data.shuffle_buffer = 64
    c.data.eval_batches = 1
    c.optimizer.warmup_steps = 1
    c.train.num_steps = steps
    c.train.log_every = steps
    c.train.eval_every = steps
    c.train.progress_bar = False
    c.checkpoint.every = steps
    c.checkpoint.async_save = False
    for dotted, value in overrides.items():  # e.g. model__pooler=True
      section, field = dotted.split('__')
      c[section][field] = value
    workdir = str(tmp_path_factory.mktemp(f'{name}_workdir'))
    train.train_and_evaluate(c, workdir)
    cache[key] = workdir
    return workdir

  return make
