"""Training: state initialised into its shardings, pure steps, the loop."""

import contextlib
import functools
import os
import signal
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tensorflow as tf
from flax import linen as nn
from jax.experimental import multihost_utils

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import (
  distributed,
  goodput,
  objectives,
  sharding,
  validate,
)
from pretrain_lm import metrics as metrics_lib
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import fingerprint, pipeline, records
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, ModelConfig
from pretrain_lm.objectives import OBJECTIVES, loss_fn

# Exit code of a run stopped by SIGTERM/SIGINT after saving its checkpoint:
# "resume me" (EX_TEMPFAIL in sysexits.h); launchers rerun on it.
EXIT_RESUME = 75
# Exit code of a run stopped by train.max_consecutive_skips non-finite steps
# (EX_DATAERR): a failure to look at, not to rerun blindly.
EXIT_NONFINITE = 65


@flax.struct.dataclass
class TrainState:
  """Everything a step changes; the whole of it is checkpointed."""

  step: jax.Array
  params: Any
  opt_state: Any
  # Raw key data (uint32[2]): the base key for dropout, folded with the step
  # so a resumed run draws exactly the masks it would have drawn.
  rng: jax.Array


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


def abstract_batch(element_spec: dict) -> dict:
  """Global-batch ShapeDtypeStructs from one host's tf.data element_spec."""
  return {
    k: jax.ShapeDtypeStruct(
      (s.shape[0] * jax.process_count(), *s.shape[1:]),
      s.dtype.as_numpy_dtype,
    )
    for k, s in element_spec.items()
  }


def init_fn(rng, batch, *, model, tx) -> TrainState:
  """Builds a fresh state; its params still carry logical-axis boxes."""
  params_rng, dropout_rng = jax.random.split(rng)
  variables = model.init(
    {'params': params_rng, 'dropout': dropout_rng}, batch, deterministic=True
  )
  params = variables['params']
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=_fit_boxes(tx.init(params)),
    rng=jax.random.key_data(jax.random.fold_in(rng, 1)),
  )


def _fit_boxes(opt_state):
  """Unshards optimizer-state boxes that no longer fit their values.

  Optimizer state mapped over boxed params keeps each param's logical axis
  names, which is right for Adam's moments but not for Adafactor's
  factored ones (a [D, F] kernel's row statistics are [D]) nor for its
  [1] placeholders: those small vectors are replicated instead.
  """

  def fit(box):
    value = box.value
    if len(box.names) == value.ndim and all(
      name is None or size > 1
      for name, size in zip(box.names, value.shape, strict=True)
    ):
      return box
    return box.replace(names=(None,) * value.ndim)

  return jax.tree.map(
    lambda x: fit(x) if isinstance(x, nn.Partitioned) else x,
    opt_state,
    is_leaf=lambda x: isinstance(x, nn.Partitioned),
  )


def abstract_train_state(model, tx, batch, mesh) -> TrainState:
  """The state's shapes, dtypes and NamedShardings (from the rule table)
  as jax.ShapeDtypeStructs, from one trace of init_fn: nothing is
  allocated or compiled. create_train_state's output has these."""
  boxed = jax.eval_shape(
    functools.partial(init_fn, model=model, tx=tx), jax.random.key(0), batch
  )
  logical_specs = nn.get_partition_spec(boxed)
  shardings = sharding.logical_to_sharding(logical_specs, mesh)
  shapes = sharding.unbox_abstract(boxed)
  return jax.tree.map(
    lambda s, x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding.fit_to_shape(s, x.shape)
    ),
    shardings,
    shapes,
  )


def shardings_of(abstract):
  """The sharding of every leaf of an abstract state."""
  return jax.tree.map(lambda x: x.sharding, abstract)


def create_train_state(rng, batch, *, model, tx, shardings) -> TrainState:
  """Initialises the state directly into its shardings (never on one host)."""
  init = lambda r, b: nn.meta.unbox(init_fn(r, b, model=model, tx=tx))
  return jax.jit(init, out_shardings=shardings)(rng, batch)


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
):
  """One optimizer step; pure, so jit can shard and donate it."""
  dropout_rng = jax.random.fold_in(
    jax.random.wrap_key_data(state.rng), state.step
  )

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
    ),
    in_shardings=(shardings, sharding.batch_sharding(mesh)),
    out_shardings=(shardings, sharding.replicated(mesh)),
    donate_argnums=0,
  )


