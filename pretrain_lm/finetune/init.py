"""The pretrained body a fine-tuning run starts from (the config's `init`).

Its pretraining config and tokenizer, read from the pretraining workdir
`init.workdir` (or, when a run resumes, from the copies in its own
workdir); its params, restored from a pretraining checkpoint; and its top
`init.reinit_top_layers` layers, renewed.
"""

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf
from jax.experimental import multihost_utils

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.finetune import config as config_lib
from pretrain_lm.finetune import model as model_lib
from pretrain_lm.finetune import optimizer
from pretrain_lm.models import ModelConfig

# The body's pretraining config in a fine-tuning workdir.
INIT_CONFIG_FILE = 'init_config.json'


@dataclasses.dataclass(frozen=True)
class Body:
  """The body's pretraining config, model config and tokenizer."""

  init_config: dict[str, Any]
  model_config: ModelConfig
  tokenizer: tokenizer_lib.Tokenizer
  # Read from the fine-tuning workdir's copies: a run there resumes.
  resuming: bool


def read_body(config: ml_collections.ConfigDict, workdir: str) -> Body:
  """The body `config` fine-tunes in `workdir` (an absolute path), checked:
  a family fine-tuning serves, init.reinit_top_layers it can renew."""
  c = config
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
  init_config = workdir_lib.read_json(
    os.path.join(source, INIT_CONFIG_FILE if resuming else 'config.json')
  )
  model_config = ModelConfig.from_config(init_config['model'])
  if model_config.family not in config_lib.FAMILIES:
    raise ValueError(
      f'Fine-tuning a {model_config.family!r} model is not '
      f'supported; families: {list(config_lib.FAMILIES)}.'
    )
  check_reinit_top_layers(c.init.reinit_top_layers, model_config)
  tokenizer = tokenizer_lib.load_tokenizer(
    os.path.join(source, tokenizer_lib.WORKDIR_FILENAME)
  )
  return Body(init_config, model_config, tokenizer, resuming)


def copy_init_files(
  init_workdir: str, workdir: str, init_config: dict[str, Any]
) -> None:
  """The body's pretraining config and tokenizer, so the workdir loads
  (and resumes) on its own."""
  name = tokenizer_lib.WORKDIR_FILENAME
  tf.io.gfile.copy(
    os.path.join(init_workdir, name),
    os.path.join(workdir, name),
    overwrite=True,
  )
  # Written last: its presence marks the workdir as resumable.
  workdir_lib.write_json(os.path.join(workdir, INIT_CONFIG_FILE), init_config)


def pretrained_body(
  config: ml_collections.ConfigDict,
  abstract_body,
  fresh_body,
  model_config: ModelConfig,
  tokenizer: tokenizer_lib.Tokenizer,
):
  """The body's params of a fresh run: init.workdir's checkpoint
  (init.step, else its latest), its top init.reinit_top_layers layers
  taken from `fresh_body`."""
  c = config
  body = restore_backbone(
    c.init.workdir,
    c.init.step or None,
    abstract_body,
    model_config.family,
    tokenizer=tokenizer,
  )
  return reinit_top_layers(
    body, fresh_body, model_config, c.init.reinit_top_layers
  )


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
