"""Fine-tuning: the run, a training.loop.Job as pretraining's Trainer is.

`finetune(config, workdir)` trains `configs/finetune/*.py`'s config on a
task of pretrain_lm.finetune.TASKS, starting from the pretraining workdir
`config.init.workdir`, and returns the dev results. It trains on
pretraining's loop (pretrain_lm.training): the mesh and rule table, the
TrainState and its jitted step, Orbax checkpoints (resumable: rerun the same
call), metrics.jsonl and TensorBoard, the same stops and exit codes. The
fine-tuning workdir holds everything a later load needs:
config.json, init_config.json (the body's pretraining config), the tokenizer
and results.json (the best and the final dev metrics); a generative task
(text2text) also writes each evaluation's decoded texts there.

The job's parts live by topic: init.py (the pretrained body), batches.py
(rows and batches), evaluation.py (scores, texts, results.json) and
finetuned.py (`load`, a fine-tuned workdir for a notebook or a teacher);
the names callers use are importable from here too.
"""

import functools
import os
from typing import Any

import jax
import ml_collections
import numpy as np

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import goodput, sharding
from pretrain_lm import metrics as metrics_lib
from pretrain_lm import pretrained as pretrained_lib
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import records
from pretrain_lm.finetune import TASKS, batches, evaluation, losses, optimizer
from pretrain_lm.finetune import init as init_lib
from pretrain_lm.finetune import model as model_lib
from pretrain_lm.finetune import rows as rows_lib
from pretrain_lm.finetune.evaluation import RESULTS_FILE
from pretrain_lm.finetune.finetuned import (
  BEST_DIR,
  Finetuned,
  add_teacher_outputs,
  build_model,
  load,
)
from pretrain_lm.finetune.init import (
  INIT_CONFIG_FILE,
  check_reinit_top_layers,
  reinit_top_layers,
  restore_backbone,
)
from pretrain_lm.models import MODELS
from pretrain_lm.training import loop
from pretrain_lm.training import state as state_lib
from pretrain_lm.training import step as step_lib

__all__ = [
  'BEST_DIR',
  'INIT_CONFIG_FILE',
  'RESULTS_FILE',
  'TASKS',
  'Finetuned',
  'Trainer',
  'build_model',
  'check_reinit_top_layers',
  'finetune',
  'load',
  'reinit_top_layers',
  'restore_backbone',
]


