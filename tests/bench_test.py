"""The benchmarks' figures: model FLOPs against the step, MFU, the CLI."""

import ast
import dataclasses
import glob
import importlib
import inspect
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import COMPILE_FLAGS, REPO, load_config

from pretrain_lm import metrics, sharding, train
from pretrain_lm.bench import step, timing
from pretrain_lm.convert import hf
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, transformer
from pretrain_lm.models.config import ModelConfig

# One config per model family (and both encoder-decoders), each config
# file's argument after 'size=tiny'. ALBERT's shared layer is a scan, whose
# body XLA's cost analysis counts once: two layers, a scan of one and the
# last at the predicted positions; a scanned BERT stack likewise. The BiLM
# with 2 layers per direction (its preset has 4): the same formula, half
# the compile.
FAMILIES = {
  'bert': ('bert', '', {}),
  'gpt': ('gpt', '', {}),
  'gpt_prefix_lm': ('gpt', ',objective=prefix_lm', {}),
  't5': ('t5', '', {}),
  'bart': ('bart', '', {}),
  'electra': ('electra', '', {}),
  'xlnet': ('xlnet', '', {}),
  'bilm': ('bilm', '', {'num_layers': 2}),
  'albert': ('albert', '', {'num_layers': 2}),
  'bert_scan': ('bert', '', {'num_layers': 2, 'scan_layers': True}),
}
# Wide enough, with rows long enough and no dropout, that the work XLA
# counts besides the matmuls (norms, softmax, activations, Adam; model
# FLOPs leave it out by convention) is a small, steady share of the step:
# 1.6-2.6% in every family (measured), while attention's score and value
# products are 9-14% of it.
WIDTH = {'emb_dim': 256, 'num_heads': 4, 'head_dim': 64, 'mlp_dim': 1024}
SEQ_LEN = 256
# The most the element-wise work may add to the matmuls' count.
ELEMENTWISE = 0.04


def one_device(c):
  """The mesh a one-accelerator machine has: what the FLOP test
  lowers for and the exported steps are exported for."""
  return sharding.make_mesh(c.mesh, jax.devices()[:1])


@pytest.fixture(scope='module')
def tokenizer(tokenizer_path):
  return tokenizer_lib.load_tokenizer(tokenizer_path)


@pytest.mark.parametrize('family', FAMILIES)
def test_model_flops_are_the_compiled_steps_flops(
  family, tokenizer, monkeypatch
):
  name, arg, overrides = FAMILIES[family]
  c = load_config(name, 'size=tiny' + arg)
  c.model.update(WIDTH, **overrides)
  c.model.vocab_size = 1024
  c.model.max_len = max(c.model.max_len, SEQ_LEN)
  c.model.dropout_rate = c.model.attention_dropout_rate = 0.0
  c.data.batch_size, c.data.seq_len = 2, SEQ_LEN
  c.mesh.data = 1
  shapes = {
    k: jax.ShapeDtypeStruct((c.data.batch_size, *s), np.dtype(d))
    for k, (s, d) in hf.batch_spec(c, tokenizer).items()
  }
  lowered = train.lower_train_step(c, one_device(c), shapes)

  def model_flops():
    return MODELS[c.model.family].train_flops(
      ModelConfig.from_config(c.model),
      {k: v.shape for k, v in shapes.items()},
    )

  # XLA's cost analysis of the step as traced, forward and backward:
  # 2 x output size x contracted size for each matmul, plus one per
  # element of each element-wise op. So at least the model FLOPs, and
  # above them by no more than the element-wise work ...
  flops = model_flops()
  cost = lowered.cost_analysis()
  traced = float((cost[0] if isinstance(cost, list | tuple) else cost)['flops'])
  assert flops <= traced <= (1 + ELEMENTWISE) * flops, traced / flops
  # ... and likewise after XLA's optimisations, which may also drop a
  # little of the traced work (XLNet's step: 0.6% below the model FLOPs).
  xla = timing.xla_flops(lowered.compile())
  assert 0.98 * flops <= xla <= (1 + ELEMENTWISE) * flops, xla / flops
  # The band is narrower than attention's products: a count that left
  # them out (or was off by 2x) would fall outside it.
  monkeypatch.setattr(transformer, 'attended_keys', lambda *a: 0.0)
  assert traced > (1 + ELEMENTWISE) * model_flops()


def test_cudnn_causal_attention_counts_the_keys_its_mask_keeps():
  # cuDNN's causal mask type skips the blocks above the diagonal in tiles
  # of its own: the FLOPs count the triangle, (L + 1) / 2 keys per query.
  base = ModelConfig.from_config(load_config('gpt', 'size=tiny').model)

  def keys(impl, causal=True):
    cfg = dataclasses.replace(
      base, attention_impl=impl, attention_dropout_rate=0.0
    )
    return transformer.attended_keys(cfg, 64, causal)

  assert keys('cudnn') == 32.5
  assert keys('cudnn', causal=False) == 64
  # The einsum kernel runs the whole square.
  assert keys('einsum') == 64


