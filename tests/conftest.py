"""Test setup: 8 fake CPU devices so sharding is exercised without hardware."""

import os

# Must happen before JAX is imported anywhere.
# The suite is mostly XLA compiles of tiny models: skipping LLVM's costly
# backend optimisations cuts the compile time and leaves what is tested
# (partitioning, numerics to float32 round-off) alone. (Level 1 runs steps
# faster but compiles slower, which does not pay for a suite of tiny
# steps.) XLA's older element-wise emitters, instead of its MLIR fusion
# emitters, compile faster again (the round-off differs in the last bits,
# as between any two compiles). Both are timed in
# experiments/benchmarks/README.md, Test-suite time. Child processes that
# want JAX's one CPU device get these flags alone as their XLA_FLAGS.
COMPILE_FLAGS = (
  '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
  ' --xla_cpu_use_fusion_emitters=false'
)
os.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + (
  ' --xla_force_host_platform_device_count=8 ' + COMPILE_FLAGS
)
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# The suite runs on the CPU; JAX_PLATFORMS=cuda runs the GPU-only tests
# (kernels_test's cuDNN check) on a GPU machine.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

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

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The integration tier: files whose tests run whole programs or train (every
# preset trained, resume after a stop, several processes, entry points,
# faults and corrupt checkpoints, launchers, notebooks, Beam preparation,
# fine-tuning runs, tests/conftest.py's trained tiny_workdir). Every other
# file is the unit tier. `make test` runs the unit tier first, then this
# one (markers 'integration' and 'not integration').
INTEGRATION = frozenset(
  f'{name}_test.py'
  for name in [
    'aot',
    'bench',
    'checkpoint',
    'configs',
    'convert',
    'cove',
    'cvt',
    'describe',
    'electra',
    'evaluate',
    'fault',
    'fewshot',
    'finetune',
    'first_run',
    'gcs',
    'generative',
    'goodput',
    'gpu_mfu',
    'launch',
    'multihost',
    'nonfinite',
    'notebooks',
    'prepare',
    'prepared',
    'pretrained',
    'provenance',
    'resume',
    'resume_meta',
    'sweep',
    'switches',
    'train',
    'xla_flags',
  ]
)


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.path.name in INTEGRATION:
      item.add_marker(pytest.mark.integration)


def one_device():
  """A 1-device mesh: compiles faster where sharding is not under test."""
  from pretrain_lm import sharding  # noqa: PLC0415

  return sharding.make_mesh(
    {'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1]
  )


def tiny_cfg(family: str, **kw):
  """A 2-layer, 32-wide ModelConfig of `family` for model-level tests,
  without dropout in the body (`kw` overrides any field)."""
  from pretrain_lm.models import ModelConfig  # noqa: PLC0415

  return ModelConfig(
    **{
      'family': family,
      'vocab_size': 50,
      'num_layers': 2,
      'emb_dim': 32,
      'num_heads': 2,
      'head_dim': 16,
      'mlp_dim': 64,
      'max_len': 16,
      'dropout_rate': 0.0,
      'attention_dropout_rate': 0.0,
      **kw,
    }
  )


def assert_trees_equal(a, b) -> None:
  """The same tree structure, and every leaf of the same dtype and equal bit
  for bit (the failure names the leaf's path)."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  pairs = zip(
    jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
  )
  for (path, x), y in pairs:
    x, y = np.asarray(x), np.asarray(y)
    name = jax.tree_util.keystr(path)
    assert x.dtype == y.dtype, (name, x.dtype, y.dtype)
    np.testing.assert_array_equal(x, y, err_msg=name)


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


def scratch_bytes(jitted, *args) -> int:
  """The compiled program's scratch memory (XLA's temporary buffers) for
  `args`: what gradient accumulation keeps to a microbatch's activations."""
  compiled = jitted.lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def sgd_steps(trainer):
  """({accum: a jitted SGD(lr=1) step}, a function making a fresh state)
  for a Trainer (pretraining's or fine-tuning's)."""
  from pretrain_lm.training import state as state_lib  # noqa: PLC0415
  from pretrain_lm.training import step as step_lib  # noqa: PLC0415

  tx = optax.sgd(1.0)  # params after = params before - gradient
  with trainer.context():
    shardings = state_lib.shardings_of(
      state_lib.abstract_train_state(
        trainer.model, tx, trainer.batch_shapes, trainer.mesh
      )
    )
  steps = {
    accum: step_lib.jit_train_step(
      trainer.model,
      tx,
      trainer.loss_fn,
      trainer.schedule,
      shardings,
      trainer.mesh,
      grad_accum_steps=accum,
    )
    for accum in (1, 4)
  }
  with trainer.context():
    state = state_lib.create_train_state(
      jax.random.key(0),
      trainer.batch_shapes,
      model=trainer.model,
      tx=tx,
      shardings=shardings,
    )
  # Copies keep the shardings; each step donates (consumes) its own.
  new_state = lambda: jax.tree.map(lambda x: x.copy(), state)
  return steps, new_state


def one_step(trainer, steps, new_state, batch, accum):
  """(params before, params after, metrics) of one step."""
  from pretrain_lm import sharding

  with trainer.context():
    state = new_state()
    before = jax.device_get(state.params)
    batch = sharding.host_to_global(batch, trainer.mesh)
    state, metrics = steps[accum](state, batch)
  return before, jax.device_get(state.params), jax.device_get(metrics)


def assert_same_step(trainer, batch, steps=None):
  """accum=4 and accum=1 on `batch`: equal loss and gradient (round-off)."""
  steps, new_state = steps or sgd_steps(trainer)
  before, big, big_metrics = one_step(trainer, steps, new_state, batch, 1)
  _, micro, micro_metrics = one_step(trainer, steps, new_state, batch, 4)
  for key in ('loss', 'grad_norm', 'num_predictions'):
    np.testing.assert_allclose(
      micro_metrics[key], big_metrics[key], rtol=1e-5, err_msg=key
    )
  before, big, micro = map(jax.tree.leaves, (before, big, micro))
  grads_big = [p - a for p, a in zip(before, big, strict=True)]
  grads_micro = [p - b for p, b in zip(before, micro, strict=True)]
  # Round-off relative to the largest gradient: some are zero in exact
  # arithmetic (attention's key bias) and only round-off in float32.
  scale = max(np.abs(g).max() for g in grads_big)
  for a, b in zip(grads_big, grads_micro, strict=True):
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * scale)
  return big_metrics
