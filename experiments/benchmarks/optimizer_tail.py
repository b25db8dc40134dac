r"""The optimizer's passes over the parameters, timed apart from the step.

  python experiments/benchmarks/optimizer_tail.py \
      --config=configs/bert.py:size=base --rounds=12

Times what train_step does after the gradients (train.apply_gradients:
the gradients' norm, clipping, AdamW, the non-finite check, the select)
on the preset's own parameters and Adam state, with random gradients,
against AdamW written out by hand, in alternating order in one process.
Every variant keeps optax's state layout and is checked against
train.apply_gradients before the timing (the largest difference, which
must be float rounding). Variants:

- `optax`: train.apply_gradients, the code as it is: optax's chain, then
  the update's norm (step_is_finite), then the select;
- `adamw`: clipping and AdamW written out as one function per array (its
  moments, its update), the same checks and select after it;
- `recompute`: as `adamw`, but the update's norm comes from a pass that
  writes nothing, and a second pass recomputes each update and writes
  the selected params and moments (behind an optimization barrier, so
  XLA cannot reuse the first pass's arrays);
- `grads_only`: as `adamw`, in one pass per array, with the step's
  finiteness from the loss and the gradients' norm only. The floor of a
  fused update; it drops step_is_finite's check of the update, so it is
  not the same step.

Only `optimizer.name=adamw` with `grad_clip_norm > 0` (the presets'
chain) is written out.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from optax import tree_utils as otu  # noqa: E402

from pretrain_lm import configlib, train  # noqa: E402
from pretrain_lm.bench import step, timing  # noqa: E402


def variants(opt, schedule) -> dict:
  """name -> f(tx, params, opt_state, grads, loss), train.apply_gradients'
  signature and results, for `opt` (a config's optimizer field)."""
  if opt.name != 'adamw' or not opt.grad_clip_norm:
    raise ValueError(
      f'optimizer.name={opt.name!r}, grad_clip_norm={opt.grad_clip_norm}: '
      'only adamw with clipping is written out here.'
    )
  b1, b2, eps, decay, clip = (
    opt.b1,
    opt.b2,
    opt.eps,
    opt.weight_decay,
    opt.grad_clip_norm,
  )

  def scalars(opt_state, grads):
    """(grad_norm, count, new_count, update's scalar arguments)."""
    grad_norm = optax.global_norm(grads)
    # optax.clip_by_global_norm's scale, and AdamW's step count (its bias
    # corrections) and learning rate (the schedule at the count before).
    # Adam's count and the schedule's both count applied updates.
    scale = jnp.where(grad_norm < clip, 1.0, clip / grad_norm)
    count = otu.tree_get_all_with_path(opt_state, 'count')[0][1]
    new_count = optax.safe_increment(count)
    t = new_count.astype(jnp.float32)
    args = (scale, 1 - b1**t, 1 - b2**t, schedule(count))
    return grad_norm, count, new_count, args

  def update(p, g, mu, nu, scale, c1, c2, lr):
    g = g * scale
    mu = (1 - b1) * g + b1 * mu
    nu = (1 - b2) * g * g + b2 * nu
    u = (mu / c1) / (jnp.sqrt(nu / c2) + eps)
    if p.ndim > 1:  # train._decay_mask: matrices only
      u = u + decay * p
    return -lr * u, mu, nu

  def per_array(fn, params, opt_state, grads):
    """fn(p, g, mu, nu) over the arrays; tuples it returns come back as
    one tree per entry."""
    mu, nu = otu.tree_get(opt_state, 'mu'), otu.tree_get(opt_state, 'nu')
    out = jax.tree.map(fn, params, grads, mu, nu)
    is_tuple = lambda x: isinstance(x, tuple)
    first = jax.tree.leaves(out, is_leaf=is_tuple)[0]
    if not is_tuple(first):
      return out
    return [
      jax.tree.map(lambda t, i=i: t[i], out, is_leaf=is_tuple)
      for i in range(len(first))
    ]

  def adamw(tx, params, opt_state, grads, loss):
    del tx
    grad_norm, _, new_count, args = scalars(opt_state, grads)
    updates, mu, nu = per_array(
      lambda p, g, m, v: update(p, g, m, v, *args), params, opt_state, grads
    )
    finite = train.step_is_finite(loss, grad_norm, updates)
    new = (
      jax.tree.map(jnp.add, params, updates),
      otu.tree_set(opt_state, mu=mu, nu=nu, count=new_count),
    )
    new_params, new_state = jax.tree.map(
      lambda n, o: jnp.where(finite, n, o), new, (params, opt_state)
    )
    return new_params, new_state, finite, grad_norm

  def one_pass(params, opt_state, grads, finite, count, new_count, args):
    """The selected params and state, written in one pass per array."""

    def write(p, g, m, v):
      u, m2, v2 = update(p, g, m, v, *args)
      return (
        jnp.where(finite, p + u, p),
        jnp.where(finite, m2, m),
        jnp.where(finite, v2, v),
      )

    new_params, mu, nu = per_array(write, params, opt_state, grads)
    count = jnp.where(finite, new_count, count)
    return new_params, otu.tree_set(opt_state, mu=mu, nu=nu, count=count)

  def recompute(tx, params, opt_state, grads, loss):
    del tx
    grad_norm, count, new_count, args = scalars(opt_state, grads)
    squares = per_array(
      lambda p, g, m, v: jnp.sum(jnp.square(update(p, g, m, v, *args)[0])),
      params,
      opt_state,
      grads,
    )
    finite = (
      jnp.isfinite(loss)
      & jnp.isfinite(grad_norm)
      & jnp.isfinite(sum(jax.tree.leaves(squares)))
    )
    params, opt_state, grads, finite = jax.lax.optimization_barrier(
      (params, opt_state, grads, finite)
    )
    new = one_pass(params, opt_state, grads, finite, count, new_count, args)
    return *new, finite, grad_norm

  def grads_only(tx, params, opt_state, grads, loss):
    del tx
    grad_norm, count, new_count, args = scalars(opt_state, grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new = one_pass(params, opt_state, grads, finite, count, new_count, args)
    return *new, finite, grad_norm

  return {
    'optax': train.apply_gradients,
    'adamw': adamw,
    'recompute': recompute,
    'grads_only': grads_only,
  }


def largest_difference(a, b) -> float:
  """The largest |a - b| over two trees of the same structure."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    raise AssertionError(
      f'structures differ: {jax.tree.structure(a)} vs {jax.tree.structure(b)}'
    )
  return max(
    float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--config', default='configs/bert.py:size=base')
  p.add_argument('--rounds', type=int, default=12)
  p.add_argument('--variants', default='optax,adamw,recompute,grads_only')
  args = p.parse_args()
  config = configlib.load_file(args.config)
  config.data.batch_size = 8  # the state only: no step is compiled
  step.first_stage(config)
  workdir = tempfile.mkdtemp(prefix='optimizer_tail_')
  try:
    trainer = train.Trainer(config, workdir)
    state = trainer.initial_state()
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  tx, schedule = trainer.tx, trainer.schedule
  found = variants(config.optimizer, schedule)
  names = args.variants.split(',')
  unknown = sorted(set(names) - set(found))
  if unknown:
    p.error(f'--variants: unknown {unknown}; valid: {sorted(found)}')
  # Past the warmup, so the learning rate and the updates are not zero.
  params = state.params
  opt_state = otu.tree_set(
    state.opt_state, count=jnp.int32(config.optimizer.warmup_steps + 1)
  )
  grads = jax.tree.map(
    lambda x: 1e-3 * jax.random.normal(jax.random.key(1), x.shape, x.dtype),
    params,
  )
  loss = jnp.float32(1.0)
  reference = jax.jit(train.apply_gradients, static_argnums=0)(
    tx, params, opt_state, grads, loss
  )[:2]
  runs = []
  for name in names:
    # Each variant updates its own copy of the state, which it donates; the
    # gradients stand in for the batch.
    step_fn = jax.jit(
      lambda state, grads, f=found[name]: as_step(f(tx, *state, grads, loss)),
      donate_argnums=0,
    )
    run = timing.compile_run(step_fn, reference, grads)
    fresh = jax.tree.map(jnp.copy, (params, opt_state))
    run.state, run.metrics = run.step(fresh, grads)
    print(
      f'{name:>10}: largest difference from optax '
      f'{largest_difference(run.state, reference):.2e}'
    )
    run.state = jax.tree.map(jnp.copy, (params, opt_state))
    runs.append(run)
  del reference, params, opt_state, state
  # time_in_turn raises if the last round's update was skipped (as an
  # update with the same gradients and a finite state, every round's is).
  timing.time_in_turn(runs, steps=args.rounds, warmup=1)
  print(f'{args.config}, {args.rounds} rounds')
  for name, run in zip(names, runs, strict=True):
    ratios = [t / b for t, b in zip(run.times, runs[0].times, strict=True)]
    print(
      f'{name:>10}: median {1e3 * statistics.median(run.times):.0f} ms, '
      f'median ratio to {names[0]} {statistics.median(ratios):.3f}, '
      f'faster in {sum(x < 1 for x in ratios)}/{len(ratios)} rounds'
    )


def as_step(result):
  """A variant's result as a step's (state, metrics)."""
  params, opt_state, finite, _ = result
  return (params, opt_state), {'skipped_total': (~finite).astype(jnp.int32)}


if __name__ == '__main__':
  sys.exit(main())