def test_runs_are_timed_in_turn_and_skipped_steps_raise():
  calls = []

  def fake_step(name, skipped=0):
    def call(state, batch):
      calls.append(name)
      return state + 1, {'loss': 0.0, 'skipped_total': skipped}

    return timing.Run(call, 0, None, compile_s=0.0)

  a, b = fake_step('a'), fake_step('b')
  timing.time_in_turn([a, b], steps=3, warmup=1)
  # Every other round reversed: drift between rounds hits both alike.
  assert calls == [*('a', 'b', 'b', 'a'), *('a', 'b', 'b', 'a')]
  assert (a.state, len(a.times), len(b.times)) == (4, 3, 3)
  with pytest.raises(RuntimeError, match='non-finite'):
    timing.time_in_turn([a, fake_step('c', skipped=1)], steps=1, warmup=0)


def test_step_figures_by_hand():
  # Steps of 2, 1 and 3 s, each 1,000 tokens and 6 TFLOP of model work,
  # on devices whose peak is 10 TFLOP/s: the median step (2 s) does
  # 3 TFLOP/s, 30% of the peak.
  f = timing.step_figures([2.0, 1.0, 3.0], 1000, 6e12, 1e13)
  assert f == {
    'step_s': 2.0,
    'step_s_min': 1.0,
    'steps_timed': 3,
    'tokens_per_s': 500.0,
    'model_flops_per_token': 6e9,
    'achieved_tflops': 3.0,
    'peak_tflops': 10.0,
    'mfu': pytest.approx(0.3),
  }
  # No peak (a CPU without a configured one): no MFU, the rest the same.
  assert 'mfu' not in timing.step_figures([2.0], 1000, 6e12, None)


def test_peak_is_configured_or_the_datasheets(monkeypatch):
  c = load_config('bert', 'size=tiny')
  assert step.peak_flops(c)[0] is None  # a CPU has no datasheet figure
  c.train.peak_flops_per_device = 2e11  # per device; the step uses all
  assert step.peak_flops(c) == (2e11 * jax.device_count(), 'configured')
  kind = jax.devices()[0].device_kind
  monkeypatch.setattr(metrics, 'PEAK_FLOPS', ((kind, 5e11),))
  c.train.peak_flops_per_device = 0.0
  assert step.peak_flops(c) == (5e11 * jax.device_count(), 'datasheet')


