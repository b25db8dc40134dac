"""Pretrained, every notebook method in one class, and load(workdir)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_collections
import tensorflow as tf

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import sharding
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, ModelConfig
from pretrain_lm.pretrained import embed, fill_mask, generate


@dataclasses.dataclass
class Pretrained(
  fill_mask.FillMaskMixin, generate.GenerateMixin, embed.EmbedMixin
):
  """A model, its params and tokenizer: plain objects, nothing hidden.

  Made by `load`; each method documents which families it serves.

  Attributes:
    config: the run's resolved config (the workdir's config.json).
    model: the Flax module (`pretrain_lm.models.MODELS[family]`).
    params: its parameters, as restored from the checkpoint.
    tokenizer: the run's tokenizer (the workdir's tokenizer.model).
    step: the checkpoint's training step.
    mesh: the mesh the params are sharded over (None: one device).

  Example:
    m = pretrain_lm.load('workdirs/quickstart')  # make quickstart
    m.family, m.step, m.tokenizer.vocab_size
  """


def example_batch(workdir: str, config) -> dict[str, jax.Array]:
  """A one-row batch of zeros with the run's feature shapes.

  What the model needs to build (init or eval_shape) its params.

  Args:
    workdir: a training workdir (its batch spec file, when present).
    config: the run's config (data.seq_len without a batch spec).

  Returns:
    Feature name -> zeros [1, ...] of the training batch's dtype.
  """
  path = os.path.join(workdir, workdir_lib.BATCH_SPEC_FILE)
  if not tf.io.gfile.exists(path):  # a workdir from before the spec file
    return {'input_ids': jnp.zeros((1, config.data.seq_len), jnp.int32)}
  spec = workdir_lib.read_json(path)
  return {
    k: jnp.zeros((1, *shape), dtype) for k, (shape, dtype) in spec.items()
  }


def load(
  workdir: str, step: int | None = None, mesh: jax.sharding.Mesh | None = None
) -> Pretrained:
  """Loads checkpoint `step` (default: the latest) of a training workdir.

  Without a mesh the params land on the first local device; with one they are
  restored straight into the rule table's shardings, and the Pretrained's
  methods run on that mesh. `pretrain_lm.load` is this function.

  Args:
    workdir: a directory written by `python -m pretrain_lm.main` (or by
      `python -m pretrain_lm.convert import`).
    step: the checkpoint step; None for the latest.
    mesh: a jax.sharding.Mesh to shard the params over; None for one device.

  Returns:
    A Pretrained: config, model, params, tokenizer and the notebook methods.

  Raises:
    FileNotFoundError: no config.json or no checkpoint in the workdir.

  Example:
    # `make quickstart`, i.e. python -m pretrain_lm.main
    #   --config=configs/bert.py:size=tiny --workdir=workdirs/quickstart
    import pretrain_lm
    m = pretrain_lm.load('workdirs/quickstart')
    m.fill_mask('The capital of France is [MASK].')
  """
  config_path = os.path.join(workdir, 'config.json')
  if not tf.io.gfile.exists(config_path):
    raise FileNotFoundError(
      f'{workdir!r} is not a pretrain_lm workdir: no config.json in it.'
    )
  config = ml_collections.ConfigDict(workdir_lib.read_json(config_path))
  model_config = ModelConfig.from_config(config.model)
  model = MODELS[model_config.family](model_config)
  tokenizer = tokenizer_lib.load_tokenizer(
    os.path.join(workdir, 'tokenizer.model')
  )

  checkpointer = checkpoint_lib.Checkpointer(
    checkpoint_lib.checkpoint_dir(workdir), keep=0, read_only=True
  )
  step = checkpointer.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f'No checkpoint in {checkpointer.directory!r}.')
  meta = checkpoint_lib.read_meta(checkpointer.directory, step) or {}
  checkpoint_lib.check_tokenizer(
    meta.get('tokenizer'), tokenizer, f'Checkpoint {step} of {workdir!r}'
  )

  example = example_batch(workdir, config)
  abstract = sharding.abstract_params(model, example, mesh)
  params = checkpointer.restore_params(step, abstract)
  checkpointer.close()
  return Pretrained(
    config=config,
    model=model,
    params=params,
    tokenizer=tokenizer,
    step=step,
    mesh=mesh,
  )
