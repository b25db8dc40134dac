"""The benchmark suite: model FLOPs against XLA, the CLI, the peer's inputs."""

import ast
import dataclasses
import glob
import gzip
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import NO_YNNPACK, REPO, load_config, uses_ynnpack

from pretrain_lm import configlib, sharding, train
from pretrain_lm.bench import peak, peer, step, timing
from pretrain_lm.convert import hf
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, transformer
from pretrain_lm.models.config import ModelConfig

# One config per model family (and both encoder-decoders), each config
# file's argument after 'size=tiny'. ALBERT's shared layer is a scan, whose
# body XLA's cost analysis counts once: two layers, a scan of one and the
# last at the predicted positions; a scanned BERT stack likewise. A prefix
# LM attends over the whole square, where causal stacks run
# layers.causal_blocks. The BiLM with 2 layers per direction (its preset
# has 4): the same formula, half the compile.
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
# Wide enough that norms, activations, dropout and the optimizer (which
# model FLOPs leave out by convention) are a few percent of the total.
WIDTH = {'emb_dim': 256, 'num_heads': 4, 'head_dim': 64, 'mlp_dim': 1024}


def dot_general_flops(lowered: jax.stages.Lowered) -> float:
  """2 x output size x contracted size, summed over the StableHLO dots."""
  total = 0
  for line in lowered.as_text().splitlines():
    if 'stablehlo.dot_general' not in line:
      continue
    lhs, _, out = (
      [int(d) for d in t.split('x')[:-1]]
      for t in re.findall(r'tensor<([0-9x]+x[a-z0-9]+)>', line)[-3:]
    )
    contracting = re.search(r'contracting_dims = \[([0-9, ]*)\] x', line)
    k = np.prod([lhs[int(i)] for i in contracting.group(1).split(',')])
    total += 2 * int(np.prod(out)) * int(k)
  return float(total)


def one_device(c):
  """The mesh a one-accelerator machine has: what the FLOP test
  lowers for and the exported steps are exported for."""
  return sharding.make_mesh(c.mesh, jax.devices()[:1])


@pytest.fixture(scope='module')
def tokenizer(tokenizer_path):
  return tokenizer_lib.load_tokenizer(tokenizer_path)


@pytest.mark.parametrize('family', FAMILIES)
def test_model_flops_are_the_compiled_steps_flops(family, tokenizer):
  name, arg, overrides = FAMILIES[family]
  c = load_config(name, 'size=tiny' + arg)
  c.model.update(WIDTH, **overrides)
  c.model.vocab_size = 1024
  c.data.batch_size, c.data.seq_len = 2, 64
  c.model.causal_chunk = 24  # causal rows of 64 (BART's decoder too): 3 blocks
  c.mesh.data = 1
  shapes = {
    k: jax.ShapeDtypeStruct((c.data.batch_size, *s), np.dtype(d))
    for k, (s, d) in hf.batch_spec(c, tokenizer).items()
  }
  lowered = train.lower_train_step(c, one_device(c), shapes)
  model_flops = MODELS[c.model.family].train_flops(
    ModelConfig.from_config(c.model), {k: v.shape for k, v in shapes.items()}
  )
  # Exactly the matmuls the step traces, forward and backward ...
  assert dot_general_flops(lowered) == pytest.approx(model_flops, rel=1e-3)
  # ... and within 10% of all XLA counts after optimising (the rest is
  # element-wise work: norms, activations, dropout masks, Adam).
  xla = timing.xla_flops(lowered.compile())
  assert model_flops <= xla <= 1.10 * model_flops


def test_cudnn_causal_attention_counts_the_keys_its_mask_keeps():
  # cuDNN's causal mask type skips the blocks above the diagonal in tiles
  # of its own: the FLOPs count the triangle, (L + 1) / 2 keys per query.
  base = ModelConfig.from_config(load_config('gpt', 'size=tiny').model)

  def keys(impl, chunk=0, causal=True):
    cfg = dataclasses.replace(
      base, attention_impl=impl, attention_dropout_rate=0.0, causal_chunk=chunk
    )
    return transformer.attended_keys(cfg, 64, causal)

  assert keys('cudnn') == 32.5
  assert keys('cudnn', causal=False) == 64
  assert keys('einsum') == 64
  # The einsum kernel's blocks of 24 rows: against 24, 48 and 64 keys.
  assert keys('einsum', chunk=24) == (24 * 24 + 24 * 48 + 16 * 64) / 64


