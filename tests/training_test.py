"""The loop's pieces that need no model: speeds and the skip guard."""

import types

import pytest

from pretrain_lm.training import loop


def test_throughput_logs_the_same_speeds_for_every_job(monkeypatch):
  clock = iter([0.0, 1.0, 3.0])
  monkeypatch.setattr(loop.time, 'perf_counter', lambda: next(clock))
  monkeypatch.setattr(loop.jax, 'device_count', lambda: 2)
  cost = loop.StepCost(tokens=100, flops=1e12, examples=4)
  perf = loop.Throughput(cost, peak_flops_per_device=1e12)
  # Each metric over the steps that report it; skipped_total is a count.
  window = [
    {'loss': 1.0, 'skipped_total': 0},
    {'loss': 3.0, 'aux_loss': 5.0, 'skipped_total': 1},
  ]
  first = perf.summarize(window, step=2)
  assert first == {'loss': 2.0, 'aux_loss': 5.0, 'skipped_total': 1.0}
  # From the second log on (the first includes compiling): 4 steps in 2 s.
  second = perf.summarize([{'loss': 1.0}], step=6)
  assert second['tokens_per_s'] == pytest.approx(200.0)
  assert second['examples_per_s'] == pytest.approx(8.0)
  assert second['model_tflops_per_s'] == pytest.approx(2.0)
  assert second['mfu'] == pytest.approx(1.0)


def test_throughput_without_flops_or_examples_logs_tokens_only(monkeypatch):
  clock = iter([0.0, 1.0, 2.0])
  monkeypatch.setattr(loop.time, 'perf_counter', lambda: next(clock))
  perf = loop.Throughput(loop.StepCost(tokens=10, flops=None), None)
  perf.summarize([{'loss': 1.0}], step=1)
  assert set(perf.summarize([{'loss': 1.0}], step=2)) == {
    'loss',
    'tokens_per_s',
  }


def test_skip_guard_counts_consecutive_skips_and_says_each():
  said = []
  writer = types.SimpleNamespace(print=said.append)
  guard = loop.SkipGuard(limit=2, writer=writer)
  guard.observe(1, {'skipped': 1})
  assert guard.near_limit and not guard.exhausted
  guard.observe(2, {'skipped': 0})  # a good step resets the count
  assert guard.consecutive == 0
  guard.observe(3, {'skipped': 1})
  guard.observe(4, {'skipped': 1})
  assert guard.exhausted
  assert said[-1] == (
    'Step 4: non-finite loss or gradient; update skipped (2 in a row).'
  )
  never = loop.SkipGuard(limit=0, writer=writer)
  for step in range(5):
    never.observe(step, {'skipped': 1})
  assert not never.near_limit and not never.exhausted
