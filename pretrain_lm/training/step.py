"""The pure train and eval steps, jitted into the state's shardings."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import linen as nn
from jax.extend import random as jax_prng

from pretrain_lm import configlib, sharding, validate
from pretrain_lm.training.state import TrainState

# train.prng_impl's XLA RngBitGenerator choices, by name ('threefry' is the
# state's own key, used as it is).
RBG_IMPLS = {
  'rbg': jax_prng.rbg_prng_impl,
  'unsafe_rbg': jax_prng.unsafe_rbg_prng_impl,
}


def check_prng_impl(prng_impl: str) -> str:
  """train.prng_impl, or a ValueError naming the field and its choices."""
  if prng_impl not in configlib.PRNG_IMPLS:
    raise ValueError(
      f'train.prng_impl={prng_impl!r}; expected one of {configlib.PRNG_IMPLS}.'
    )
  return prng_impl


def dropout_key(rng, step, prng_impl: str = 'threefry') -> jax.Array:
  """The key that draws step `step`'s dropout masks (train.prng_impl).

  `rng` is the state's raw key data, folded with the step, so the masks
  are a function of (seed, step) alone and a resumed run draws those an
  uninterrupted one would. 'threefry' hands that key to the model as it
  is. 'rbg' and 'unsafe_rbg' fill their own key's data (uint32[4]) with
  that key's random bits: still a function of (seed, step), and the state
  keeps its threefry key, so a checkpoint resumes under any choice. Their
  masks are not threefry's, nor the same bits on every backend; and
  unsafe_rbg's split and fold_in (per microbatch here, per dropout layer
  in Flax) trade threefry's guarantees for speed (jax.random's docs).
  """
  key = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
  if check_prng_impl(prng_impl) == 'threefry':
    return key
  impl = RBG_IMPLS[prng_impl]
  data = jax.random.bits(key, impl.key_shape, jnp.uint32)
  return jax.random.wrap_key_data(data, impl=impl)


def step_is_finite(loss, grad_norm, updates) -> jax.Array:
  """Whether a step's loss, gradients and update are all finite.

  The update's norm catches what the gradients' cannot: a NaN learning
  rate, Adam's eps = 0 over a zero second moment, and finite updates so
  large that their squares overflow (a learning rate of 1e30, which would
  leave finite but ruined weights). It costs a pass over every parameter
  before the select; dropping it saved little, and not on every model
  (experiments/benchmarks/README.md, Levers tried).
  """
  return (
    jnp.isfinite(loss)
    & jnp.isfinite(grad_norm)
    & jnp.isfinite(optax.global_norm(updates))
  )


def apply_gradients(tx, params, opt_state, grads, loss):
  """The optimizer's update, kept only if the step is finite.

  Returns (params, opt_state, finite, grad_norm). A NaN/Inf (an overflow,
  a corrupt batch, a divergence) would poison the weights and Adam's
  moments for good, so such a step keeps params and the whole optimizer
  state, its count (the LR schedule's step) included. The update is
  checked too (step_is_finite says why). XLA fuses optax's chain per
  array about as well as AdamW written out by hand; what costs is the
  update's norm before the select (experiments/benchmarks/README.md,
  Levers tried).
  """
  grad_norm = optax.global_norm(grads)
  updates, new_opt_state = tx.update(grads, opt_state, params)
  finite = step_is_finite(loss, grad_norm, updates)
  new_params = optax.apply_updates(params, updates)
  new_params, new_opt_state = jax.tree.map(
    lambda new, old: jnp.where(finite, new, old),
    (new_params, new_opt_state),
    (params, opt_state),
  )
  return new_params, new_opt_state, finite, grad_norm


def train_step(
  state: TrainState,
  batch,
  *,
  model,
  tx,
  loss_fn,
  schedule,
  grad_accum_steps: int = 1,
  prng_impl: str = 'threefry',
):
  """One optimizer step; pure, so jit can shard and donate it.

  `prng_impl` (train.prng_impl) picks the PRNG of the dropout masks
  (dropout_key).
  """
  dropout_rng = dropout_key(state.rng, state.step, prng_impl)

  def compute_loss(params, batch, rng):
    outputs = model.apply(
      {'params': params}, batch, deterministic=False, rngs={'dropout': rng}
    )
    return loss_fn(outputs, batch)

  grad_fn = jax.value_and_grad(compute_loss, has_aux=True)
  if grad_accum_steps == 1:
    (loss, metrics), grads = grad_fn(state.params, batch, dropout_rng)
  else:
    loss, grads, metrics = accumulate_gradients(
      grad_fn, state.params, batch, dropout_rng, grad_accum_steps
    )
  params, opt_state, finite, grad_norm = apply_gradients(
    tx, state.params, state.opt_state, grads, loss
  )
  # The optimizer counts applied updates only: step - count is the number
  # of skipped steps, so the running total needs no state of its own and
  # survives a resume. (None: an optimizer without a count, e.g. plain SGD.)
  count, new_count = _update_count(state.opt_state), _update_count(opt_state)
  metrics = dict(
    metrics,
    grad_norm=grad_norm,
    learning_rate=schedule(state.step if count is None else count),
    skipped=(~finite).astype(jnp.int32),
  )
  if new_count is not None:
    metrics['skipped_total'] = state.step + 1 - new_count
  # `step` advances even on a skipped step: the data position (one batch
  # per step) moves past the bad batch and the next step draws fresh
  # dropout masks.
  new_state = state.replace(
    step=state.step + 1, params=params, opt_state=opt_state
  )
  return new_state, metrics


def _update_count(opt_state) -> jax.Array | None:
  """How many updates the optimizer has applied (its schedule's step)."""
  # Every optax transform with a count (Adam's moments, the schedule's
  # step) increments it once per update, so any of them will do.
  counts = optax.tree_utils.tree_get_all_with_path(opt_state, 'count')
  return counts[-1][1] if counts else None


def accumulate_gradients(grad_fn, params, batch, rng, num_microbatches: int):
  """The big batch's (loss, gradient, metrics), from microbatches in a scan.

  The objectives' losses are means over their predicted tokens, so each
  microbatch's gradient and metrics are weighted by its `num_predictions`
  (rows, if the loss reports none): sum(n_i * mean_i) / sum(n_i) is the
  big batch's mean exactly. A loss adding a second mean over another count
  (NSP/SOP's sentences, ELECTRA's discriminator) is weighted by the first.
  """
  n = num_microbatches

  def split(x):
    # Row r goes to microbatch r % n: each device's block of rows holds an
    # equal part of every microbatch, so no microbatch lives on a subset of
    # the devices and the split needs no communication.
    x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
    return nn.with_logical_constraint(
      x, (None, 'batch') + (None,) * (x.ndim - 2)
    )

  def body(grad_sum, xs):
    microbatch, i = xs
    (loss, metrics), grads = grad_fn(
      params, microbatch, jax.random.fold_in(rng, i)
    )
    weight = metrics.get('num_predictions', jnp.float32(1.0))
    grad_sum = jax.tree.map(
      lambda s, g: s + weight * g.astype(jnp.float32), grad_sum, grads
    )
    return grad_sum, (metrics, weight, loss)

  # float32 sums whatever param_dtype is: bf16 would round each addition.
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  grad_sum, (metrics, weights, losses) = jax.lax.scan(
    body, zeros, (jax.tree.map(split, batch), jnp.arange(n))
  )
  total = jnp.sum(weights)
  # No predictions anywhere: a zero gradient, as the big batch's loss gives.
  denominator = jnp.maximum(total, 1e-8)
  grads = jax.tree.map(
    lambda s, p: (s / denominator).astype(p.dtype), grad_sum, params
  )
  metrics = {
    k: total if k == 'num_predictions' else jnp.sum(v * weights) / denominator
    for k, v in metrics.items()
  }
  # A non-finite microbatch loss stays non-finite here (even at weight 0),
  # so train_step skips the whole step.
  return jnp.sum(losses * weights) / denominator, grads, metrics


def jit_train_step(
  model,
  tx,
  loss_fn,
  schedule,
  shardings,
  mesh,
  *,
  grad_accum_steps: int = 1,
  prng_impl: str = 'threefry',
):
  """train_step jitted into the state's and the batch's shardings."""
  return jax.jit(
    functools.partial(
      train_step,
      model=model,
      tx=tx,
      loss_fn=loss_fn,
      schedule=schedule,
      grad_accum_steps=grad_accum_steps,
      prng_impl=check_prng_impl(prng_impl),
    ),
    in_shardings=(shardings, sharding.batch_sharding(mesh)),
    out_shardings=(shardings, sharding.replicated(mesh)),
    donate_argnums=0,
  )


def eval_step(params, batch, *, model, loss_fn):
  """The objective's metrics on one batch, without dropout."""
  outputs = model.apply({'params': params}, batch, deterministic=True)
  return loss_fn(outputs, batch)[1]


def check_grad_accum(config: ml_collections.ConfigDict, mesh) -> int:
  """train.grad_accum_steps, checked against data.batch_size and the mesh."""
  accum = config.train.grad_accum_steps
  # Each microbatch is split over the batch-parallel devices like a batch.
  validate.check_grad_accum(
    accum,
    config.data.batch_size,
    data=mesh.shape['data'],
    fsdp=mesh.shape['fsdp'],
  )
  return accum


def shapes_key(batch: dict) -> tuple:
  """What a jitted step is compiled for: its inputs' names and shapes."""
  return tuple(sorted((k, tuple(v.shape)) for k, v in batch.items()))


def jit_job_step(job, grad_accum_steps: int):
  """A trainer's step (its model, optimizer, loss, schedule, shardings,
  mesh and config's train.prng_impl), jitted with `grad_accum_steps`
  microbatches."""
  return jit_train_step(
    job.model,
    job.tx,
    job.loss_fn,
    job.schedule,
    job.shardings,
    job.mesh,
    grad_accum_steps=grad_accum_steps,
    prng_impl=job.config.train.prng_impl,
  )
