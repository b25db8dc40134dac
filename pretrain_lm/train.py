"""Pretraining: a config's tokenizer, data stream, model and evaluation,
trained by pretrain_lm.training.loop."""

import functools
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import linen as nn
from jax.experimental import multihost_utils

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import (
  distributed,
  goodput,
  objectives,
  sharding,
)
from pretrain_lm import metrics as metrics_lib
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import fingerprint, pipeline, records
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, ModelConfig
from pretrain_lm.objectives import OBJECTIVES, loss_fn
from pretrain_lm.training import loop
from pretrain_lm.training import optimizer as optimizer_lib
from pretrain_lm.training import state as state_lib
from pretrain_lm.training import step as step_lib


def abstract_batch(element_spec: dict) -> dict:
  """Global-batch ShapeDtypeStructs from one host's tf.data element_spec."""
  return {
    k: jax.ShapeDtypeStruct(
      (s.shape[0] * jax.process_count(), *s.shape[1:]),
      s.dtype.as_numpy_dtype,
    )
    for k, s in element_spec.items()
  }


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
  tx, schedule = optimizer_lib.make_optimizer(
    config.optimizer, config.train.num_steps
  )
  objective = OBJECTIVES[config.objective.name]
  with (
    jax.set_mesh(mesh),
    nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES),
  ):
    state = state_lib.abstract_train_state(model, tx, batch_shapes, mesh)
    shardings = state_lib.shardings_of(state)
    batch = {
      k: jax.ShapeDtypeStruct(
        v.shape, v.dtype, sharding=sharding.batch_sharding(mesh)
      )
      for k, v in batch_shapes.items()
    }
    step = step_lib.jit_train_step(
      model,
      tx,
      loss_fn(objective, config.objective),
      schedule,
      shardings,
      mesh,
      grad_accum_steps=step_lib.check_grad_accum(config, mesh),
      prng_impl=config.train.prng_impl,
    )
    return step.lower(state, batch)


