"""End-to-end training: loss falls, sharding invariance, exact resume."""

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import COMPILE_FLAGS, read_metrics
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import pretrain_lm
from pretrain_lm import metrics, sharding, train
from pretrain_lm.data import sources
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, ModelConfig
from pretrain_lm.models.config import size_preset
from pretrain_lm.training import loop
from pretrain_lm.training import state as state_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BERT = os.path.join(REPO, 'configs', 'bert.py')
VOCAB = 1024


def load_config(**overrides):
  """configs/bert.py:size=tiny shrunk further for tests, plus overrides."""
  import importlib.util

  spec = importlib.util.spec_from_file_location('bert_config', BERT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config('size=tiny')
  c.model.vocab_size = VOCAB
  c.data.seq_len = 64
  c.data.batch_size = 16
  c.data.shuffle_buffer = 64
  c.data.eval_batches = 2
  c.train.progress_bar = False
  for key, value in overrides.items():
    section, field = key.split('.')
    c[section][field] = value
  return c


def override_flags(overrides: dict) -> list[str]:
  return [f'--config.{k}={v}' for k, v in overrides.items()]


@pytest.fixture(scope='module', autouse=True)
def compile_cache(tmp_path_factory):
  """A persistent compilation cache for the runs this module launches.

  Relaunches of one config (resume, kill and restart) load their compiled
  steps instead of compiling them again. Only the child processes read the
  variables: this process's JAX was configured at import.
  """
  with pytest.MonkeyPatch.context() as mp:
    cache = str(tmp_path_factory.mktemp('jax_cache'))
    mp.setenv('JAX_COMPILATION_CACHE_DIR', cache)
    mp.setenv('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
    yield


@pytest.fixture(scope='module')
def tokenizer_path(tmp_path_factory):
  """One small tokenizer for every run here (training it is not under test)."""
  path = str(tmp_path_factory.mktemp('tok') / 'tokenizer.model')
  c = load_config()
  texts = sources.iter_texts(c.data, limit=2000)
  tokenizer_lib.train_tokenizer(texts, path, vocab_size=VOCAB)
  return path


def train_losses(workdir):
  return {m['step']: m['loss'] for m in read_metrics(workdir) if 'loss' in m}


@pytest.mark.slow
def test_loss_falls_well_below_uniform(tmp_path, tokenizer_path):
  """120 steps take BERT-tiny's loss from ln(V) to a nat below it.

  Slow (`make test-all`): configs_test trains every preset, BERT's
  included, checking that the loss falls, the logged metrics, the run's
  files, the tokenizer's special ids in the checkpoint and the load.
  """
  c = load_config(
    **{
      'data.tokenizer': tokenizer_path,
      'train.num_steps': 120,
      'train.log_every': 10,
      'train.eval_every': 120,
      'checkpoint.every': 120,
    }
  )
  train.train_and_evaluate(c, str(tmp_path))
  losses = train_losses(str(tmp_path))
  uniform = math.log(VOCAB)
  # At initialisation the logits are near zero: loss ~ ln(V).
  assert abs(losses[10] - uniform) < 1.0, losses
  # Learning the unigram distribution alone takes it well below ln(V).
  final = np.mean([losses[s] for s in (100, 110, 120)])
  assert final < uniform - 1.0, losses
  evals = [m for m in read_metrics(str(tmp_path)) if 'eval_loss' in m]
  assert evals and evals[-1]['eval_loss'] < uniform - 1.0
  first = read_metrics(str(tmp_path))[1]
  for key in (
    'mlm_accuracy',
    'perplexity',
    'learning_rate',
    'grad_norm',
    'tokens_per_s',
    'model_tflops_per_s',
  ):
    assert key in first, first
  assert os.path.isdir(tmp_path / 'tensorboard')
  for name in ('config.json', 'run_metadata.json', 'tokenizer.model'):
    assert (tmp_path / name).exists(), name
  meta = json.loads((tmp_path / 'run_metadata.json').read_text())
  assert meta['starts'][0]['versions']['jax'] == jax.__version__

  # The checkpoint loads in one call, and its params produce the same loss.
  m = pretrain_lm.load(str(tmp_path))
  assert m.step == 120
  assert m.tokenizer.special_ids == {
    'pad': 0,
    'unk': 1,
    'cls': 2,
    'sep': 3,
    'mask': 4,
  }
  ckpt_meta = json.loads(
    (tmp_path / 'checkpoints' / '120' / 'meta' / 'metadata').read_text()
  )
  assert ckpt_meta['tokenizer']['special_ids'] == m.tokenizer.special_ids


def test_sharded_training_matches_single_device(tmp_path, tokenizer_path):
  assert jax.device_count() == 8
  overrides = {
    'data.tokenizer': tokenizer_path,
    'train.num_steps': 6,
    'train.log_every': 1,
    'train.eval_every': 6,
    'checkpoint.every': 6,
    'checkpoint.async_save': False,
  }
  runs = {}
  for devices, shape in (
    (jax.devices()[:1], (1, 1, 1)),
    (jax.devices(), (2, 2, 2)),
    (jax.devices(), (8, 1, 1)),
  ):
    c = load_config(**overrides)
    workdir = str(tmp_path / 'x'.join(map(str, shape)))
    mesh_config = dict(zip(sharding.MESH_AXES, shape, strict=True))
    c.mesh.update(mesh_config)
    mesh = sharding.make_mesh(mesh_config, devices)
    train.Trainer(c, workdir, mesh).run()
    metrics = {m['step']: m for m in read_metrics(workdir) if 'loss' in m}
    runs[shape] = metrics
  single = runs[(1, 1, 1)]
  for shape in ((2, 2, 2), (8, 1, 1)):
    # Step 1: same init, data and dropout masks; only the order of the
    # floating-point reductions differs.
    for key in ('loss', 'grad_norm', 'mlm_accuracy'):
      np.testing.assert_allclose(runs[shape][1][key], single[1][key], rtol=1e-5)
    # Later steps: Adam divides by sqrt(v), which magnifies round-off in the
    # near-zero gradients, so the curves agree to ~1e-4, not bitwise.
    np.testing.assert_allclose(
      [runs[shape][s]['loss'] for s in range(1, 7)],
      [single[s]['loss'] for s in range(1, 7)],
      rtol=1e-3,
    )
  # Training did something: the parameters moved the loss.
  assert single[1]['loss'] != single[6]['loss']


def test_param_shardings_follow_rule_table(tmp_path, tokenizer_path):
  c = load_config(**{'data.tokenizer': tokenizer_path})
  c.mesh.update({'data': 2, 'fsdp': 2, 'tensor': 2})
  trainer = train.Trainer(c, str(tmp_path))
  state = trainer.initial_state()
  params = state.params
  expected = {
    ('token_embed', 'embedding'): P('tensor', 'fsdp'),  # vocab, embed
    ('embeddings', 'position_embed', 'embedding'): P(None, 'fsdp'),
    ('encoder', 'layer_0', 'attention', 'query_kernel'): P(
      'fsdp', 'tensor', None
    ),  # embed, heads, kv
    ('encoder', 'layer_0', 'attention', 'out_kernel'): P(
      'tensor', None, 'fsdp'
    ),
    ('encoder', 'layer_0', 'mlp', 'wi_kernel'): P('fsdp', 'tensor'),
    ('encoder', 'layer_0', 'mlp', 'wo_kernel'): P('tensor', 'fsdp'),
    ('encoder', 'layer_1', 'attention_norm', 'scale'): P(None),
    ('mlm_head', 'output_bias'): P('tensor'),
    # Deliberately not on 'tensor' (see models/heads.py).
    ('mlm_head', 'transform_kernel'): P('fsdp', None),
  }
  for path, spec in expected.items():
    leaf = params
    for key in path:
      leaf = leaf[key]
    assert leaf.sharding.spec == spec, (path, leaf.sharding.spec)
    assert leaf.sharding.mesh.shape == {'data': 2, 'fsdp': 2, 'tensor': 2}
  # Adam's moments are sharded exactly like the params they track.
  mu = state.opt_state[1][0].mu
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(mu), strict=True):
    assert a.sharding.spec == b.sharding.spec
  # A real shard: each device holds 1/4 of the (vocab, embed) table.
  table = params['token_embed']['embedding']
  assert table.addressable_shards[0].data.shape == (VOCAB // 2, 128 // 2)
  # The abstract state (what restores read into; traced, not compiled) is
  # the initialised one's every leaf: shape, dtype and sharding.
  described = lambda tree: [
    (x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(tree)
  ]
  assert jax.tree.structure(trainer.abstract_state()) == (
    jax.tree.structure(state)
  )
  assert described(trainer.abstract_state()) == described(state)
  # So is the parameters-only target pretrain_lm.load restores into.
  with trainer.context():
    params_only = sharding.abstract_params(
      trainer.model, trainer.batch_shapes, trainer.mesh
    )
  assert described(params_only) == described(state.params)


def test_restore_targets_replicate_what_the_mesh_cannot_split():
  # An odd vocabulary (as GPT-2's 50257) over tensor=2: the token table
  # is split over fsdp only, in training's state and in pretrain_lm.load's
  # params-only target alike.
  model = MODELS['encoder'](ModelConfig(vocab_size=97, **size_preset('tiny')))
  batch = {
    'input_ids': jax.ShapeDtypeStruct((8, 16), jnp.int32),
    'masked_positions': jax.ShapeDtypeStruct((8, 4), jnp.int32),
  }
  mesh = sharding.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
    state = state_lib.abstract_train_state(
      model, optax.adamw(1e-3), batch, mesh
    )
    params = sharding.abstract_params(model, batch, mesh)
  assert params == state.params
  table = params['token_embed']['embedding']
  assert table.shape == (97, 128) and table.sharding.spec == P(None, 'fsdp')
  # What divides stays split.
  wi = params['encoder']['layer_0']['mlp']['wi_kernel']
  assert wi.sharding.spec == P('fsdp', 'tensor')


class _Terminal(io.StringIO):
  def isatty(self):
    return True


@pytest.mark.parametrize('terminal', [False, True])
def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, terminal):
  # A batch job's log would get tqdm's redraws; it gets the step lines.
  err, out = (_Terminal() if terminal else io.StringIO()), io.StringIO()
  monkeypatch.setattr(sys, 'stderr', err)
  monkeypatch.setattr(sys, 'stdout', out)
  writer = metrics.MetricWriter(
    str(tmp_path), total_steps=4, initial_step=0, enabled=True
  )
  writer.advance(2)
  writer.write(2, {'loss': 2.5})
  writer.close()
  assert 'step 2: loss=2.5' in out.getvalue()
  assert ('2/4' in err.getvalue()) == terminal, err.getvalue()


def run_main(workdir, overrides, check=True, env=None, **popen_kwargs):
  """Runs `python -m pretrain_lm.main` as a user would, in a new process."""
  cmd = [
    sys.executable,
    '-m',
    'pretrain_lm.main',
    f'--config={BERT}:size=tiny',
    f'--workdir={workdir}',
    *override_flags(overrides),
  ]
  env = dict(
    os.environ, XLA_FLAGS=COMPILE_FLAGS, JAX_PLATFORMS='cpu', **(env or {})
  )
  if popen_kwargs.pop('background', False):
    return subprocess.Popen(
      cmd,
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
  result = subprocess.run(
    cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
  )
  if check:
    assert result.returncode == 0, result.stdout + result.stderr
  return result


def final_params(workdir):
  return jax.device_get(pretrain_lm.load(workdir).params)


RESUME_EVERY = 8  # steps between the checkpoints the resume tests restore


def resume_overrides(tokenizer_path):
  return {
    'data.tokenizer': tokenizer_path,
    'model.vocab_size': VOCAB,
    'data.seq_len': 64,
    'data.batch_size': 16,
    'data.shuffle_buffer': 64,
    'data.eval_batches': 1,
    'train.num_steps': 2 * RESUME_EVERY,
    'train.log_every': 1,
    'train.eval_every': 100,
    'checkpoint.every': RESUME_EVERY,
    'train.progress_bar': False,
  }


def assert_same_run(straight, workdir):
  """The interrupted run ended with the same params and loss curve."""
  want, got = final_params(straight), final_params(workdir)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(a, b)
  losses = train_losses(workdir)
  for step, loss in train_losses(straight).items():
    assert losses[step] == loss, (workdir, step)


def test_resume_is_exact_across_processes(tmp_path, tokenizer_path):
  n = RESUME_EVERY
  # All three runs share a persistent compilation cache.
  cache = tmp_path / 'jax_cache'
  base = {
    **resume_overrides(tokenizer_path),
    'train.compilation_cache_dir': str(cache),
  }
  straight = str(tmp_path / 'straight')
  straight_run = run_main(straight, base)
  done = straight_run.stdout
  # Orbax's warning about the handler checkpoint/orbax_setup.py registers
  # on purpose stays out of the user's log.
  assert 'Type handler registry' not in straight_run.stderr
  # The run ends by saying where the checkpoint is and how to load it.
  assert f'Checkpoint: {straight}/checkpoints/{2 * n}' in done, done
  assert f'pretrain_lm.load({straight!r})' in done, done
  assert any(cache.iterdir()), 'the first run stored no compiled step'

  # Stop cleanly after n steps (as a job with a time slot would), rerun.
  resumed = str(tmp_path / 'resumed')
  first = run_main(resumed, {**base, 'train.exit_interval': n})
  assert f'Stopping at step {n}' in first.stdout + first.stderr
  assert train_losses(resumed).keys() == set(range(1, n + 1))
  # The rerun loads its train step from the cache, not from XLA, and the
  # cached executable resumes bitwise all the same.
  last = run_main(
    resumed, {**base, 'train.exit_interval': n}, env={'JAX_LOG_COMPILES': '1'}
  )
  hits = re.findall(r"compilation cache hit for '(\w+)'", last.stderr)
  assert 'jit_train_step' in hits, last.stderr[-3000:]
  assert_same_run(straight, resumed)


@pytest.mark.slow
def test_sigkill_mid_run_resumes_exactly(tmp_path, tokenizer_path):
  """A run killed with no chance to save resumes from its last checkpoint.

  Slow (`make test-all`): fault_test kills checkpoint saves at many points
  (the latest committed one always restores) and the test above resumes
  through the CLI bit for bit; this one kills a whole run.
  """
  base = resume_overrides(tokenizer_path)
  straight = str(tmp_path / 'straight')
  run_main(straight, base)
  # Hard kill (SIGKILL) after the step-4 checkpoint.
  killed = str(tmp_path / 'killed')
  proc = run_main(killed, {**base, 'checkpoint.every': 2}, background=True)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(os.path.join(killed, 'checkpoints', '4')):
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.02)
  assert proc.wait() == -signal.SIGKILL, 'the run ended before the kill'
  run_main(killed, {**base, 'checkpoint.every': 2})
  assert_same_run(straight, killed)


@pytest.mark.slow
def test_sigterm_saves_and_resumes(tmp_path, tokenizer_path):
  """SIGTERM: save within one step, exit 75, and the rerun resumes.

  Slow (`make test-all`): multihost_test preempts a two-process run the
  same way (the same signal handling, save, exit code and resume) and
  checks it against one process.
  """
  overrides = {
    'data.tokenizer': tokenizer_path,
    'model.vocab_size': VOCAB,
    'data.seq_len': 64,
    'data.batch_size': 16,
    'data.eval_batches': 1,
    'train.num_steps': 100_000,
    'train.log_every': 1,
    'checkpoint.every': 100_000,
    'train.progress_bar': False,
  }
  workdir = str(tmp_path / 'run')
  proc = run_main(workdir, overrides, background=True)
  metrics = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.time() + 300
  while time.time() < deadline and not (
    os.path.exists(metrics) and os.path.getsize(metrics) > 0
  ):
    time.sleep(0.1)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  # "Resume me" for launchers; a finished run or exit_interval exits 0.
  assert proc.returncode == loop.EXIT_RESUME == 75, out
  assert 'saving a checkpoint' in out and 'Exiting with code 75' in out
  steps = os.listdir(os.path.join(workdir, 'checkpoints'))
  assert len(steps) == 1 and int(steps[0]) > 0, steps
  saved = int(steps[0])
  # Saved within one step: at most the step in flight when the signal came
  # finished after it, and it is the step saved.
  after = out[out.index('saving a checkpoint') :]
  assert len(re.findall(r'^step \d+:', after, re.M)) <= 1, out
  assert max(train_losses(workdir)) == saved, out
  assert f'Stopping at step {saved}' in out, out

  # The checkpoint is committed: the same command resumes from it (stopped
  # again one step later by exit_interval, which leaves the step's compile
  # cache entry usable).
  rerun = run_main(workdir, {**overrides, 'train.exit_interval': saved + 1})
  assert f'Resumed from {workdir}/checkpoints at step {saved}' in rerun.stdout
  assert max(train_losses(workdir)) == saved + 1


@pytest.mark.parametrize(
  'override, expected',
  [
    ({'train.num_step': 5}, ["'train.num_step'", "'num_steps'", "'log_every'"]),
    (
      {'data.source': '/nonexistent/corpus*.txt'},
      ['data.source', '/nonexistent/corpus*.txt'],
    ),
    ({'data.source': 'EMPTY'}, ['data.source', 'empty.txt']),
  ],
)
def test_bad_input_fails_fast_with_clear_message(tmp_path, override, expected):
  if override.get('data.source') == 'EMPTY':
    empty = tmp_path / 'empty.txt'
    empty.write_text('')
    override = {'data.source': str(empty)}
  workdir = tmp_path / 'run'
  start = time.time()
  result = run_main(str(workdir), override, check=False)
  output = result.stdout + result.stderr
  assert result.returncode != 0
  for text in expected:
    assert text in output, output
  # Failed before building anything: no tokenizer trained, nothing compiled.
  assert not (workdir / 'tokenizer.model').exists()
  assert 'Traceback' not in output, output
  assert time.time() - start < 60

  assert not (tmp_path / 'bad').exists()  # refused before writing anything