def test_runs_are_timed_in_turn_and_skipped_steps_raise():
  calls = []

  def fake_step(name, skipped=0):
    def call(state, batch):
      calls.append(name)
      return state + 1, {'loss': 0.0, 'skipped_total': skipped}

    return timing.Run(call, 0, None, compile_s=0.0)

  a, b = fake_step('a'), fake_step('b')
  timing.time_in_turn(
    [a, b], steps=3, warmup=1, each_round=lambda: calls.append('probe')
  )
  # Every other round reversed: drift between rounds hits both alike. The
  # CPU's matmul probe runs after each round.
  assert calls == [
    *('a', 'b', 'probe', 'b', 'a', 'probe'),
    *('a', 'b', 'probe', 'b', 'a', 'probe'),
  ]
  assert (a.state, len(a.times), len(b.times)) == (4, 3, 3)
  with pytest.raises(RuntimeError, match='non-finite'):
    timing.time_in_turn([a, fake_step('c', skipped=1)], steps=1, warmup=0)


def test_peer_labels_put_the_masked_ids_at_their_positions():
  batch = {
    'input_ids': np.zeros((2, 6), np.int32),
    # Row 0: two targets and a padding slot pointing at position 0, which
    # is also a real target in row 1.
    'masked_positions': np.array([[3, 1, 0], [0, 5, 0]], np.int32),
    'masked_ids': np.array([[30, 10, 0], [7, 50, 0]], np.int32),
    'masked_weights': np.array([[1, 1, 0], [1, 1, 0]], np.float32),
  }
  labels, weights = peer.labels_from(batch)
  np.testing.assert_array_equal(
    labels, [[0, 10, 0, 30, 0, 0], [7, 0, 0, 0, 0, 50]]
  )
  np.testing.assert_array_equal(
    weights, [[0, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 1]]
  )


def test_peer_is_offered_only_for_bert_masked_lms():
  assert 'encoder config with mlm' in peer.unavailable(load_config('gpt'))
  assert 'differs from BERT' in peer.unavailable(load_config('albert'))
  bert = peer.unavailable(load_config('bert', 'size=base'))
  assert bert == '' or 'make bench' in bert


