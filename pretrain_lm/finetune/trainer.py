"""Fine-tuning: the run (state, restore, the loop) and fine-tuned loading.

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
"""

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf
from jax.experimental import multihost_utils

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import goodput, sharding
from pretrain_lm import metrics as metrics_lib
from pretrain_lm import pretrained as pretrained_lib
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import records
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.finetune import TASKS, losses, optimizer
from pretrain_lm.finetune import config as config_lib
from pretrain_lm.finetune import model as model_lib
from pretrain_lm.finetune import rows as rows_lib
from pretrain_lm.models import MODELS, ModelConfig
from pretrain_lm.training import loop
from pretrain_lm.training import state as state_lib
from pretrain_lm.training import step as step_lib

INIT_CONFIG_FILE = 'init_config.json'
RESULTS_FILE = 'results.json'
BEST_DIR = 'best'


def predict_step(params, batch, *, model):
  """The head's outputs on a batch, without dropout."""
  return model.apply({'params': params}, batch, deterministic=True)


def lm_predict_step(params, batch, *, model):
  """A generative row's target NLL and token count (losses.target_nll)."""
  logits = model.apply({'params': params}, batch, deterministic=True)['logits']
  return losses.target_nll(logits, batch['target_ids'], batch['target_mask'])


def _example_batch(features: dict[str, np.ndarray], keys, rows: int) -> dict:
  """ShapeDtypeStructs of a batch of `rows` rows of these features."""
  return {
    k: jax.ShapeDtypeStruct((rows, *features[k].shape[1:]), features[k].dtype)
    for k in keys
  }


def _host_rows(rows: np.ndarray) -> np.ndarray:
  """This process's share of a global batch's row indices."""
  per_host = len(rows) // jax.process_count()
  start = jax.process_index() * per_host
  return rows[start : start + per_host]


def run_predictions(
  predict: Callable,
  params,
  features: dict[str, np.ndarray],
  *,
  keys: tuple[str, ...],
  batch_size: int,
  mesh: jax.sharding.Mesh,
) -> dict[str, np.ndarray]:
  """`predict` over every row, in batches of batch_size (last one padded)."""
  n = len(features['input_ids'])
  chunks = []
  for start in range(0, n, batch_size):
    rows = np.arange(start, start + batch_size)
    # The last batch repeats row 0: a real row keeps every output finite.
    rows = np.where(rows < n, rows, 0)
    host = _host_rows(rows)
    batch = {k: features[k][host] for k in keys}
    out = predict(params, sharding.host_to_global(batch, mesh))
    chunks.append(jax.tree.map(np.asarray, jax.device_get(out)))
  return {k: np.concatenate([c[k] for c in chunks])[:n] for k in chunks[0]}


# --- Loading a fine-tuned workdir (a distillation teacher, a notebook).


