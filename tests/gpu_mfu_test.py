"""experiments/benchmarks/gpu/mfu.py: the GPU table's plan, its profile
groups, and its whole loop (export, compile, time, profile, table) on the
CPU standing in for the GPU."""

import argparse
import json
import os
import subprocess
import sys

import pytest
from conftest import COMPILE_FLAGS, REPO

from pretrain_lm import validate

GPU_DIR = os.path.join(REPO, 'experiments', 'benchmarks', 'gpu')
sys.path.insert(0, GPU_DIR)
import mfu  # noqa: E402
import trace_summary  # noqa: E402


def test_plan_times_before_and_after_first_then_each_lever_taken_out():
  steps = mfu.plan()
  first = [s for s in steps if s.profiled]
  assert steps[: len(first)] == first  # the table's rows before any A/B
  assert {(s.row, s.variant) for s in first} == {
    (r, v) for r in mfu.ROWS for v in ('before', 'after')
  }
  for name, row in mfu.ROWS.items():
    of_row = {s.variant: s for s in steps if s.row == name}
    assert of_row['before'].levers == ()
    assert set(of_row['after'].levers) == set(row.levers)
    for lever in row.levers:
      rest = set(of_row[f'without_{lever}'].levers)
      assert rest == set(row.levers) - {lever}
    for k in row.larger:
      assert of_row[f'batch_x{k}'].batch == k * row.batch
      assert of_row[f'batch_x{k}'].levers == of_row['after'].levers
    for option in mfu.XLA_LEVERS:
      step = of_row[f'xla_{option}']
      # The same exported program as after, under one more XLA option.
      assert step.export == of_row['after'].export and step.xla == option
  assert [s.variant for s in mfu.plan(['t5_base'], ['after'])] == ['after']


def test_every_step_of_the_plan_is_a_valid_config_with_its_levers_set():
  for step in mfu.plan():
    config = mfu.step_config(step)
    validate.check_fields(config)
    assert config.data.batch_size == step.batch
    assert config.model.attention_impl == 'cudnn'
    for lever in step.levers:
      for name, value in mfu.LEVERS[lever].items():
        section, field = name.split('.')
        assert config[section][field] == value
    base = mfu.step_config(mfu.Step(step.row, 'before', (), step.batch))
    changed = {
      f'{s}.{f}'
      for s in ('model', 'train', 'objective')
      for f in config[s]
      if config[s][f] != base[s][f]
    }
    assert changed == {n for lever in step.levers for n in mfu.LEVERS[lever]}


