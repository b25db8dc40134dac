"""A fine-tuned workdir, loaded: for a notebook, or as a distillation teacher.

`load(workdir)` gives a `Finetuned` (its config, model, params, tokenizer)
that featurizes task examples as its run did and predicts on them;
`add_teacher_outputs` puts a teacher's outputs on a student's training rows.
"""

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import sharding
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.finetune import TASKS, evaluation, losses
from pretrain_lm.finetune import config as config_lib
from pretrain_lm.finetune import model as model_lib
from pretrain_lm.finetune import rows as rows_lib
from pretrain_lm.finetune.init import INIT_CONFIG_FILE
from pretrain_lm.models import ModelConfig
from pretrain_lm.training import state as state_lib

# The best dev evaluation's checkpoint in a fine-tuning workdir.
BEST_DIR = 'best'


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
        functools.partial(evaluation.predict_step, model=self.model),
        out_shardings=sharding.replicated(self.mesh),
      )
      return evaluation.run_predictions(
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


def add_teacher_outputs(
  config: ml_collections.ConfigDict,
  split: rows_lib.Split,
  head: str,
  mesh: jax.sharding.Mesh,
  batch_size: int,
) -> None:
  """Adds teacher_<output> features to `split`: the outputs of the teacher
  distill.teacher on each of its rows, computed once.

  The teacher reads the examples with its own tokenizer and row length.
  Sequence-level heads match rows by example; span and token heads need
  the teacher's rows to be the student's (same tokenizer and layout).
  """
  c = config
  teacher = load(c.distill.teacher, mesh=mesh)
  if (
    teacher.config.task.name != c.task.name
    or rows_lib.task_head(teacher.task, teacher.config.task) != head
  ):
    raise ValueError(
      f'distill.teacher={c.distill.teacher!r} was fine-tuned on '
      f'{teacher.config.task.name} with another head; the student trains '
      f'{c.task.name} ({head}).'
    )
  student = split.features
  teacher_rows = rows_lib.featurize(
    teacher.config,
    split.examples,
    teacher.tokenizer,
    teacher.model_config.family,
  )
  outputs = teacher.predict(teacher_rows, batch_size)
  if head in ('classification', 'regression'):
    order = np.argsort(teacher_rows['example_index'], kind='stable')
    if not np.array_equal(
      teacher_rows['example_index'][order], np.arange(len(order))
    ):
      raise ValueError('The teacher rows are not one per example.')
    index = order[student['example_index']]
  else:
    if not np.array_equal(teacher_rows['input_ids'], student['input_ids']):
      raise ValueError(
        f'Distilling a {head} head needs the teacher to read the '
        'same rows: the same tokenizer and task.seq_len.'
      )
    index = np.arange(split.num_rows)
  for k in losses.OUTPUT_KEYS[head]:
    student[losses.TEACHER_PREFIX + k] = outputs[k][index]
