"""Learning-rate schedules and the optimizers' optax chains."""

import jax
import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(opt: ml_collections.ConfigDict, num_steps: int):
  """Linear warmup to the peak, then decay to the final rate at num_steps."""
  warmup = optax.linear_schedule(0.0, opt.learning_rate, opt.warmup_steps)
  decay_steps = max(num_steps - opt.warmup_steps, 1)
  if opt.decay == 'linear':
    after = optax.linear_schedule(
      opt.learning_rate, opt.final_learning_rate, decay_steps
    )
  elif opt.decay == 'cosine':  # GPT-2/nanoGPT; alpha is the final fraction
    after = optax.cosine_decay_schedule(
      opt.learning_rate,
      decay_steps,
      alpha=opt.final_learning_rate / opt.learning_rate,
    )
  elif opt.decay == 'constant':
    after = optax.constant_schedule(opt.learning_rate)
  elif opt.decay == 'rsqrt':  # T5: 1/sqrt(step) after warmup_steps
    w = max(opt.warmup_steps, 1)
    after = lambda t: opt.learning_rate * jnp.sqrt(w / (t + w))
  else:
    raise ValueError(
      f"optimizer.decay={opt.decay!r}; expected 'linear', 'cosine', "
      "'constant' or 'rsqrt'."
    )
  return optax.join_schedules([warmup, after], [opt.warmup_steps])


def _decay_mask(params):
  # BERT exempts biases and LayerNorm parameters (the 1-D ones) from decay.
  return jax.tree.map(lambda p: p.ndim > 1, params)


def _clipping(opt: ml_collections.ConfigDict) -> list:
  if not opt.grad_clip_norm:
    return []
  return [optax.clip_by_global_norm(opt.grad_clip_norm)]


def _adam_family(make, opt: ml_collections.ConfigDict, schedule) -> list:
  """Clipping, then `make` (optax.adamw or optax.lamb) with decoupled decay."""
  return _clipping(opt) + [
    make(
      schedule,
      b1=opt.b1,
      b2=opt.b2,
      eps=opt.eps,
      weight_decay=opt.weight_decay,
      mask=_decay_mask,
    )
  ]


def adamw_chain(opt: ml_collections.ConfigDict, schedule) -> list:
  """Global-norm clipping, then AdamW at `schedule` (optax transforms)."""
  return _adam_family(optax.adamw, opt, schedule)


def lamb_chain(opt: ml_collections.ConfigDict, schedule) -> list:
  """Global-norm clipping, then LAMB (You et al., 2020: large-batch BERT)."""
  # optax's trust ratio covers every parameter; the paper's code also
  # exempts biases and LayerNorm from it, only from decay here.
  return _adam_family(optax.lamb, opt, schedule)


def adafactor_chain(opt: ml_collections.ConfigDict, schedule) -> list:
  """Adafactor as T5 trained with it (Shazeer & Stern, 2018)."""
  # T5 (Mesh TF): factored second moments for dims >= 128, decay 1 - t^-0.8,
  # update clipping at RMS 1, steps relative to each parameter's RMS, no
  # momentum. Our schedule is always explicit, so the paper's relative
  # step size (1/sqrt(t)) is the schedule's job, not the optimizer's.
  decay = None
  if opt.weight_decay:
    # Decoupled and scaled by the learning rate, as AdamW's.
    decay = lambda count: opt.weight_decay * schedule(count)
  return _clipping(opt) + [
    optax.adafactor(
      schedule,
      min_dim_size_to_factor=128,
      decay_rate=opt.adafactor_decay_rate,
      multiply_by_parameter_scale=opt.adafactor_param_scale,
      clipping_threshold=1.0,
      momentum=opt.adafactor_momentum or None,
      eps=1e-30,
      factored=True,
      weight_decay_rate=decay,
      weight_decay_mask=_decay_mask,
    )
  ]


# optimizer.name -> its optax chain (clipping included).
OPTIMIZERS = {
  'adamw': adamw_chain,
  'lamb': lamb_chain,
  'adafactor': adafactor_chain,
}


def make_optimizer(opt: ml_collections.ConfigDict, num_steps: int):
  """The optimizer.name chain at the run's schedule; returns (tx, schedule)."""
  if opt.name not in OPTIMIZERS:
    raise ValueError(
      f'optimizer.name={opt.name!r}; valid: {sorted(OPTIMIZERS)}.'
    )
  schedule = learning_rate_schedule(opt, num_steps)
  return optax.chain(*OPTIMIZERS[opt.name](opt, schedule)), schedule