@dataclasses.dataclass
class Finetuned:
  """A fine-tuned model: its config, body config, params and tokenizer."""

  config: ml_collections.ConfigDict
  model_config: ModelConfig
  model: model_lib.FinetuneModel
  params: Any
  tokenizer: tokenizer_lib.Tokenizer
  step: int
  mesh: jax.sharding.Mesh

  @property
  def task(self):
    return TASKS[self.config.task.name]

  def featurize(self, examples: list[dict]) -> dict[str, np.ndarray]:
    """Model rows of task examples (task.read's), as the run made them."""
    return rows_lib.featurize(
      self.config, examples, self.tokenizer, self.model_config.family
    )

  def predict(
    self, features: dict[str, np.ndarray], batch_size: int = 32
  ) -> dict[str, np.ndarray]:
    """The head's outputs for model rows (from `featurize`)."""
    keys = tuple(k for k in rows_lib.INPUT_KEYS if k in features)
    shards = self.mesh.shape['data'] * self.mesh.shape['fsdp']
    batch_size = -(-batch_size // shards) * shards
    with state_lib.context(self.mesh):
      fn = jax.jit(
        functools.partial(predict_step, model=self.model),
        out_shardings=sharding.replicated(self.mesh),
      )
      return run_predictions(
        fn,
        self.params,
        features,
        keys=keys,
        batch_size=batch_size,
        mesh=self.mesh,
      )


def build_model(
  config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  tokenizer: tokenizer_lib.Tokenizer,
) -> model_lib.FinetuneModel:
  """The FinetuneModel a fine-tuning config describes."""
  task = TASKS[config.task.name]
  labels = ()
  if config.head.text_to_text:
    if model_lib.backbone_family(model_config.family) != 'encoder_decoder':
      raise ValueError(
        'head.text_to_text needs an encoder-decoder (T5), not a '
        f'{model_config.family!r} model.'
      )
    labels = rows_lib.label_sequences(task, config.task, tokenizer)
  head = rows_lib.task_head(task, config.task)
  if config.head.siamese and (
    config.head.text_to_text or head not in ('classification', 'regression')
  ):
    raise ValueError(
      'head.siamese embeds sentence pairs for a classification or '
      f'regression head, not {head} (and not with head.text_to_text).'
    )
  cvt = {}
  if config.get('cvt') and config.cvt.unlabeled:
    cvt = dict(
      cvt_views=config_lib.cvt_views(config)
      or model_lib.default_cvt_views(head, model_config.family),
      cvt_mask_rate=config.cvt.mask_rate,
      cvt_mask_id=tokenizer.mask_id
      if tokenizer.mask_id >= 0
      else tokenizer.unk_id,
      cvt_keep_ids=tuple(
        i
        for i in (tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)
        if i >= 0
      ),
    )
  return model_lib.FinetuneModel(
    model_config,
    head=head,
    num_labels=task.num_labels(config.task),
    pooling=config.head.pooling,
    dropout=config.head.dropout,
    scalar_mix=config.head.scalar_mix,
    mix_layer_norm=config.head.mix_layer_norm,
    freeze_backbone=config.head.freeze_backbone,
    label_sequences=labels,
    siamese=config.head.siamese,
    cove=config.head.cove,
    cove_embeddings=config.head.cove_embeddings,
    **cvt,
  )


def load(
  workdir: str,
  step: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
  best: bool = True,
) -> Finetuned:
  """A fine-tuning workdir's best checkpoint (else its latest, or `step`)."""
  config = ml_collections.ConfigDict(
    workdir_lib.read_json(os.path.join(workdir, 'config.json'))
  )
  init_config = workdir_lib.read_json(os.path.join(workdir, INIT_CONFIG_FILE))
  model_config = ModelConfig.from_config(init_config['model'])
  tokenizer = tokenizer_lib.load_tokenizer(
    os.path.join(workdir, tokenizer_lib.WORKDIR_FILENAME)
  )
  model = build_model(config, model_config, tokenizer)
  directory = os.path.join(workdir, BEST_DIR)
  if not (best and step is None and tf.io.gfile.isdir(directory)):
    directory = os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR)
  checkpointer = checkpoint_lib.Checkpointer(directory, keep=0, read_only=True)
  step = checkpointer.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f'No checkpoint in {directory!r}.')
  # Without a mesh: one device, as pretrain_lm.load does.
  mesh = mesh or sharding.make_mesh(
    {'data': 1, 'fsdp': 1, 'tensor': 1}, jax.local_devices()[:1]
  )
  L = config.task.seq_len
  example = {
    k: jax.ShapeDtypeStruct((1, L), jnp.int32) for k in rows_lib.INPUT_KEYS
  }
  with state_lib.context(mesh):
    abstract = sharding.abstract_params(model, example, mesh)
  params = checkpointer.restore_params(step, abstract)
  checkpointer.close()
  return Finetuned(config, model_config, model, params, tokenizer, step, mesh)