class Trainer:
  """Builds everything a fine-tuning run needs; `run()` trains it.

  A training.loop.Job, as pretraining's Trainer: the task's data, heads,
  evaluation, results.json and best checkpoint are its own.
  """

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: str,
    mesh: jax.sharding.Mesh | None = None,
  ):
    self.goodput = goodput.Accountant()  # wall time by cause, as pretraining
    self.config = c = config
    self.workdir = workdir = workdir_lib.absolute(workdir)
    loop.use_compilation_cache(c.train.compilation_cache_dir)
    self.is_chief = jax.process_index() == 0
    body = init_lib.read_body(c, workdir)
    self.init_config, self.model_config = body.init_config, body.model_config
    self.tokenizer = body.tokenizer
    self._read_task()  # data first: a missing file fails before any build
    self.mesh = mesh or sharding.make_mesh(c.mesh)
    self._plan_steps()
    if self.is_chief:
      loop.write_run_files(config, workdir)
      if not body.resuming:
        init_lib.copy_init_files(c.init.workdir, workdir, self.init_config)
    self.model = build_model(c, self.model_config, self.tokenizer)
    self._build_objective()
    self._build_train_batches()
    predict = self._build_prediction()
    self._build_state()
    self._build_steps(predict)

  def _read_task(self) -> None:
    """The task, its head and metric, and its splits as model rows."""
    c = self.config
    self.task = TASKS[c.task.name]
    self.head = rows_lib.task_head(self.task, c.task)
    self.metric = rows_lib.task_metric(self.task, c.task)
    # Cross-view training: odd steps read unlabelled rows.
    self.cvt = bool(c.cvt.unlabeled)
    self.train_split, self.eval_splits, self.unlabeled = batches.read_splits(
      c, self.tokenizer, self.model_config.family, self.task, self.head
    )

  def _plan_steps(self) -> None:
    """Batch sizes, the steps of an epoch and of the run, and when it
    evaluates and saves."""
    c = self.config
    self.batch_size, self.eval_batch_size, self.unlabeled_batch_size = (
      batches.batch_sizes(c, self.mesh)
    )
    self.steps_per_epoch = batches.steps_per_epoch(
      c,
      self.train_split,
      self.unlabeled,
      self.batch_size,
      self.unlabeled_batch_size,
    )
    self.num_steps = c.train.num_steps or (
      c.train.num_epochs * self.steps_per_epoch
    )
    # Evaluations and checkpoints: every so many steps, 0: each epoch's end.
    self.eval_every = c.train.eval_every or self.steps_per_epoch
    self.save_every = c.checkpoint.every or self.steps_per_epoch
    self.save_evaluated = False  # the best checkpoint has its own directory
    self.preempted = False  # run() stopped by a signal (not finished)
    self.nonfinite_stop = False  # run() stopped by non-finite steps

  def _build_objective(self) -> None:
    """The loss and the optimizer; with distillation, the teacher's
    outputs on the training rows."""
    c = self.config
    self.distill = bool(c.distill.teacher)
    self.loss_fn = losses.loss_fn(
      self.head,
      text_to_text=c.head.text_to_text,
      distill=self.distill,
      alpha=c.distill.alpha,
      temperature=c.distill.temperature,
    )
    unfreeze_every = 0
    if c.optimizer.gradual_unfreezing:
      unfreeze_every = max(
        round(c.optimizer.gradual_unfreezing * self.steps_per_epoch), 1
      )
    self.tx, self.schedule = optimizer.make_optimizer(
      c.optimizer,
      self.num_steps,
      self.model_config,
      unfreeze_every=unfreeze_every,
      freeze_backbone=c.head.freeze_backbone,
      skip_unreached_params=self.cvt,
    )
    if self.distill:
      add_teacher_outputs(
        c, self.train_split, self.head, self.mesh, self.eval_batch_size
      )

  def _build_train_batches(self) -> None:
    """The keys a training batch holds, its shapes, and each step's rows."""
    c, features = self.config, self.train_split.features
    self.input_keys = tuple(k for k in rows_lib.INPUT_KEYS if k in features)
    self.train_keys = (
      self.input_keys
      + losses.LABEL_KEYS[self.head]
      + tuple(k for k in features if k.startswith(losses.TEACHER_PREFIX))
    )
    self.batch_shapes = batches.example_batch(
      features, self.train_keys, self.batch_size
    )
    self._train_batches = batches.TrainBatches(
      self.train_split,
      self.train_keys,
      self.batch_size,
      c.train.seed,
      self.unlabeled,
      self.unlabeled_batch_size,
    )

  def _build_prediction(self):
    """What evaluation runs on a batch (the step to jit), its keys, and a
    generative task's decoder.

    A generative task's evaluation decodes with the body's own params
    through pretrain_lm.Pretrained's search, and its dev loss is reduced
    on the device: gathering [N, L, V] logits to the host would not fit.
    """
    self.predict_keys, self.generator = self.input_keys, None
    if self.head != 'lm':
      return evaluation.predict_step
    self.predict_keys = self.input_keys + losses.LABEL_KEYS['lm']
    family = model_lib.backbone_family(self.model_config.family)
    self.generator = pretrained_lib.Pretrained(
      config=ml_collections.ConfigDict(self.init_config),
      model=MODELS[family](self.model_config),
      params=None,
      tokenizer=self.tokenizer,
      step=0,
      mesh=self.mesh,
    )
    evaluation.check_generation_lengths(
      self.config.task, self.model_config, self.eval_splits
    )
    return evaluation.lm_predict_step

  def _build_state(self) -> None:
    """The state's shapes and shardings, and the checkpointers: the
    workdir's, and with checkpoint.keep_best the best evaluation's."""
    c, workdir = self.config, self.workdir
    with self.context():
      self._abstract = state_lib.abstract_train_state(
        self.model, self.tx, self.batch_shapes, self.mesh
      )
    self.shardings = state_lib.shardings_of(self._abstract)
    self.checkpointer = checkpoint_lib.Checkpointer(
      os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR),
      keep=c.checkpoint.keep,
      async_save=c.checkpoint.async_save,
    )
    self.best_checkpointer = None
    if c.checkpoint.keep_best:
      self.best_checkpointer = checkpoint_lib.Checkpointer(
        os.path.join(workdir, BEST_DIR),
        keep=1,
        async_save=c.checkpoint.async_save,
      )
    self.checkpointers = tuple(
      x for x in (self.checkpointer, self.best_checkpointer) if x
    )

  def _build_steps(self, predict) -> None:
    """The jitted train step and the jitted `predict` of evaluation."""
    self.microbatches = step_lib.check_grad_accum(self.config, self.mesh)
    self._p_train_step = self.jit_step(self.microbatches)
    self._p_predict = jax.jit(
      functools.partial(predict, model=self.model),
      in_shardings=(
        self.shardings.params,
        sharding.batch_sharding(self.mesh),
      ),
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
    return state_lib.context(self.mesh)

  def checkpoint_meta(self, state: state_lib.TrainState) -> dict[str, Any]:
    step = int(state.step)
    return {
      'step': step,
      'epoch': step // self.steps_per_epoch,
      'tokenizer': records.tokenizer_meta(self.tokenizer),
      'model_family': self.model_config.family,
      'task': self.config.task.to_dict(),
      'head': self.head,
    }

  def initial_state(self) -> state_lib.TrainState:
    """Init order: (1) the latest checkpoint in the workdir (an exact
    resume), (2) the body's params from the init workdir's checkpoint with
    a fresh head, (3) all fresh (init.random_init)."""
    c = self.config
    with self.context():
      rng = jax.random.key(c.train.seed)
      create = functools.partial(
        state_lib.create_train_state,
        model=self.model,
        tx=self.tx,
        shardings=self.shardings,
      )
      # (1) The newest checkpoint that verifies, as pretraining resumes:
      # one that does not restore stops the run, or with
      # checkpoint.on_corrupt=previous is set aside for the one before.
      with self.goodput.timing('restore'):
        restored = self.checkpointer.restore_latest(
          self._abstract, on_corrupt=c.checkpoint.on_corrupt
        )
      if restored is not None:  # (1)
        _, state, meta = restored
        checkpoint_lib.check_tokenizer(
          meta.get('tokenizer'),
          self.tokenizer,
          f'The checkpoint in {self.checkpointer.directory}',
        )
        return state
      state = create(rng, self.batch_shapes)
      if not c.init.random_init:  # (2)
        body = init_lib.pretrained_body(
          c,
          self._abstract.params['backbone'],
          state.params['backbone'],
          self.model_config,
          self.tokenizer,
        )
        state = state.replace(params=dict(state.params, backbone=body))
      return state  # (3) with init.random_init

  def evaluate(
    self, state: state_lib.TrainState, step: int | None = None
  ) -> dict[str, float]:
    """The task's metrics on each held-out split: eval_<metric> (dev),
    eval_<split>_<metric> (others). A generative task's texts at `step`
    are written to the workdir (evaluation.write_predictions)."""
    params, out = state.params, {}
    for name, split in self.eval_splits.items():
      with self.context():
        predictions = evaluation.run_predictions(
          self._p_predict,
          params,
          split.features,
          keys=self.predict_keys,
          batch_size=self.eval_batch_size,
          mesh=self.mesh,
        )
      if self.generator is not None:
        predictions['texts'] = evaluation.generate(
          self.generator,
          params,
          split.features,
          self.config.task,
          self.eval_batch_size,
        )
        if step is not None and self.is_chief:
          evaluation.write_predictions(
            self.workdir, name, step, split, predictions['texts']
          )
      scores = evaluation.split_scores(
        self.task, self.config, self.head, split, predictions
      )
      prefix = 'eval_' if name == 'dev' else f'eval_{name}_'
      out.update({prefix + k: float(v) for k, v in scores.items()})
    return out

  def train_batch(self, step: int) -> dict[str, np.ndarray]:
    """This host's rows of step `step` (batches.TrainBatches): a fresh
    shuffle every epoch, unlabelled rows on odd steps under CVT."""
    return self._train_batches(step)

  def on_start(self, writer: metrics_lib.MetricWriter, step: int) -> None:
    """Says what the run trains."""
    del step
    c, unlabeled = self.config, ''
    if self.cvt:
      unlabeled = (
        f' and {self.unlabeled.num_rows} unlabelled (cross-view training, '
        f'views {", ".join(self.model.cvt_views)})'
      )
    writer.print(
      f'{c.task.name} ({self.head}): {self.train_split.num_rows} training '
      f'rows{unlabeled}, {self.steps_per_epoch} steps per epoch, '
      f'{self.num_steps} steps.'
    )

  def data(self, step: int, writer: metrics_lib.MetricWriter):
    """The batches from `step` to the end (train_batch's)."""
    del writer
    stream = (self.train_batch(t) for t in range(step, self.num_steps))
    return stream, self.num_steps, self.batch_shapes

  def step_cost(self, shapes: dict) -> loop.StepCost:
    """A labelled step's rows, tokens and the body's FLOPs.

    The FLOPs are the body's as its pretraining counts them (a head's own,
    a few matrix products, left out); a siamese head runs the body on both
    sentences.
    """
    shapes = {k: v.shape for k, v in shapes.items()}
    tokens = sum(
      int(np.prod(s)) for k, s in shapes.items() if k.endswith('input_ids')
    )
    family = model_lib.backbone_family(self.model_config.family)
    rows = {'input_ids': shapes['input_ids']}
    if family == 'encoder_decoder':
      B = shapes['input_ids'][0]
      rows = {
        'encoder_input_ids': shapes['input_ids'],
        'decoder_input_ids': shapes.get('decoder_input_ids', (B, 1)),
      }
    flops = MODELS[family].train_flops(self.model_config, rows)
    if 'b_input_ids' in shapes:
      flops *= 2
    return loop.StepCost(tokens=tokens, flops=flops, examples=self.batch_size)

  def log_metrics(self, step: int, logged: dict) -> dict:
    del step, logged
    return {}

  def on_eval(self, writer, step, state, scores, last) -> None:
    """Records the evaluation in results.json and keeps the best state."""
    writer.write(step, scores, console=False)
    improved = self._results.add(step, scores, last)
    best = self._results.content['best']
    # The console shows the headline metrics; metrics.jsonl has all.
    key = 'eval_' + self.metric
    shown = [key] + [k for k in scores if k != key][:3]
    writer.print(
      f'step {step}: '
      + ' '.join(f'{k}={scores[k]:.4f}' for k in shown)
      + f' (best {key}={best[key]:.4f} at step {best["step"]})'
    )
    if improved and self.best_checkpointer:
      with self.goodput.timing('checkpoint'):
        self.best_checkpointer.save(step, state, self.checkpoint_meta(state))

  def run(self) -> dict[str, Any]:
    """Fine-tunes to the last step or a stop; returns results.json's
    content."""
    self._results = evaluation.Results(self.workdir, self.metric, self.is_chief)
    out = loop.run(self)
    self.state = out.state
    self.preempted, self.nonfinite_stop = out.preempted, out.nonfinite
    return self._results.content


def finetune(
  config: ml_collections.ConfigDict,
  workdir: str,
  mesh: jax.sharding.Mesh | None = None,
) -> dict[str, Any]:
  """Fine-tunes as `config` says in `workdir` (resuming if it holds a run).

  Returns results.json's content: {'metric': name, 'best': {'step': ...,
  'eval_<metric>': ...}, 'final': {...}, 'evals': [...]}.
  """
  return Trainer(config, workdir, mesh).run()