def run_bench(*args: str) -> dict:
  """`python -m pretrain_lm.bench ARGS` on one CPU device: its JSON line."""
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  out = subprocess.run(
    [sys.executable, '-m', 'pretrain_lm.bench', *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  last = out.stdout.strip().splitlines()[-1]
  return json.loads(last)


def test_bench_train_reports_mfu_against_the_measured_peak(tmp_path):
  r = run_bench(
    '--config=configs/bert.py:size=tiny',
    '--config.model.vocab_size=1024',
    '--config.data.tokenizer_max_docs=500',
    '--steps=2',
    '--warmup=1',
    # On the CPU only when asked: the waited steps agree with it there.
    '--pipelined_steps=2',
    # A quick peak: the survey at base-size matmuls would take longer than
    # the rest of the test.
    '--peak_sizes=256,512',
    f'--profile_dir={tmp_path}',
  )
  assert (r['what'], r['backend'], r['batch_size'], r['seq_len']) == (
    'train',
    'cpu',
    8,
    128,
  )
  assert r['tokens_per_s'] == pytest.approx(
    r['tokens_per_step'] / r['step_s'], rel=1e-6
  )
  assert r['achieved_tflops'] == pytest.approx(
    r['tokens_per_s'] * r['model_flops_per_token'] / 1e12, rel=1e-6
  )
  assert r['peak_source'] == 'xla_matmul'
  # XLA's FLOP count is left out where a loop over microbatches hides it.
  assert (r['xla_flops_per_token'] is None) == (r['microbatches'] > 1)
  if os.path.exists('/proc/cpuinfo'):  # Linux: what the CPU can vectorise
    simd = ('amx_bf16', 'avx512_bf16', 'avx512f', 'avx2', 'avx', 'none')
    assert r['cpu_simd'] in simd
    if r['cpu'] == 'x86_64':  # 'family/model' as cpuinfo numbers them
      assert re.fullmatch(r'\d+/\d+', r['cpu_family']), r['cpu_family']
  assert r['mfu'] == pytest.approx(r['achieved_tflops'] / r['peak_tflops'])
  assert 0 < r['mfu'] < 1.5 and r['compile_s'] > 0
  # Steps dispatched back to back, as the training loop runs them.
  assert r['tokens_per_s_pipelined'] == pytest.approx(
    r['tokens_per_step'] / r['step_s_pipelined'], rel=1e-6
  )
  assert r['mfu_pipelined'] == pytest.approx(
    r['tokens_per_s_pipelined']
    * r['model_flops_per_token']
    / 1e12
    / r['peak_tflops'],
    rel=1e-6,
  )
  assert r['best_matmul_tflops'] >= r['xla_matmul_tflops'] > 0
  # The matmul timed after each round: the MFU against it is of the same
  # step, so within a factor of the machine's drift of the survey's MFU.
  assert r['xla_matmul_tflops_in_turn'] > 0
  assert 0.25 < r['mfu_in_turn'] / r['mfu'] < 4
  # The profile's products, read from the compiled step, are the model
  # FLOPs the formula counts (6N plus attention, the head at the masked
  # positions), every one of them: an independent count of the same sum.
  products = r['profile']['products']
  flops = sum(p['gflop_per_step'] for p in products) * 1e9
  assert flops == pytest.approx(
    r['model_flops_per_token'] * r['tokens_per_step'], rel=0.01
  )
  times = [p['ms_per_step'] for p in products]
  assert times == sorted(times, reverse=True) and times[0] > 0
  for p in products:
    if p['tflops'] is not None:
      assert p['tflops'] == pytest.approx(
        p['gflop_per_step'] / p['ms_per_step'], rel=1e-6
      )
  assert os.path.exists(r['profile']['trace'])
  assert r['profile']['step_s'] > 0 and r['profile']['busy_s']['CPU thunks']
  if r['peer'] == peer.NAME:  # installed by `make test` / `make bench`
    # The peer's head runs at all 128 positions, ours at the masked 20.
    assert r['peer_model_flops_per_token'] > r['model_flops_per_token']
    assert r['speedup_vs_peer'] > 0
    # Both start from BERT's initialisation: loss near ln(vocab).
    assert abs(r['peer_loss'] - r['loss']) < 0.5


def test_bench_pipeline_and_decode():
  r = run_bench(
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
  r = run_bench(
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


def tiny_bert(tokenizer_path, **model):
  """A tiny BERT config on conftest's tokenizer, batch 4, for one device."""
  c = load_config('bert', 'size=tiny')
  c.data.tokenizer, c.model.vocab_size = tokenizer_path, 512
  c.data.batch_size, c.mesh.data = 4, 1
  c.model.update(attention_dropout_rate=0.0, **model)
  step.first_stage(c)
  return c


def test_exported_step_is_the_trainers_step(
  tmp_path, tokenizer_path, monkeypatch
):
  from pretrain_lm.bench import export, run_exported  # noqa: PLC0415

  c = tiny_bert(tokenizer_path, attention_impl='xla')
  # No warmup: the first update is large enough for the second loss to show.
  c.optimizer.warmup_steps, c.optimizer.learning_rate = 0, 1e-3
  # The config's CPU options travel with the step (and its GPU ones stay).
  c.train.compiler_options.cpu = NO_YNNPACK
  c.train.compiler_options.gpu = 'xla_gpu_enable_latency_hiding_scheduler=true'
  *out, batch = export.export_train(
    c, str(tmp_path / 'work'), platform='cpu', mesh=one_device(c)
  )
  export.write(str(tmp_path / 'exported'), *out, batch)
  # Two steps: the second's loss also checks the first step's update.
  compiled = ynnpack_per_compile(monkeypatch)
  r = run_exported.run(
    str(tmp_path / 'exported'),
    steps=2,
    warmup=0,
    profile_dir=str(tmp_path / 'profile'),
  )
  # The init and the step compiled with the config's options.
  options = {'xla_cpu_experimental_ynn_fusion_type': ''}
  assert r['compiler_options'] == options
  # (XLA's check of the options compiles one more, empty, program.)
  assert len(compiled) == 3 and not any(compiled)
  # The Trainer's own two steps on the same batch, from its own init.
  trainer = train.Trainer(c, str(tmp_path / 'ref'), mesh=one_device(c))
  state = trainer.initial_state()
  with trainer.context():
    global_batch = sharding.host_to_global(batch, trainer.mesh)
    state, first = trainer.train_step(state, global_batch)
    _, second = trainer.train_step(state, global_batch)
  assert float(second['loss']) < float(first['loss'])  # the update happened
  assert r['loss'] == pytest.approx(float(second['loss']), rel=1e-6)
  assert r['tokens_per_step'] == 4 * 128
  assert r['model_flops_per_token'] * r['tokens_per_step'] == pytest.approx(
    trainer.model.train_flops(
      trainer.model_config, {k: v.shape for k, v in batch.items()}
    )
  )
  assert r['backend'] == 'cpu' and 'mfu' not in r  # no datasheet CPU peak
  assert r['step_s_pipelined'] > 0
  # The profile's two steps ran XLA's ops on the CPU's thunk threads.
  thunks = r['profile']['timelines']['CPU thunks']
  assert r['profile']['steps'] == 2 and thunks['busy_ms'] > 0
  assert sum(thunks['ops'].values()) == pytest.approx(thunks['busy_ms'])
  assert any('fusion' in op for op in thunks['ops'])
  # Its products (all Eigen dots here, YNNPACK being off) are the model's.
  products = r['profile']['products']
  flops = sum(p['gflop_per_step'] for p in products) * 1e9
  assert flops == pytest.approx(
    r['model_flops_per_token'] * r['tokens_per_step'], rel=0.01
  )
  # Compiling from the shapes alone gives the same program's memory.
  c = run_exported.compile_only(str(tmp_path / 'exported'))
  assert c['memory_gib'] == pytest.approx(r['memory_gib'])
  assert c['compile_s'] > 0 and c['init_compile_s'] > 0
  assert c['compiler_options'] == options
  assert compiled[-2:] == [False, False]
  # A manifest without options (as written before they were recorded)
  # gets XLA's defaults, whose step uses YNNPACK.
  shutil.copytree(tmp_path / 'exported', tmp_path / 'old')
  manifest = json.loads((tmp_path / 'old' / 'manifest.json').read_text())
  del manifest['compiler_options']
  (tmp_path / 'old' / 'manifest.json').write_text(json.dumps(manifest))
  assert (
    run_exported.compile_only(str(tmp_path / 'old'))['compiler_options'] == {}
  )
  assert compiled[-1]
  # An option XLA does not know fails naming the file and the option.
  manifest['compiler_options'] = {'xla_no_such_option': 1}
  (tmp_path / 'old' / 'manifest.json').write_text(json.dumps(manifest))
  with pytest.raises(ValueError, match='old/manifest.json.*xla_no_such_opt'):
    run_exported.compile_only(str(tmp_path / 'old'))


def test_export_lowers_cudnn_attention_off_a_gpu(tmp_path, tokenizer_path):
  from pretrain_lm.bench import export  # noqa: PLC0415

  c = tiny_bert(tokenizer_path, attention_impl='cudnn', dtype='bfloat16')
  c.train.compiler_options.cpu = NO_YNNPACK
  c.train.compiler_options.gpu = 'xla_gpu_enable_latency_hiding_scheduler=true'
  # Lowered on CPUs, for a GPU: the CPU's microbatches stay out of it.
  c.train.cpu_microbatch_tokens = 1
  manifest, _, exported, _ = export.export_train(
    c, str(tmp_path / 'work'), platform='cuda', mesh=one_device(c)
  )
  text = jax.export.deserialize(bytearray(exported)).mlir_module()
  assert '__cudnn$fmha' in text  # the fused kernel, forward and backward
  assert 'Backward' in text
  assert 'stablehlo.while' not in text
  assert manifest['config']['train']['cpu_microbatch_tokens'] == 0
  # A cuda step carries the config's gpu options, not its cpu ones.
  assert manifest['compiler_options'] == {
    'xla_gpu_enable_latency_hiding_scheduler': True
  }
  assert c.train.cpu_microbatch_tokens == 1  # the caller's config untouched
  c.model.attention_impl = 'auto'
  with pytest.raises(ValueError, match="attention_impl='auto'"):
    export.export_train(c, str(tmp_path / 'auto'), platform='cuda')


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
  # run_exported and --what=decode run on accelerator machines that have
  # JAX but not the input stack (experiments/benchmarks/gpu/).
  tf = ('tensorflow', 'tensorflow_text', 'tensorflow_datasets')
  imports_without(
    (*tf, 'ml_collections', 'flax', 'optax', 'orbax'),
    'pretrain_lm.bench.run_exported',
  )
  imports_without(tf, 'pretrain_lm.bench.decode, pretrain_lm.bench.__main__')


def test_profile_sums_device_streams_and_names_their_sources(tmp_path):
  # A GPU trace's shape (what jax.profiler writes there), built by hand:
  # kernels on two streams, host events that are not the device's.
  from pretrain_lm.bench import profile  # noqa: PLC0415

  def meta(pid, tid, kind, name):
    return dict(ph='M', pid=pid, tid=tid, name=kind, args={'name': name})

  def op(pid, tid, name, dur):
    return dict(ph='X', pid=pid, tid=tid, name=name, ts=0, dur=dur)

  events = [
    meta(1, 0, 'process_name', '/device:GPU:0'),
    meta(1, 7, 'thread_name', 'Stream #7(Compute)'),
    meta(1, 9, 'thread_name', 'Stream #9(MemcpyD2H)'),
    meta(1, 2, 'thread_name', 'XLA Ops'),
    meta(2, 0, 'process_name', '/host:CPU'),
    meta(2, 3, 'thread_name', 'python'),
    op(1, 7, 'loop_add_fusion_3', 3000),
    op(1, 7, 'nvjet_sm90_gemm', 5000),
    op(1, 7, 'loop_add_fusion_3', 1000),
    op(1, 9, 'memcpy', 500),
    op(1, 2, 'add_fusion.3', 4000),
    op(1, 2, 'add_fusion.4', 1000),
    op(2, 3, 'PjitFunction(step)', 20000),
  ]
  path = tmp_path / 'x.trace.json.gz'
  with gzip.open(path, 'wt') as f:
    json.dump({'traceEvents': events}, f)
  s = profile.summarize(str(path))
  streams, ops = s['timelines']['Stream'], s['timelines']['XLA Ops']
  assert set(s['timelines']) == {'Stream', 'XLA Ops'}  # no host events
  assert streams['busy_ms'] == pytest.approx(9.5)
  assert streams['ops'] == {
    'nvjet_sm90_gemm': 5.0,
    'loop_add_fusion_3': 4.0,
    'memcpy': 0.5,
  }
  # Numbered clones of one op add up, and say they were merged.
  assert ops['ops'] == {'add_fusion': 5.0} and ops['merged'] == {
    'add_fusion': 2
  }
  hlo = (
    '  %loop_add_fusion.3 = bf16[8,16]{1,0} fusion(%p0, %p1), kind=kLoop, '
    'calls=%fused_add, metadata={op_name="jit(step)/jit(train_step)/'
    'encoder/add" source_file="x.py" source_line=3}\n'
    '  ROOT %custom-call.1 = f32[4]{0} custom-call(%p2), '
    'custom_call_target="__cublas$gemm"\n'
    '  %add.2 = f32[4]{0} add(%a, %b)\n'
  )
  sources = profile.hlo_sources(hlo)
  assert sources == {
    'loop_add_fusion_3': 'bf16[8,16]{1,0} encoder/add',
    'custom_call_1': 'f32[4]{0} ',
  }
  text = profile.format_summary(
    {**s, 'wall_s': 0.02, 'steps': 2}, sources=sources
  )
  assert '== Stream: 9.5 ms busy in 4 events, 48% of the wall time' in text
  assert '<- bf16[8,16]{1,0} encoder/add' in text


def test_products_are_counted_per_form_and_run(tmp_path):
  # An optimized CPU module's shape, by hand: a loop body (two
  # microbatches) with a fused x . W^T, a fused batched product and an
  # Eigen dot (whose thunk returns before its product is done).
  from pretrain_lm.bench import profile  # noqa: PLC0415

  hlo = '\n'.join(
    [
      '%fused_logits (p0: f32[16,8], p1: f32[32,8]) -> f32[16,32] {',
      '  %p0 = f32[16,8]{1,0} parameter(0)',
      '  %p1 = f32[32,8]{1,0} parameter(1)',
      '  ROOT %dot.1 = f32[16,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1},'
      ' rhs_contracting_dims={1}',
      '}',
      '%fused_scores (p0: f32[2,3,4,5], p1: f32[2,3,5,6]) -> f32[2,3,4,6] {',
      '  %p0.1 = f32[2,3,4,5]{3,2,1,0} parameter(0)',
      '  %p1.1 = f32[2,3,5,6]{3,2,1,0} parameter(1)',
      '  ROOT %dot.2 = f32[2,3,4,6]{3,2,1,0} dot(%p0.1, %p1.1),'
      ' lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1},'
      ' rhs_contracting_dims={2}',
      '}',
      '%body (arg: (f32[16,8], f32[32,8])) -> (f32[16,8], f32[32,8]) {',
      '  %x = f32[16,8]{1,0} parameter(0)',
      '  %w = f32[32,8]{1,0} parameter(1)',
      '  %ynn_fusion.1 = f32[16,32]{1,0} fusion(%x, %w), kind=kCustom,'
      ' calls=%fused_logits',
      '  %ynn_fusion.2 = f32[2,3,4,6]{3,2,1,0} fusion(%a, %b), kind=kCustom,'
      ' calls=%fused_scores',
      '  %dot.3 = f32[32,8]{1,0} dot(%ynn_fusion.1, %x),'
      ' lhs_contracting_dims={0}, rhs_contracting_dims={0}',
      '  %add_fusion = f32[16,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_add',
      '}',
    ]
  )
  found = profile.products(hlo)
  assert found == {
    'ynn_fusion.1': {
      'flops': 2 * 16 * 32 * 8,
      'form': 'f32[16,{8}] x f32[32,{8}] -> f32[16,32]',
      'fused': True,
    },
    'ynn_fusion.2': {
      'flops': 2 * (2 * 3 * 4 * 6) * 5,
      'form': 'f32[2,3,4,{5}] x f32[2,3,{5},6] -> f32[2,3,4,6]',
      'fused': True,
    },
    'dot.3': {
      'flops': 2 * 32 * 8 * 16,
      'form': 'f32[{16},32] x f32[{16},8] -> f32[32,8]',
      'fused': False,
    },
  }
  thunks = [
    dict(ph='M', pid=1, tid=0, name='process_name', args={'name': '/host:CPU'}),
    dict(
      ph='M', pid=1, tid=5, name='thread_name', args={'name': 'tf_XLAEigen'}
    ),
  ]
  for name, dur_us in [
    ('ynn_fusion.1', 300),
    ('ynn_fusion.1', 100),  # the second microbatch
    ('ynn_fusion.2', 50),
    ('dot.3', 1),
    ('dot.3', 1),
    ('add_fusion', 70),
  ]:
    thunks.append(dict(ph='X', pid=1, tid=5, name=name, ts=0, dur=dur_us))
  path = tmp_path / 'x.trace.json.gz'
  with gzip.open(path, 'wt') as f:
    json.dump({'traceEvents': thunks}, f)
  rows = profile.product_rates(str(path), hlo, steps=1)
  assert [r['form'] for r in rows] == [
    'f32[16,{8}] x f32[32,{8}] -> f32[16,32]',
    'f32[2,3,4,{5}] x f32[2,3,{5},6] -> f32[2,3,4,6]',
    'Eigen dots (not timed)',
  ]
  logits, scores, eigen = rows
  assert logits['ms_per_step'] == pytest.approx(0.4)
  assert logits['gflop_per_step'] == pytest.approx(2 * 2 * 16 * 32 * 8 / 1e9)
  assert logits['tflops'] == pytest.approx(2 * 2 * 16 * 32 * 8 / 0.4e-3 / 1e12)
  assert scores['count'] == 1 and scores['gflop_per_step'] == pytest.approx(
    2 * 144 * 5 / 1e9
  )
  assert eigen['tflops'] is None and eigen['gflop_per_step'] == pytest.approx(
    2 * 2 * 32 * 8 * 16 / 1e9
  )
  text = profile.format_products(rows)
  assert text.splitlines()[0].startswith('== products: 0.5 ms/step for')
  assert 'Eigen dots (not timed)' in text


def test_cpu_peak_is_the_faster_of_xla_defaults_and_the_steps_options(
  monkeypatch,
):
  # A config that turns YNNPACK off (train.compiler_options.cpu) times its
  # step without it: the peak its MFU divides by must not fall with it.
  calls = []

  def fake(dtype, sizes=peak.SIZES, repeats=peak.REPEATS, **kw):
    calls.append(kw.get('compiler_options'))
    return 2e11 if kw.get('compiler_options') else 1e11

  monkeypatch.setattr(peak, 'xla_matmul_flops', fake)
  monkeypatch.setattr(peak, 'numpy_matmul_flops', lambda *a, **k: 0.0)
  monkeypatch.setattr(peak, 'torch_matmul_flops', lambda *a, **k: 0.0)
  options = {'xla_cpu_experimental_ynn_fusion_type': ''}
  assert peak.peaks('float32', compiler_options=options)['peak_tflops'] == 0.2
  assert calls == [None, options]
  calls.clear()
  assert peak.peaks('float32')['peak_tflops'] == 0.1 and calls == [None]


def ynnpack_per_compile(monkeypatch) -> list[bool]:
  """Whether each program compiled from here on uses YNNPACK, in order."""
  compiled = []
  lower = jax.stages.Lowered.compile

  def spy(self, compiler_options=None):
    out = lower(self, compiler_options)
    compiled.append(uses_ynnpack(out))
    return out

  monkeypatch.setattr(jax.stages.Lowered, 'compile', spy)
  return compiled


def test_mfu_in_turn_divides_each_round_by_its_own_matmul():
  # Round 2 runs on a machine at half speed: the step takes twice as long
  # and the matmul after it reaches half the FLOP/s. Against the one peak
  # timed before the steps (1e12), the median step (1.5 s) reads 0.8 x
  # 2/3; round by round the ratio is 0.8 both times.
  step_flops = 0.8e12
  figures = peak.in_turn_figures(
    step_times=[1.0, 2.0],
    probe_flops=[0.7e12, 1e12, 0.5e12],  # the first: a warm-up round
    step_flops=step_flops,
  )
  assert figures['mfu_in_turn'] == pytest.approx(0.8)
  assert figures['xla_matmul_tflops_in_turn'] == pytest.approx(0.75)
  with pytest.raises(ValueError, match='2 matmul timings for 3 timed'):
    peak.in_turn_figures([1.0, 2.0, 3.0], [1e12, 1e12], step_flops)


def test_in_turn_matmul_times_xla_defaults_and_the_steps_options(
  monkeypatch,
):
  compiled = ynnpack_per_compile(monkeypatch)
  options = configlib.parse_compiler_options(NO_YNNPACK, 'test')
  probe = peak.InTurnMatmul('float32', 128, options)
  assert compiled == [True, False]
  probe()
  probe()
  assert len(probe.flops) == 2 and min(probe.flops) > 0
  assert peak.in_turn_size((1024, 2048, 4096)) == 2048
  assert peak.in_turn_size((256, 512)) == 512


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_the_peak_matmul_accumulates_as_the_model_does(dtype):
  # A bfloat16 model's products take bfloat16 operands and accumulate in
  # float32 (layers.matmul_f32_acc); the peak's matmul must do the same.
  a, b = peak.matmul_operands(dtype, 64)
  out = peak.compiled_matmul(a, b)(a, b)
  assert out.dtype == np.float32
  want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_xla_matmul_is_compiled_with_the_options_it_is_given(monkeypatch):
  compiled = ynnpack_per_compile(monkeypatch)
  options = configlib.parse_compiler_options(NO_YNNPACK, 'test')
  assert peak.xla_matmul_flops('float32', (128,), 1) > 0
  assert peak.xla_matmul_flops('float32', (128,), 1, options) > 0
  assert compiled == [True, False]


def test_experiment_scripts_name_only_what_the_package_has():
  # The scripts in experiments/ have no tests of their own and read (and
  # patch: ab_step.py) the package's functions by name. A renamed function
  # breaks them at run time, or, for a patch, silently: this reads every
  # `module.name` they use off the imported modules.
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