def _field(config: ml_collections.ConfigDict, name: str):
  """config's 'section.field' value."""
  section, field = name.split('.')
  return config[section][field]


def check_grad_accum(
  config: ml_collections.ConfigDict,
  mesh,
  batch_field: str = 'data.batch_size',
) -> int:
  """train.grad_accum_steps, checked against the batch and the mesh.

  `batch_field` names the config's global batch size (fine-tuning's is
  train.batch_size).
  """
  accum = config.train.grad_accum_steps
  # Each microbatch is split over the batch-parallel devices like a batch.
  validate.check_grad_accum(
    accum,
    _field(config, batch_field),
    batch_field,
    data=mesh.shape['data'],
    fsdp=mesh.shape['fsdp'],
  )
  return accum


def lower_train_step(
  config: ml_collections.ConfigDict, mesh, batch_shapes: dict
) -> jax.stages.Lowered:
  """`config`'s train step lowered for `mesh` from shapes alone.

  Nothing is allocated or run: `.compile()` on the result is an
  ahead-of-time check that the step partitions for the mesh, and its
  `.memory_analysis()` the per-device memory (experiments/memory).

  Args:
    config: a run config.
    mesh: the mesh to compile for.
    batch_shapes: the global batch, {feature: jax.ShapeDtypeStruct}.
  """
  model = MODELS[config.model.family](ModelConfig.from_config(config.model))
  tx, schedule = make_optimizer(config.optimizer, config.train.num_steps)
  objective = OBJECTIVES[config.objective.name]
  with (
    jax.set_mesh(mesh),
    nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES),
  ):
    state = abstract_train_state(model, tx, batch_shapes, mesh)
    shardings = shardings_of(state)
    batch = {
      k: jax.ShapeDtypeStruct(
        v.shape, v.dtype, sharding=sharding.batch_sharding(mesh)
      )
      for k, v in batch_shapes.items()
    }
    step = jit_train_step(
      model,
      tx,
      loss_fn(objective, config.objective),
      schedule,
      shardings,
      mesh,
      grad_accum_steps=check_grad_accum(config, mesh),
    )
    return step.lower(state, batch)


def eval_step(params, batch, *, model, loss_fn):
  """The objective's metrics on one batch, without dropout."""
  outputs = model.apply({'params': params}, batch, deterministic=True)
  return loss_fn(outputs, batch)[1]


def use_compilation_cache(path: str) -> None:
  """Points jax's persistent compilation cache at `path` ('' : leave it).

  Every compile of more than a second (jax's default threshold) is stored
  there, keyed by the program, its shardings, the devices and the jax
  version, and later processes load it instead of compiling.
  """
  if not path:
    return
  if '://' not in path:
    path = os.path.abspath(os.path.expanduser(path))
  tf.io.gfile.makedirs(path)
  jax.config.update('jax_compilation_cache_dir', path)


