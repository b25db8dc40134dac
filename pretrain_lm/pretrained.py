"""Loading a trained workdir in Python: `pretrain_lm.load(workdir)`."""

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import tensorflow as tf
from flax import linen as nn

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import sharding
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, ModelConfig


@dataclasses.dataclass
class Pretrained:
  """A model, its params and tokenizer: plain objects, nothing hidden."""

  config: ml_collections.ConfigDict
  model: nn.Module
  params: Any
  tokenizer: tokenizer_lib.Tokenizer
  step: int

  def __call__(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """The model's outputs (e.g. `hidden`) for a feature batch, no dropout."""
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    return self.model.apply({'params': self.params}, batch, deterministic=True)


def example_batch(workdir: str, config) -> dict[str, jax.Array]:
  """A one-row batch with the run's feature shapes (to build the params)."""
  path = os.path.join(workdir, checkpoint_lib.BATCH_SPEC_FILE)
  if not tf.io.gfile.exists(path):  # a workdir from before the spec file
    return {'input_ids': jnp.zeros((1, config.data.seq_len), jnp.int32)}
  spec = checkpoint_lib.read_json(path)
  return {
    k: jnp.zeros((1, *shape), dtype) for k, (shape, dtype) in spec.items()
  }


def load(
  workdir: str, step: int | None = None, mesh: jax.sharding.Mesh | None = None
) -> Pretrained:
  """Loads checkpoint `step` (default: the latest) of a training workdir.

  Without a mesh the params land on the first local device; with one they are
  restored straight into the rule table's shardings.
  """
  config_path = os.path.join(workdir, 'config.json')
  if not tf.io.gfile.exists(config_path):
    raise FileNotFoundError(
      f'{workdir!r} is not a pretrain_lm workdir: no config.json in it.'
    )
  config = ml_collections.ConfigDict(checkpoint_lib.read_json(config_path))
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

  example = example_batch(workdir, config)
  boxed = jax.eval_shape(
    lambda: model.init(jax.random.key(0), example, deterministic=True)
  )['params']
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda _: device, nn.meta.unbox(boxed))
  else:
    shardings = sharding.logical_to_sharding(nn.get_partition_spec(boxed), mesh)
  abstract = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    nn.meta.unbox(boxed),
    shardings,
  )
  params = checkpointer.restore_params(step, abstract)
  checkpointer.close()
  return Pretrained(
    config=config, model=model, params=params, tokenizer=tokenizer, step=step
  )