# --- The run.


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
    if c.init.workdir and workdir == workdir_lib.absolute(c.init.workdir):
      raise ValueError(
        f'--workdir={workdir!r} is the pretraining workdir (--init); '
        'fine-tune into a workdir of its own.'
      )
    # A resumed run reads the body's config and tokenizer from its own
    # workdir's copies, so it needs no --init.
    resuming = tf.io.gfile.exists(os.path.join(workdir, INIT_CONFIG_FILE))
    # Every host decides that before the chief writes those copies.
    multihost_utils.sync_global_devices('fine-tuning workdir checked')
    source = workdir if resuming else c.init.workdir
    self.init_config = workdir_lib.read_json(
      os.path.join(source, INIT_CONFIG_FILE if resuming else 'config.json')
    )
    self.model_config = ModelConfig.from_config(self.init_config['model'])
    if self.model_config.family not in config_lib.FAMILIES:
      raise ValueError(
        f'Fine-tuning a {self.model_config.family!r} model is not '
        f'supported; families: {list(config_lib.FAMILIES)}.'
      )
    check_reinit_top_layers(c.init.reinit_top_layers, self.model_config)
    self.tokenizer = tokenizer_lib.load_tokenizer(
      os.path.join(source, tokenizer_lib.WORKDIR_FILENAME)
    )
    self.task = TASKS[c.task.name]
    self.head = rows_lib.task_head(self.task, c.task)
    self.metric = rows_lib.task_metric(self.task, c.task)
    # Data first: a missing file fails before anything is built.
    family = self.model_config.family
    self.train_split = rows_lib.read_split(
      c, 'train', self.tokenizer, family, c.task.max_train_examples
    )
    self.eval_splits = {
      name: rows_lib.read_split(
        c, name, self.tokenizer, family, c.task.max_eval_examples
      )
      for name in rows_lib.task_eval_splits(self.task, c.task)
    }
    # Cross-view training: odd steps read unlabelled rows.
    self.cvt = bool(c.cvt.unlabeled)
    self.unlabeled = None
    self._orders = {}  # stream -> (epoch, its row order): train_batch
    if self.cvt:
      self.unlabeled = rows_lib.unlabeled_split(
        c, self.tokenizer, family, self.head
      )

    self.mesh = mesh or sharding.make_mesh(c.mesh)
    shards = self.mesh.shape['data'] * self.mesh.shape['fsdp']
    self.batch_size = c.data.batch_size
    self.eval_batch_size = c.train.eval_batch_size or c.data.batch_size
    self.unlabeled_batch_size = c.cvt.batch_size or c.data.batch_size
    for field, size in (
      ('data.batch_size', self.batch_size),
      ('train.eval_batch_size', self.eval_batch_size),
      ('cvt.batch_size', self.unlabeled_batch_size),
    ):
      if size % shards or size % jax.process_count():
        raise ValueError(
          f'{field}={size} must be a multiple of the {shards} '
          'batch shards (mesh data x fsdp) and of the process count.'
        )
    # Labelled batches per epoch; with cross-view training each is
    # followed by an unlabelled one, and an epoch has twice the steps.
    batches_per_epoch = self.train_split.num_rows // self.batch_size
    if not batches_per_epoch:
      raise ValueError(
        f'{self.train_split.num_rows} training rows make no batch of '
        f'data.batch_size={self.batch_size}.'
      )
    self.steps_per_epoch = batches_per_epoch * (2 if self.cvt else 1)
    if self.cvt and self.unlabeled.num_rows < self.unlabeled_batch_size:
      raise ValueError(
        f'cvt.unlabeled={c.cvt.unlabeled!r}: {self.unlabeled.num_rows} '
        f'unlabelled rows make no batch of {self.unlabeled_batch_size}.'
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
    unfreeze_every = 0
    if c.optimizer.gradual_unfreezing:
      unfreeze_every = max(
        round(c.optimizer.gradual_unfreezing * self.steps_per_epoch), 1
      )

    if self.is_chief:
      loop.write_run_files(config, workdir)
      if not resuming:
        self._copy_init_files()
    self.model = build_model(c, self.model_config, self.tokenizer)
    self.distill = bool(c.distill.teacher)
    self.loss_fn = losses.loss_fn(
      self.head,
      text_to_text=c.head.text_to_text,
      distill=self.distill,
      alpha=c.distill.alpha,
      temperature=c.distill.temperature,
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
      self._add_teacher_outputs()
    features = self.train_split.features
    self.input_keys = tuple(k for k in rows_lib.INPUT_KEYS if k in features)
    self.train_keys = (
      self.input_keys
      + losses.LABEL_KEYS[self.head]
      + tuple(k for k in features if k.startswith(losses.TEACHER_PREFIX))
    )
    self.batch_shapes = _example_batch(
      features, self.train_keys, self.batch_size
    )
    # A generative task's evaluation decodes with the body's own params
    # through pretrain_lm.Pretrained's search, and its dev loss is reduced
    # on the device: gathering [N, L, V] logits to the host would not fit.
    predict, self.predict_keys, self.generator = (
      predict_step,
      self.input_keys,
      None,
    )
    if self.head == 'lm':
      predict = lm_predict_step
      self.predict_keys = self.input_keys + losses.LABEL_KEYS['lm']
      self.generator = pretrained_lib.Pretrained(
        config=ml_collections.ConfigDict(self.init_config),
        model=MODELS[model_lib.backbone_family(family)](self.model_config),
        params=None,
        tokenizer=self.tokenizer,
        step=0,
        mesh=self.mesh,
      )
      self._check_generation_lengths()
    with self.context():
      self._abstract = state_lib.abstract_train_state(
        self.model, self.tx, self.batch_shapes, self.mesh
      )
    self.shardings = state_lib.shardings_of(self._abstract)
    batch_sharding = sharding.batch_sharding(self.mesh)
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
    self.microbatches = step_lib.check_grad_accum(c, self.mesh)
    self._p_train_step = self.jit_step(self.microbatches)
    self._p_predict = jax.jit(
      functools.partial(predict, model=self.model),
      in_shardings=(self.shardings.params, batch_sharding),
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

  def _copy_init_files(self) -> None:
    """The body's pretraining config and tokenizer, so the workdir loads
    (and resumes) on its own."""
    name = tokenizer_lib.WORKDIR_FILENAME
    tf.io.gfile.copy(
      os.path.join(self.config.init.workdir, name),
      os.path.join(self.workdir, name),
      overwrite=True,
    )
    # Written last: its presence marks the workdir as resumable.
    workdir_lib.write_json(
      os.path.join(self.workdir, INIT_CONFIG_FILE), self.init_config
    )

  def _add_teacher_outputs(self) -> None:
    """The teacher's outputs on every training row, computed once.

    The teacher reads the examples with its own tokenizer and row length.
    Sequence-level heads match rows by example; span and token heads need
    the teacher's rows to be the student's (same tokenizer and layout).
    """
    c = self.config
    teacher = load(c.distill.teacher, mesh=self.mesh)
    if (
      teacher.config.task.name != c.task.name
      or rows_lib.task_head(teacher.task, teacher.config.task) != self.head
    ):
      raise ValueError(
        f'distill.teacher={c.distill.teacher!r} was fine-tuned on '
        f'{teacher.config.task.name} with another head; the student trains '
        f'{c.task.name} ({self.head}).'
      )
    student = self.train_split.features
    teacher_rows = rows_lib.featurize(
      teacher.config,
      self.train_split.examples,
      teacher.tokenizer,
      teacher.model_config.family,
    )
    outputs = teacher.predict(teacher_rows, self.eval_batch_size)
    if self.head in ('classification', 'regression'):
      order = np.argsort(teacher_rows['example_index'], kind='stable')
      if not np.array_equal(
        teacher_rows['example_index'][order], np.arange(len(order))
      ):
        raise ValueError('The teacher rows are not one per example.')
      index = order[student['example_index']]
    else:
      if not np.array_equal(teacher_rows['input_ids'], student['input_ids']):
        raise ValueError(
          f'Distilling a {self.head} head needs the teacher to read the '
          'same rows: the same tokenizer and task.seq_len.'
        )
      index = np.arange(self.train_split.num_rows)
    for k in losses.OUTPUT_KEYS[self.head]:
      student[losses.TEACHER_PREFIX + k] = outputs[k][index]

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
        body = restore_backbone(
          c.init.workdir,
          c.init.step or None,
          self._abstract.params['backbone'],
          self.model_config.family,
          tokenizer=self.tokenizer,
        )
        body = reinit_top_layers(
          body,
          state.params['backbone'],
          self.model_config,
          c.init.reinit_top_layers,
        )
        state = state.replace(params=dict(state.params, backbone=body))
      return state  # (3) with init.random_init

  def _check_generation_lengths(self) -> None:
    """Raises unless the body's positions cover the training rows and
    every dev prompt with max_new_tokens after it."""
    tc, max_len = self.config.task, self.model_config.max_len
    longest = max(tc.seq_len, tc.target_len, tc.max_new_tokens)
    if self.model_config.family == 'decoder':
      prompts = max(
        int(split.features['prompt_length'].max())
        for split in self.eval_splits.values()
      )
      longest = max(longest, prompts + tc.max_new_tokens)
    if longest > max_len:
      raise ValueError(
        f'task.seq_len={tc.seq_len}, task.target_len={tc.target_len} and '
        f'task.max_new_tokens={tc.max_new_tokens} make rows of {longest} '
        f'tokens, more than the model.max_len={max_len} of the body.'
      )

  def generate(self, params, features: dict[str, np.ndarray]) -> list[str]:
    """Each row's decoded text from its prompt, as the task config says
    (greedy, or beam search with its length penalty), cut at [SEP]."""
    tc, generator = self.config.task, self.generator
    generator.params = params['backbone']
    rows = [
      ids[:n]
      for ids, n in zip(
        features['input_ids'], features['prompt_length'], strict=True
      )
    ]
    out_NT = generator.generate_ids(
      rows,
      tc.max_new_tokens,
      temperature=0.0,
      num_beams=tc.num_beams,
      length_penalty=tc.length_penalty,
      batch_size=self.eval_batch_size,
    )
    sep, texts = self.tokenizer.sep_id, []
    for ids in out_NT.tolist():
      texts.append(
        generator.decode(ids[: ids.index(sep)] if sep in ids else ids)
      )
    return texts

  def _write_predictions(
    self, name: str, step: int, split: rows_lib.Split, texts: list[str]
  ) -> None:
    """predictions_<step>.jsonl (dev; predictions_<split>_<step>.jsonl for
    others): each example with its generated 'prediction'."""
    infix = '' if name == 'dev' else f'{name}_'
    path = os.path.join(self.workdir, f'predictions_{infix}{step}.jsonl')
    index = split.features['example_index']
    with tf.io.gfile.GFile(path, 'w') as f:
      for i, text in zip(index, texts, strict=True):
        record = dict(split.examples[i], prediction=text)
        f.write(json.dumps(record, ensure_ascii=False) + '\n')

  def evaluate(
    self, state: state_lib.TrainState, step: int | None = None
  ) -> dict[str, float]:
    """The task's metrics on each held-out split: eval_<metric> (dev),
    eval_<split>_<metric> (others). A generative task's texts at `step`
    are written to the workdir (see _write_predictions)."""
    params, out = state.params, {}
    for name, split in self.eval_splits.items():
      with self.context():
        predictions = run_predictions(
          self._p_predict,
          params,
          split.features,
          keys=self.predict_keys,
          batch_size=self.eval_batch_size,
          mesh=self.mesh,
        )
      if self.generator is not None:
        predictions['texts'] = self.generate(params, split.features)
        if step is not None and self.is_chief:
          self._write_predictions(name, step, split, predictions['texts'])
      scores = self.task.evaluate(
        split.examples, split.features, predictions, self.config.task
      )
      loss = losses.eval_loss(
        self.head,
        predictions,
        split.features,
        self.config.head.text_to_text,
      )
      if loss is not None:
        scores['loss'] = loss
      prefix = 'eval_' if name == 'dev' else f'eval_{name}_'
      out.update({prefix + k: float(v) for k, v in scores.items()})
    return out

  def train_batch(self, step: int) -> dict[str, np.ndarray]:
    """This host's rows of step `step`: a fresh shuffle every epoch.

    The order depends only on (seed, epoch), so a resumed run continues
    mid-epoch with exactly the rows it would have seen. With cross-view
    training, even steps take the labelled batches in that order and odd
    steps unlabelled ones, shuffled the same way over their own epochs.
    """
    split, keys, B = self.train_split, self.train_keys, self.batch_size
    stream = 0
    if self.cvt:
      step, stream = divmod(step, 2)
      if stream:
        split, B = self.unlabeled, self.unlabeled_batch_size
        keys = tuple(split.features)
    epoch, index = divmod(step, split.num_rows // B)
    if self._orders.get(stream, (None,))[0] != epoch:
      # The labelled rows keep the order they have without CVT.
      seed = [self.config.train.seed, epoch]
      if stream:
        seed.append(1)
      order = np.random.default_rng(seed).permutation(split.num_rows)
      self._orders[stream] = (epoch, order)
    rows = _host_rows(self._orders[stream][1][index * B : (index + 1) * B])
    return {k: split.features[k][rows] for k in keys}

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
    batches = (self.train_batch(t) for t in range(step, self.num_steps))
    return batches, self.num_steps, self.batch_shapes

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
    self._results = _Results(self.workdir, self.metric, self.is_chief)
    out = loop.run(self)
    self.state = out.state
    self.preempted, self.nonfinite_stop = out.preempted, out.nonfinite
    return self._results.content


def restore_backbone(
  init_workdir: str,
  step: int | None,
  abstract_body,
  family: str,
  tokenizer: tokenizer_lib.Tokenizer | None = None,
):
  """The body's params from a pretraining checkpoint, into its shardings.

  A partial restore: the pretraining heads fine-tuning does not use (MLM,
  NSP) stay on disk. With `tokenizer`, the checkpoint must have been
  trained with it.
  """
  source = checkpoint_lib.Checkpointer(
    checkpoint_lib.checkpoint_dir(init_workdir), keep=0, read_only=True
  )
  step = source.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f'No checkpoint in {source.directory!r}.')
  if tokenizer is not None:
    meta = checkpoint_lib.read_meta(source.directory, step) or {}
    checkpoint_lib.check_tokenizer(
      meta.get('tokenizer'), tokenizer, f'Checkpoint {step} of {init_workdir!r}'
    )
  names = model_lib.PRETRAINED_NAMES.get(family, {})
  renamed = {names.get(k, k): v for k, v in abstract_body.items()}
  # partial: the pretraining heads' entries may stay on disk; the body's
  # must match exactly.
  params = source.restore_params(step, renamed, partial=True)
  source.close()
  back = {v: k for k, v in names.items()}
  return {back.get(k, k): v for k, v in params.items()}


def check_reinit_top_layers(count: int, cfg: ModelConfig) -> None:
  """Raises ValueError unless `count` of the body's layers can be renewed."""
  total = optimizer.num_layers(cfg)
  if count > total:
    raise ValueError(
      f'init.reinit_top_layers={count}, but the body has {total} layers.'
    )
  if count and cfg.share_layers:
    raise ValueError(
      f"init.reinit_top_layers={count}: this body shares one layer's "
      'weights among all its layers (ALBERT), so its top layers cannot be '
      'renewed alone.'
    )


def reinit_top_layers(restored, fresh, cfg: ModelConfig, count: int):
  """`restored` with its top `count` layers taken from `fresh`.

  Zhang et al. (2021): the top layers of a pretrained body are the most
  specific to its pretraining task, and fine-tuning on little data does
  better from fresh weights there. A layer's depth is
  `optimizer.layer_depth`'s (an encoder-decoder's top layers are its
  decoder's), and everything above the renewed layers (a stack's final norm,
  BERT's pooler) is renewed with them. A scanned stack keeps its lower
  layers' rows.
  """
  if not count:
    return restored
  lowest_renewed = optimizer.num_layers(cfg) - count + 1

  def pick(path, old, new):
    names = ('backbone', *optimizer.path_names(path))
    renew = np.asarray(optimizer.layer_depth(names, cfg)) >= lowest_renewed
    if renew.ndim == 0:
      return new if renew else old
    mask = renew.reshape(renew.shape + (1,) * (old.ndim - renew.ndim))
    return jax.device_put(jnp.where(mask, new, old), old.sharding)

  return jax.tree_util.tree_map_with_path(pick, restored, fresh)


class _Results:
  """results.json: the metric's best dev evaluation, the final one, all."""

  def __init__(self, workdir: str, metric: str, enabled: bool):
    self.path = os.path.join(workdir, RESULTS_FILE)
    self.enabled = enabled
    self.content = {'metric': metric, 'best': None, 'final': None, 'evals': []}
    if tf.io.gfile.exists(self.path):  # a resumed run keeps its history
      self.content = workdir_lib.read_json(self.path)

  def add(self, step: int, scores: dict[str, float], final: bool) -> bool:
    """Records an evaluation; True when it is the best so far."""
    key = 'eval_' + self.content['metric']
    record = {'step': step, **scores}
    best = self.content['best']
    improved = best is None or scores[key] > best[key]
    if improved:
      self.content['best'] = record
    self.content['evals'] = [
      e for e in self.content['evals'] if e['step'] != step
    ] + [record]
    if final:
      self.content['final'] = record
    if self.enabled:
      workdir_lib.write_json(self.path, self.content)
    return improved


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