class Trainer:
  """Builds everything a run needs from a config; `run()` is the loop."""

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: str,
    mesh: jax.sharding.Mesh | None = None,
  ):
    # Wall time by cause from here (goodput.py): startup until the loop.
    self.goodput = goodput.Accountant()
    self.config = config
    self.workdir = workdir = workdir_lib.absolute(workdir)
    use_compilation_cache(config.train.compilation_cache_dir)
    self.is_chief = jax.process_index() == 0
    # Hosts that disagree would hang in a collective or mix checkpoints.
    distributed.check_hosts_agree(config, workdir)
    self.preempted = False  # run() stopped by a signal (not finished)
    self.data_start_step = 0  # where the data stream began (_check_resume)
    self.nonfinite_stop = False  # run() stopped by non-finite steps
    self.mesh = mesh or sharding.make_mesh(config.mesh)
    if self.is_chief:
      write_run_files(config, workdir)
    self.tokenizer = self._setup_tokenizer()
    self.model_config = ModelConfig.from_config(config.model)
    self.model = MODELS[config.model.family](self.model_config)
    self.objective = OBJECTIVES[config.objective.name]
    self.loss_fn = loss_fn(self.objective, config.objective)
    self.tx, self.schedule = make_optimizer(
      config.optimizer, config.train.num_steps
    )
    # Shapes come from the pipeline itself, so model and data cannot disagree.
    # A fresh run reads this very stream (_stage_data): built once.
    self.row_transform = objectives.row_transform(config)
    self._fresh_stream = pipeline.train_dataset(
      config,
      self.tokenizer,
      self.row_transform,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
    self.batch_shapes = abstract_batch(self._fresh_stream.element_spec)
    if self.is_chief:  # lets pretrain_lm.load build the model's input
      workdir_lib.write_json(
        os.path.join(workdir, workdir_lib.BATCH_SPEC_FILE),
        {
          k: [list(v.shape[1:]), v.dtype.name]
          for k, v in self.batch_shapes.items()
        },
      )
    with self.context():
      self._abstract = abstract_train_state(
        self.model, self.tx, self.batch_shapes, self.mesh
      )
    self.shardings = shardings_of(self._abstract)
    self.batch_sharding = sharding.batch_sharding(self.mesh)
    ckpt = config.checkpoint
    self.checkpointer = checkpoint_lib.Checkpointer(
      os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR),
      keep=ckpt.keep,
      async_save=ckpt.async_save,
      keep_best=ckpt.keep_best,
      best_metric=ckpt.best_metric,
      best_mode=ckpt.best_mode,
      keep_every=ckpt.keep_every,
    )
    self.microbatches = check_grad_accum(config, self.mesh)
    self._p_train_step = self.jit_step(self.microbatches)
    self._p_eval_step = jax.jit(
      functools.partial(eval_step, model=self.model, loss_fn=self.loss_fn),
      in_shardings=(self.shardings.params, self.batch_sharding),
      out_shardings=sharding.replicated(self.mesh),
    )

  @property
  def train_step(self):
    """The jitted, donated step: (state, global batch) -> (state, metrics)."""
    return self._p_train_step

  def jit_step(self, grad_accum_steps: int):
    """This run's train step, jitted, with another batch split (A/Bs and
    tests; train_step is the config's)."""
    return jit_train_step(
      self.model,
      self.tx,
      self.loss_fn,
      self.schedule,
      self.shardings,
      self.mesh,
      grad_accum_steps=grad_accum_steps,
    )

  @contextlib.contextmanager
  def context(self):
    """Mesh + logical rules, needed while tracing the model's constraints."""
    with (
      jax.set_mesh(self.mesh),
      nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES),
    ):
      yield

  def _setup_tokenizer(self) -> tokenizer_lib.Tokenizer:
    # Ids an objective reserves (T5's sentinels) stay out of the tokenizer.
    kwargs = dict(
      vocab_size=self.config.model.vocab_size,
      workdir=self.workdir,
      reserved_ids=objectives.num_reserved_ids(
        OBJECTIVES[self.config.objective.name], self.config.objective
      ),
    )
    if self.is_chief:
      tokenizer_lib.setup_tokenizer(self.config.data, **kwargs, is_chief=True)
    # Other hosts wait for the chief's file, then everyone loads the same one.
    multihost_utils.sync_global_devices('tokenizer ready')
    return tokenizer_lib.setup_tokenizer(
      self.config.data, **kwargs, is_chief=False
    )

  @functools.cached_property
  def data_stream(self) -> dict[str, Any]:
    """What decides this run's batches (fingerprint.data_stream)."""
    return fingerprint.data_stream(
      self.config, self.tokenizer, jax.process_count()
    )

  @functools.cached_property
  def _run_description(self) -> dict[str, Any]:
    return checkpoint_lib.run_description(self.config, self.mesh)

  def checkpoint_meta(self, state: TrainState) -> dict[str, Any]:
    """The JSON saved with each checkpoint (pretrain_lm.describe shows it)."""
    step = int(state.step)
    return {
      'step': step,
      # One host batch per step since the data stream began.
      'batches_consumed': step - self.data_start_step,
      'tokenizer': records.tokenizer_meta(self.tokenizer),
      'data': dict(self.data_stream, start_step=self.data_start_step),
      'model_family': self.config.model.family,
      'objective': self.config.objective.name,
      'run': dict(
        self._run_description,
        saved=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
      ),
    }

  def _check_resume(self, meta: dict[str, Any]) -> None:
    """The checkpoint's tokenizer and data stream against this run's.

    Sets data_start_step: the saved stream's, or the saved step when
    data.allow_changed lets a changed stream start there.
    """
    check_tokenizer_matches(meta, self.tokenizer, self.checkpointer)
    saved = meta.get('data')
    if saved is None:  # a checkpoint from before the stream was recorded
      return
    changed = fingerprint.changed_fields(
      saved['fields'], self.data_stream['fields']
    )
    if not changed:
      self.data_start_step = saved['start_step']
      return
    step, source = meta['step'], self.config.data.source
    if saved['source'] != source:
      changed.append(f'(data.source was {saved["source"]!r}, now {source!r})')
    changes = '\n  '.join(changed)
    if not self.config.data.allow_changed:
      raise checkpoint_lib.RestoreError(
        f'The checkpoint in {self.checkpointer.directory} (step {step}) was '
        f'trained on another data stream. Changed:\n  {changes}\nResume '
        'with the config it was saved with, or pass '
        '--config.data.allow_changed=True to start the new stream at its '
        f'first batch at step {step}.'
      )
    # The new stream's batch 0 is read at `step`; the checkpoints from here
    # record that, so resuming them is exact again.
    self.data_start_step = step
    if self.is_chief:
      print(
        f'data.allow_changed: the new data stream starts at its first '
        f'batch at step {step}. Changed:\n  {changes}',
        flush=True,
      )

  def abstract_state(self) -> TrainState:
    """The state's shapes, dtypes and shardings, without allocating it."""
    return self._abstract

  def initial_state(self) -> TrainState:
    """Resume order: (1) the latest checkpoint in the workdir, (2) params
    from `checkpoint.init_from`, (3) a fresh initialisation."""
    abstract = self.abstract_state()
    with self.context():
      rng = jax.random.key(self.config.train.seed)
      # (1) The newest checkpoint that verifies. One that is there but does
      # not restore stops the run: never a fresh start on top of it.
      with self.goodput.timing('restore'):
        restored = self.checkpointer.restore_latest(
          abstract, on_corrupt=self.config.checkpoint.on_corrupt
        )
      if restored is not None:  # (1)
        _, state, meta = restored
        self._check_resume(meta)
        return state
      state = create_train_state(
        rng,
        self.batch_shapes,
        model=self.model,
        tx=self.tx,
        shardings=self.shardings,
      )
      if self.config.checkpoint.init_from:  # (2)
        source = checkpoint_lib.Checkpointer(
          checkpoint_lib.checkpoint_dir(self.config.checkpoint.init_from),
          keep=0,
          read_only=True,
        )
        step = source.latest_step()
        if step is None:
          raise FileNotFoundError(
            'checkpoint.init_from: no checkpoint in '
            f'{self.config.checkpoint.init_from!r}.'
          )
        params = source.restore_params(step, abstract.params)
        # An open manager keeps Orbax's background threads alive past the
        # end of the run.
        source.close()
        state = state.replace(params=params)
      return state  # (3) when neither applied

  def evaluate(self, params, eval_data) -> dict[str, float]:
    """Metrics over the held-out batches, weighted by predictions per batch.

    A mixture's eval data is {corpus name: batches}: each corpus gets its
    own eval_<name>_* metrics, and eval_* are over all of them.
    """
    if isinstance(eval_data, dict):
      out = {}
      for name, batches in eval_data.items():
        one = self.evaluate(params, batches)
        out.update({f'eval_{name}_{k[5:]}': v for k, v in one.items()})
      every = [b for batches in eval_data.values() for b in batches]
      return {**self.evaluate(params, every), **out}
    totals, weight = {}, 0.0
    with self.context():
      for batch in eval_data:
        m = jax.device_get(
          self._p_eval_step(params, sharding.host_to_global(batch, self.mesh))
        )
        w = float(m.get('num_predictions', 1.0))
        weight += w
        for k, v in m.items():
          totals[k] = totals.get(k, 0.0) + float(v) * w
    out = {
      f'eval_{k}': v / max(weight, 1.0)
      for k, v in totals.items()
      if k != 'num_predictions'
    }
    out['eval_perplexity'] = _perplexity(out, prefix='eval_')
    return out

  def _stage_data(self, step: int):
    """The train batches from `step` to the end of its seq-len stage.

    Returns (iterator, the stage's end step, its global batch shapes). The
    batch at `step` only depends on the step (pipeline.stage_at): a
    resumed run reads what it would have.
    """
    _, end, seq_len, start_batch = pipeline.stage_at(
      self.config, step, self.data_start_step
    )
    cfg = self.config
    if seq_len == cfg.data.seq_len and start_batch == 0:
      ds = self._fresh_stream  # what __init__ built, from its first batch
    else:
      if seq_len != cfg.data.seq_len:
        cfg = cfg.copy_and_resolve_references()
        cfg.data.seq_len = seq_len
      ds = pipeline.train_dataset(
        cfg,
        self.tokenizer,
        objectives.row_transform(cfg),  # this stage's row length
        start_batch=start_batch,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
      )
    return ds.as_numpy_iterator(), end, abstract_batch(ds.element_spec)

  def _open_writer(self, start: int) -> metrics_lib.MetricWriter:
    """The run's metric writer (chief only); says where a resume starts."""
    writer = metrics_lib.MetricWriter(
      self.workdir,
      total_steps=self.config.train.num_steps,
      initial_step=start,
      enabled=self.is_chief,
      progress_bar=self.config.train.progress_bar,
      wandb_project=self.config.train.wandb_project,
      wandb_entity=self.config.train.wandb_entity,
      config=self.config.to_dict(),
    )
    if start:
      writer.print(
        f'Resumed from {self.checkpointer.directory} at step {start}.'
      )
    return writer

  def _stop_nonfinite(self, writer, step: int, skips, unlogged) -> None:
    """Ends the run after too many skipped steps, saying what to do."""
    # Skipped steps never touch the weights, so the checkpoint just saved
    # holds the last good ones; at this step, so a rerun reads on past the
    # bad batches rather than replaying them.
    self.nonfinite_stop = True  # main exits with EXIT_NONFINITE
    if unlogged:  # the steps since the last log, the skipped ones too
      writer.write(step, unlogged)
    writer.print(
      f'Stopping at step {step}: the last {skips.consecutive} steps had '
      'a non-finite loss or gradient and were skipped. The checkpoint '
      f'at step {step} holds the weights of the last good step. Look '
      'at the learning rate and the data, or raise '
      'train.max_consecutive_skips (0: never stop).'
    )

  def run(self) -> TrainState:
    """The training loop. Returns the final state."""
    cfg = self.config
    state = self.initial_state()
    start = int(state.step)
    num_steps = cfg.train.num_steps
    eval_data = pipeline.eval_batches(
      cfg,
      self.tokenizer,
      self.row_transform,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
    writer = self._open_writer(start)
    stop = StopSignal()
    skips = _SkipGuard(cfg.train.max_consecutive_skips, writer)
    acct = self.goodput
    if start and self.is_chief:
      acct.resumed(self.workdir, start)
    monitor = goodput.Monitor(
      acct, cfg.train, os.path.join(self.workdir, 'tensorboard'), writer.print
    )
    acct.end_startup()

    # The data stream is opened at the start of each seq-len stage (the
    # first one at `start`); a new row length retraces the step.
    step, pending, window, stage_end = start, None, [], start
    while step < num_steps:
      if step == stage_end:
        with acct.timing('input'):
          train_iter, stage_end, shapes = self._stage_data(step)
        perf = _Throughput(self, cfg, shapes)
        if step and cfg.data.seq_len_schedule:
          seq_len = shapes['input_ids'].shape[1]
          writer.print(f'Step {step}: rows of {seq_len} tokens from here.')
      with monitor.input():
        batch = sharding.host_to_global(next(train_iter), self.mesh)
      monitor.before_step(step + 1, shapes_key(batch))
      with self.context():
        state, step_metrics = self._p_train_step(state, batch)
      monitor.dispatched(step_metrics)
      step += 1
      # Read step t-1's metrics only after step t is dispatched, so the host
      # never leaves the device idle waiting for a transfer.
      if pending is not None:
        window.append(skips.observe(step - 1, jax.device_get(pending)))
      pending = step_metrics
      monitor.end_step(step, (state, step_metrics))
      writer.advance()

      last = step == num_steps
      log_now = step % cfg.train.log_every == 0 or last
      # One more skip would stop the run: read this step's verdict now, so
      # that no step after the last skip is dispatched before the stop.
      if log_now or skips.near_limit:
        window.append(skips.observe(step, jax.device_get(pending)))
        pending = None
      if log_now:
        # Bad input data.bad_input='skip' dropped (per epoch; cached).
        skipped = pipeline.skipped_input(
          cfg, jax.process_index(), jax.process_count()
        )
        # A prepared mixture's share so far, per corpus.
        shares = pipeline.tokens_per_source(
          cfg, self.row_transform.row_length, step - self.data_start_step
        )
        writer.write(
          step,
          {
            **perf.summarize(window, step),
            **skipped,
            **shares,
            **monitor.input_share(),
            **monitor.record(),
          },
        )
        window = []
      evaluated = None  # this step's eval metrics, if it has them
      if step % cfg.train.eval_every == 0 or last:
        with acct.timing('eval'):
          evaluated = self.evaluate(state.params, eval_data)
        writer.write(step, evaluated)
      signalled = stop.requested()
      exiting = (
        signalled
        or skips.exhausted
        or (cfg.train.exit_interval and step % cfg.train.exit_interval == 0)
      )
      # checkpoint.keep_best ranks checkpoints by their eval metrics, so
      # an evaluated state is saved too (retention drops the others).
      best_due = cfg.checkpoint.keep_best and evaluated is not None
      if step % cfg.checkpoint.every == 0 or last or exiting or best_due:
        with acct.timing('checkpoint'):
          self.checkpointer.save(
            step, state, self.checkpoint_meta(state), metrics=evaluated
          )
      if skips.exhausted:
        unlogged = perf.summarize(window, step) if window else None
        self._stop_nonfinite(writer, step, skips, unlogged)
        break
      if exiting and not last:
        self.preempted = signalled  # main exits with EXIT_RESUME
        writer.print(
          f'Stopping at step {step} (checkpoint saved); run the '
          'same command again to continue.'
        )
        break

    monitor.close()
    self._finish(writer, stop, step)
    return state

  def _finish(self, writer, stop, step: int) -> None:
    """Waits for the last save, then closes what the run opened."""
    with self.goodput.timing('checkpoint'):
      self.checkpointer.wait()
    self.checkpointer.close()
    stop.restore()
    writer.print(f'Checkpoint: {self.checkpointer.directory}/{step}')
    # This start's final account (the steps since the last log included).
    writer.write(step, self.goodput.record(), console=False)
    writer.close()


# The token cross-entropy a perplexity means something for: the MLM part of
# a joint loss (NSP/SOP, ELECTRA), a biLM's forward direction, else the
# loss itself.
_PERPLEXITY_OF = ('mlm_loss', 'forward_loss', 'loss')


def shapes_key(batch: dict) -> tuple:
  """What a jitted step is compiled for: its inputs' names and shapes."""
  return tuple(sorted((k, tuple(v.shape)) for k, v in batch.items()))


def _perplexity(metrics: dict[str, float], prefix: str = '') -> float:
  name = next(k for k in _PERPLEXITY_OF if prefix + k in metrics)
  return float(np.exp(min(metrics[prefix + name], 50.0)))


def write_run_files(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Stores the resolved config and, per start, commit and versions."""
  tf.io.gfile.makedirs(workdir)
  workdir_lib.write_json(os.path.join(workdir, 'config.json'), config.to_dict())
  path = os.path.join(workdir, 'run_metadata.json')
  starts = (
    workdir_lib.read_json(path)['starts'] if tf.io.gfile.exists(path) else []
  )
  starts.append(workdir_lib.run_metadata(jax.devices(), jax.process_count()))
  workdir_lib.write_json(path, {'starts': starts})


def check_tokenizer_matches(meta, tokenizer, checkpointer) -> None:
  """A checkpoint must be resumed with the tokenizer that produced it."""
  checkpoint_lib.check_tokenizer(
    meta.get('tokenizer'),
    tokenizer,
    f'The checkpoint in {checkpointer.directory}',
  )


class _Throughput:
  """Turns a window of per-step metrics into logged averages and speeds."""

  def __init__(self, trainer: Trainer, cfg: ml_collections.ConfigDict, batch):
    shapes = {k: v.shape for k, v in batch.items()}
    # Tokens fed to the model: the encoder's and the decoder's, if both.
    self.tokens_per_step = sum(
      int(np.prod(s)) for k, s in shapes.items() if k.endswith('input_ids')
    )
    self.flops_per_token = (
      trainer.model.train_flops(trainer.model_config, shapes)
      / self.tokens_per_step
    )
    peak = metrics_lib.peak_flops_per_device(cfg.train.peak_flops_per_device)
    self.peak_total = peak * jax.device_count() if peak else None
    self.last_time, self.last_step = time.perf_counter(), None

  def summarize(self, window: list[dict], step: int) -> dict[str, float]:
    now = time.perf_counter()
    out = {k: float(np.mean([m[k] for m in window])) for k in window[0]}
    if 'skipped_total' in out:  # a running count, not a per-step value
      out['skipped_total'] = float(window[-1]['skipped_total'])
    out['perplexity'] = _perplexity(out)
    # The first window includes compilation; speed is reported from the next.
    if self.last_step is not None:
      tokens_per_s = (
        (step - self.last_step) * self.tokens_per_step / (now - self.last_time)
      )
      out['tokens_per_s'] = tokens_per_s
      out['model_tflops_per_s'] = tokens_per_s * self.flops_per_token / 1e12
      if self.peak_total:
        out['mfu'] = tokens_per_s * self.flops_per_token / self.peak_total
    self.last_time, self.last_step = now, step
    return out


class _SkipGuard:
  """Follows the steps skipped for a non-finite loss or gradient."""

  def __init__(self, limit: int, writer: metrics_lib.MetricWriter):
    self.limit = limit  # consecutive skips that stop the run; 0: never
    self.writer = writer
    self.consecutive = 0

  def observe(self, step: int, metrics: dict) -> dict:
    """Counts step `step`'s verdict (in step order); returns `metrics`."""
    if not metrics.get('skipped'):
      self.consecutive = 0
      return metrics
    self.consecutive += 1
    self.writer.print(
      f'Step {step}: non-finite loss or gradient; update skipped '
      f'({self.consecutive} in a row).'
    )
    return metrics

  @property
  def near_limit(self) -> bool:
    return self.limit > 0 and self.consecutive + 1 >= self.limit

  @property
  def exhausted(self) -> bool:
    return self.limit > 0 and self.consecutive >= self.limit


class StopSignal:
  """Turns SIGTERM (preemption, `kill`) and Ctrl-C into a clean save + exit."""

  def __init__(self):
    self._requested = False
    self._pending = None  # the all-host OR dispatched at the last step
    self._previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. in a notebook worker)
        pass

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame):
    del frame
    if self._requested:  # a second Ctrl-C stops at once
      raise KeyboardInterrupt
    self._requested = True
    print(
      f'\nSignal {signum} received: saving a checkpoint at the end of '
      'this step, then exiting.',
      flush=True,
    )

  def requested(self) -> bool:
    """Whether to stop after this step: the same answer on every host."""
    # All hosts must agree, or some would wait forever in the save.
    if jax.process_count() == 1:
      return self._requested
    # Dispatch this step's all-host OR and read the previous step's, so the
    # host never waits for the device here (a stop comes one step later).
    previous, self._pending = self._pending, self._any_host(self._requested)
    return previous is not None and bool(previous)

  @functools.cached_property
  def _any_host(self):
    """flag -> replicated OR over all processes, without blocking."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ('all',))
    flags = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('all'))
    any_ = jax.jit(jnp.any, out_shardings=sharding.replicated(mesh))

    def gather(flag: bool) -> jax.Array:
      local = [jax.device_put(np.array([flag]), d) for d in jax.local_devices()]
      return any_(
        jax.make_array_from_single_device_arrays((len(devices),), flags, local)
      )

    return gather


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  mesh: jax.sharding.Mesh | None = None,
) -> TrainState:
  """Trains `config` in `workdir`, resuming from its latest checkpoint."""
  return Trainer(config, workdir, mesh).run()