def test_the_xla_options_are_known_to_xla():
  # XLA aborts on an option it does not know: a typo here would cost a
  # GPU run its A/B steps.
  env = dict(os.environ, XLA_FLAGS=' '.join(mfu.XLA_LEVERS.values()))
  out = subprocess.run(
    [sys.executable, '-c', 'import jax; jax.numpy.ones(1).block_until_ready()'],
    env=env,
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stderr[-1000:]


def test_h200_kernels_fall_into_their_groups():
  named = {
    'nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN': 'gemm',
    'gemm_fusion_dot_99': 'gemm',
    'void cublasLt::splitKreduce_kernel<32, 16, int, float>': 'gemm',
    'cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26': (
      'attention'
    ),
    'void cudnn::fusion::fmha_dbias<true>(void const*)': 'attention',
    'void cudnn::fusion::matmul_dq<true, 64>(void const*)': 'attention',
    'loop_convert_multiply_fusion_11': 'fusions',
    'input_add_reduce_fusion_10': 'fusions',
    'fusion_9489': 'fusions',
    'input_scatter_fusion_1': 'fusions',
    'memcpy128': 'copies',
    'Memset': 'copies',
    'input_concatenate_fusion_10': 'copies',
    'wrapped_transpose_1': 'copies',
    'loop_dynamic_update_slice_fusion_2': 'copies',
    'ncclDevKernel_AllReduce_Sum_f32_RING_LL': 'collectives',
    'all-reduce-start.1': 'collectives',
  }
  for name, group in named.items():
    assert trace_summary.op_group(name) == group, name
  # Every kernel of the H200 profiles on record has a group.
  with open(os.path.join(GPU_DIR, 'h200.jsonl')) as f:
    profiles = [r['profile'] for r in map(json.loads, f) if 'profile' in r]
  assert profiles
  for p in profiles:
    for op in p['timelines']['Stream']['ops']:
      assert trace_summary.op_group(op) != 'other', op


def test_groups_and_idle_add_up_to_the_wall_time():
  summary = {
    'steps': 2,
    'wall_s': 0.010,
    'timelines': {
      'Stream': {
        'busy_ms': 16.0,
        'ops': {
          'nvjet_a': 8.0,
          'cudnn_sdpa_fprop': 4.0,
          'loop_add_fusion': 4.0,
        },
      },
      'XLA Ops': {'busy_ms': 16.0, 'ops': {'fusion.1': 16.0}},
    },
  }
  g = trace_summary.group_times(summary)
  assert g['wall_ms'] == pytest.approx(5.0)
  assert g['ms']['gemm'] == pytest.approx(4.0)
  assert g['ms']['attention'] == pytest.approx(2.0)
  assert g['ms']['fusions'] == pytest.approx(2.0)  # 'XLA Ops' not counted
  assert g['ms']['idle'] == pytest.approx(0.0)
  summary['wall_s'] = 0.020
  g = trace_summary.group_times(summary)
  assert g['ms']['idle'] == pytest.approx(2.0)
  assert sum(g['shares'].values()) == pytest.approx(1.0)


def test_steps_not_started_by_the_deadline_are_listed_as_skipped(tmp_path):
  args = argparse.Namespace(out=str(tmp_path), budget_s=0, dir=str(tmp_path))
  steps = mfu.plan(['bert_base'])
  results = mfu.Runner(args).time_all(steps)  # starts no process
  assert [(r['row'], r['variant']) for r in results] == [
    (s.row, s.variant) for s in steps
  ]
  assert {r['skipped'] for r in results} == {'deadline'}
  table = mfu.tables(results)
  assert '| bert_base | without_rbg | deadline |' in table


def _mfu(*args, env=None):
  return subprocess.run(
    [sys.executable, os.path.join(GPU_DIR, 'mfu.py'), *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    env=env,
  )


def test_export_run_and_table_on_the_cpu(tmp_path):
  export_dir, out = tmp_path / 'export', tmp_path / 'out'
  common = [
    f'--dir={export_dir}',
    '--rows=bert_base',
    '--variants=after,xla_cublaslt',
  ]
  # One CPU device stands in for the GPU, at the suite's compile flags.
  env = dict(os.environ, XLA_FLAGS=COMPILE_FLAGS)
  env['JAX_COMPILATION_CACHE_DIR'] = str(tmp_path / 'cache')
  made = _mfu(
    'export',
    *common,
    '--platform=cpu',
    '--attention=einsum',
    '--size=tiny',
    '--batch=8',
    env=env,
  )
  assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
  assert os.listdir(export_dir) == ['bert_base.after']
  ran = _mfu(
    'run',
    *common,
    f'--out={out}',
    f'--profile_dir={tmp_path / "profile"}',
    '--allow_cpu',
    '--jobs=2',
    '--steps=2',
    '--ab_steps=1',
    '--warmup=1',
    env=env,
  )
  assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
  with open(out / 'gpu.jsonl') as f:
    lines = {r['variant']: r for r in map(json.loads, f)}
  assert set(lines) == {'after', 'xla_cublaslt'}
  after = lines['after']
  assert after['levers'] == list(mfu.ROWS['bert_base'].levers)
  assert after['prng_impl'] == 'unsafe_rbg' and after['batch_size'] == 8
  assert lines['xla_cublaslt']['xla_flags'].endswith(mfu.XLA_LEVERS['cublaslt'])
  g = after['profile_groups']
  assert g['ms']['gemm'] > 0 and g['ms']['fusions'] > 0 and g['wall_ms'] > 0
  assert 'profile_groups' not in lines['xla_cublaslt']
  with open(out / 'compile.jsonl') as f:
    assert len(f.readlines()) == 2  # after, and after under cublaslt
  assert '| bert_base | after | 8 |' in ran.stdout
  assert '| bert_base | xla_cublaslt |' in ran.stdout
  # An export directory that lacks a step of the plan is named.
  with pytest.raises(SystemExit, match=r"lacks \[.*'gpt2_small\.before'"):
    mfu.main(['run', f'--dir={export_dir}', f'--out={out}', '--allow_cpu'])