def run_bench(*args: str) -> tuple[dict, str]:
  """`python -m pretrain_lm.bench ARGS` on one CPU device: its JSON line
  and the table printed before it."""
  # One device, compiled as the suite compiles: the figures' values are not
  # what is checked, only that they agree with each other.
  env = dict(os.environ, XLA_FLAGS=COMPILE_FLAGS, JAX_PLATFORMS='cpu')
  out = subprocess.run(
    [sys.executable, '-m', 'pretrain_lm.bench', *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  *table, last = out.stdout.strip().splitlines()
  return json.loads(last), '\n'.join(table)


def test_bench_train_prints_step_time_tokens_and_mfu():
  r, table = run_bench(
    '--config=configs/bert.py:size=tiny',
    '--config.model.vocab_size=1024',
    '--config.data.tokenizer_max_docs=500',
    '--config.train.peak_flops_per_device=1e11',
    '--steps=2',
    '--warmup=1',
    # On the CPU only when asked: the waited steps agree with it there.
    '--pipelined_steps=2',
  )
  assert (r['what'], r['backend'], r['batch_size'], r['seq_len']) == (
    'train',
    'cpu',
    8,
    128,
  )
  assert r['tokens_per_step'] == 8 * 128 and r['steps_timed'] == 2
  assert r['tokens_per_s'] == pytest.approx(
    r['tokens_per_step'] / r['step_s'], rel=1e-6
  )
  assert r['achieved_tflops'] == pytest.approx(
    r['tokens_per_s'] * r['model_flops_per_token'] / 1e12, rel=1e-6
  )
  assert (r['peak_source'], r['peak_tflops']) == ('configured', 0.1)
  assert r['mfu'] == pytest.approx(r['achieved_tflops'] / 0.1, rel=1e-6)
  assert r['compile_s'] > 0 and r['loss'] > 0
  # XLA's FLOP count is left out where a loop over microbatches hides it.
  assert (r['xla_flops_per_token'] is None) == (r['microbatches'] > 1)
  if os.path.exists('/proc/cpuinfo'):  # Linux: what the CPU can vectorise
    simd = ('amx_bf16', 'avx512_bf16', 'avx512f', 'avx2', 'avx', 'none')
    assert r['cpu_simd'] in simd
    if r['cpu'] == 'x86_64':  # 'family/model' as cpuinfo numbers them
      assert re.fullmatch(r'\d+/\d+', r['cpu_family']), r['cpu_family']
  # Steps dispatched back to back, as the training loop runs them.
  assert r['tokens_per_s_pipelined'] == pytest.approx(
    r['tokens_per_step'] / r['step_s_pipelined'], rel=1e-6
  )
  assert r['mfu_pipelined'] == pytest.approx(
    r['tokens_per_s_pipelined'] * r['model_flops_per_token'] / 1e11,
    rel=1e-6,
  )
  # The table says the same, a figure a line.
  assert re.search(rf'^mfu +{r["mfu"]:.4g}$', table, re.MULTILINE), table
  # Without a peak a CPU step gets no MFU, and says how to give one.
  r, _ = run_bench(
    '--config=configs/bert.py:size=tiny',
    '--config.model.vocab_size=1024',
    '--config.data.tokenizer_max_docs=500',
    '--steps=1',
    '--warmup=0',
  )
  assert 'mfu' not in r and r['tokens_per_s'] > 0
  assert 'peak_flops_per_device' in r['peak_source']


def test_bench_pipeline_and_decode():
  r, _ = run_bench(
    '--config=configs/bert.py:size=tiny',
    '--what=pipeline',
    '--pipeline_batches=5',
  )
  assert r['tokens_per_s'] > 0 and r['cached_tokens_per_s'] > 0
  assert r['tokens_per_s_per_core'] * r['cores'] == pytest.approx(
    r['tokens_per_s']
  )
  assert r['start_step'] == 0 and r['first_batch_s'] > 0
  # Documents back to back: only the epoch's last row has padding.
  assert r['non_pad_fraction'] > 0.95
  r, _ = run_bench(
    '--config=configs/gpt.py:size=tiny',
    '--what=decode',
    '--decode_length=32',
    '--decode_batch_sizes=1,4',
    '--repeats=1',
  )
  for b in ('batch1', 'batch4'):
    d = r[b]
    assert d['cached_tokens_per_s'] == pytest.approx(
      int(b[5:]) / d['cached_s_per_step']
    )
    assert d['cache_speedup'] == pytest.approx(
      d['full_forward_s'] / d['cached_s_per_step']
    )


def imports_without(blocked: tuple[str, ...], modules: str) -> None:
  """Imports `modules` in a fresh Python where `blocked` packages fail."""
  code = (
    'import sys\n'
    'class Block:\n'
    '  def find_spec(self, name, path=None, target=None):\n'
    f"    if name.split('.')[0] in {blocked!r}:\n"
    "      raise ImportError(f'{name} is blocked')\n"
    'sys.meta_path.insert(0, Block())\n'
    f'import {modules}\n'
  )
  out = subprocess.run(
    [sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True
  )
  assert out.returncode == 0, out.stderr[-2000:]


def test_gpu_side_benchmarks_import_no_tensorflow():
  # experiments/benchmarks/gpu/ runs decoding, and exported steps timed
  # with bench.timing, on accelerator machines that have JAX but not the
  # input stack.
  tf = ('tensorflow', 'tensorflow_text', 'tensorflow_datasets')
  imports_without(
    (*tf, 'ml_collections', 'flax', 'optax', 'orbax'),
    'pretrain_lm.bench.timing, pretrain_lm.metrics, pretrain_lm.xla_flags',
  )
  imports_without(tf, 'pretrain_lm.bench.decode, pretrain_lm.bench.__main__')


def test_experiment_scripts_name_only_what_the_package_has():
  # The scripts in experiments/ have no tests of their own and read the
  # package's functions by name. A renamed function breaks them at run
  # time: this reads every `module.name` they use off the imported modules.
  missing = []
  for path in sorted(
    glob.glob(os.path.join(REPO, 'experiments', '**', '*.py'), recursive=True)
  ):
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    aliases = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for a in node.names:
          if a.name.split('.')[0] == 'pretrain_lm':
            aliases[a.asname or a.name] = importlib.import_module(a.name)
      elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith(
        'pretrain_lm'
      ):
        module = importlib.import_module(node.module)
        for a in node.names:
          try:  # a name in the module, or a submodule not imported yet
            value = (
              getattr(module, a.name)
              if hasattr(module, a.name)
              else importlib.import_module(f'{node.module}.{a.name}')
            )
          except ImportError:
            missing.append(f'{path}: {node.module}.{a.name}')
          else:
            aliases[a.asname or a.name] = value
    for node in ast.walk(tree):
      chain = []
      while isinstance(node, ast.Attribute):
        chain.insert(0, node.attr)
        node = node.value
      if not (chain and isinstance(node, ast.Name) and node.id in aliases):
        continue
      value = aliases[node.id]
      for i, name in enumerate(chain):
        if not (inspect.ismodule(value) or inspect.isclass(value)):
          break
        if not hasattr(value, name):
          missing.append(f'{path}: {".".join([node.id, *chain[: i + 1]])}')
          break
        value = getattr(value, name)
  assert not missing, missing