class Trainer:
  """Builds everything a run needs from a config; `run()` trains it.

  A training.loop.Job: the loop reads its fields and calls its hooks.
  """

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
    loop.use_compilation_cache(config.train.compilation_cache_dir)
    self.is_chief = jax.process_index() == 0
    # Hosts that disagree would hang in a collective or mix checkpoints.
    distributed.check_hosts_agree(config, workdir)
    self.preempted = False  # run() stopped by a signal (not finished)
    self.data_start_step = 0  # where the data stream began (_check_resume)
    self.nonfinite_stop = False  # run() stopped by non-finite steps
    t = config.train
    self.num_steps, self.eval_every = t.num_steps, t.eval_every
    self.save_every = config.checkpoint.every
    # checkpoint.keep_best ranks checkpoints by their eval metrics, so an
    # evaluated state is saved too (retention drops the others).
    self.save_evaluated = bool(config.checkpoint.keep_best)
    self.mesh = mesh or sharding.make_mesh(config.mesh)
    if self.is_chief:
      loop.write_run_files(config, workdir)
    self.tokenizer = self._setup_tokenizer()
    self.model_config = ModelConfig.from_config(config.model)
    self.model = MODELS[config.model.family](self.model_config)
    self.objective = OBJECTIVES[config.objective.name]
    self.loss_fn = loss_fn(self.objective, config.objective)
    self.tx, self.schedule = optimizer_lib.make_optimizer(
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
      self._abstract = state_lib.abstract_train_state(
        self.model, self.tx, self.batch_shapes, self.mesh
      )
    self.shardings = state_lib.shardings_of(self._abstract)
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
    self.checkpointers = (self.checkpointer,)
    self.microbatches = step_lib.check_grad_accum(config, self.mesh)
    self._p_train_step = self.jit_step(self.microbatches)
    self._p_eval_step = jax.jit(
      functools.partial(
        step_lib.eval_step, model=self.model, loss_fn=self.loss_fn
      ),
      in_shardings=(self.shardings.params, self.batch_sharding),
      out_shardings=sharding.replicated(self.mesh),
    )

  @property
  def train_step(self):
    """The jitted, donated step: (state, global batch) -> (state, metrics)."""
    return self._p_train_step

  def jit_step(self, grad_accum_steps: int):
    """This run's step with another batch split (train_step is the
    config's)."""
    return step_lib.jit_job_step(self, grad_accum_steps)

  def context(self):
    """Mesh + logical rules, needed while tracing the model's constraints."""
    return state_lib.context(self.mesh)

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

  def checkpoint_meta(self, state: state_lib.TrainState) -> dict[str, Any]:
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

  def abstract_state(self) -> state_lib.TrainState:
    """The state's shapes, dtypes and shardings, without allocating it."""
    return self._abstract

  def initial_state(self) -> state_lib.TrainState:
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
      state = state_lib.create_train_state(
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

  def evaluate(self, state: state_lib.TrainState, step: int) -> dict:
    """The held-out metrics of `state` (the loop's hook)."""
    del step
    return self.evaluate_params(state.params, self._eval_data)

  def on_eval(self, writer, step, state, scores, last) -> None:
    del state, last
    writer.write(step, scores)

  def evaluate_params(self, params, eval_data) -> dict[str, float]:
    """Metrics over the held-out batches, weighted by predictions per batch.

    A mixture's eval data is {corpus name: batches}: each corpus gets its
    own eval_<name>_* metrics, and eval_* are over all of them.
    """
    if isinstance(eval_data, dict):
      out = {}
      for name, batches in eval_data.items():
        one = self.evaluate_params(params, batches)
        out.update({f'eval_{name}_{k[5:]}': v for k, v in one.items()})
      every = [b for batches in eval_data.values() for b in batches]
      return {**self.evaluate_params(params, every), **out}
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

  def on_start(self, writer: metrics_lib.MetricWriter, step: int) -> None:
    """Reads the held-out batches, once per start."""
    del writer, step
    self._eval_data = pipeline.eval_batches(
      self.config,
      self.tokenizer,
      self.row_transform,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )

  def data(self, step: int, writer: metrics_lib.MetricWriter):
    """The batches of `step`'s seq-len stage (`_stage_data`), said when a
    stage after the first one starts."""
    batches, end, shapes = self._stage_data(step)
    if step and self.config.data.seq_len_schedule:
      seq_len = shapes['input_ids'].shape[1]
      writer.print(f'Step {step}: rows of {seq_len} tokens from here.')
    return batches, end, shapes

  def step_cost(self, shapes: dict) -> loop.StepCost:
    shapes = {k: v.shape for k, v in shapes.items()}
    # Tokens fed to the model: the encoder's and the decoder's, if both.
    tokens = sum(
      int(np.prod(s)) for k, s in shapes.items() if k.endswith('input_ids')
    )
    flops = self.model.train_flops(self.model_config, shapes)
    return loop.StepCost(tokens=tokens, flops=flops)

  def log_metrics(self, step: int, logged: dict) -> dict:
    """Perplexity, the bad input skipped and a mixture's shares."""
    cfg = self.config
    return {
      'perplexity': _perplexity(logged),
      # Bad input data.bad_input='skip' dropped (per epoch; cached).
      **pipeline.skipped_input(cfg, jax.process_index(), jax.process_count()),
      # A prepared mixture's share so far, per corpus.
      **pipeline.tokens_per_source(
        cfg, self.row_transform.row_length, step - self.data_start_step
      ),
    }

  def run(self) -> state_lib.TrainState:
    """Trains to train.num_steps or a stop. Returns the final state."""
    out = loop.run(self)
    self.preempted, self.nonfinite_stop = out.preempted, out.nonfinite
    return out.state


# The token cross-entropy a perplexity means something for: the MLM part of
# a joint loss (NSP/SOP, ELECTRA), a biLM's forward direction, else the
# loss itself.
_PERPLEXITY_OF = ('mlm_loss', 'forward_loss', 'loss')


def _perplexity(metrics: dict[str, float], prefix: str = '') -> float:
  name = next(k for k in _PERPLEXITY_OF if prefix + k in metrics)
  return float(np.exp(min(metrics[prefix + name], 50.0)))


def check_tokenizer_matches(meta, tokenizer, checkpointer) -> None:
  """A checkpoint must be resumed with the tokenizer that produced it."""
  checkpoint_lib.check_tokenizer(
    meta.get('tokenizer'),
    tokenizer,
    f'The checkpoint in {checkpointer.directory}',
  )


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  mesh: jax.sharding.Mesh | None = None,
) -> state_lib.TrainState:
  """Trains `config` in `workdir`, resuming from its latest checkpoint."""
  return Trainer(config, workdir, mesh).run()
