"""ULMFiT's fine-tuning options as optax transforms, and the schedules.

Howard & Ruder (2018): discriminative learning rates (each layer's lr
decays by a factor per layer from the top), the slanted triangular schedule,
and gradual unfreezing from the top layer. Each layer's depth is read from
its parameter path (`layer_<i>`, a scanned stack's 'layers'), so every
family and layout gets them; BERT's warmup + linear decay is the default.
"""

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from pretrain_lm.finetune import model as model_lib
from pretrain_lm.models import ModelConfig
from pretrain_lm.training import optimizer as optimizer_lib


def slanted_triangular(
  peak: float, num_steps: int, cut_frac: float, ratio: float
) -> optax.Schedule:
  """ULMFiT's slanted triangular learning rate (Howard & Ruder, 2018, eq. 3).

  cut = floor(T * cut_frac); p = t / cut before it, else
  1 - (t - cut) / (cut * (1 / cut_frac - 1)); lr = peak * (1 + p (ratio -
  1)) / ratio. p is kept >= 0 where flooring makes the decay end early.
  """
  cut = max(int(num_steps * cut_frac), 1)

  def schedule(step):
    t = jnp.asarray(step, jnp.float32)
    p = jnp.where(t < cut, t / cut, 1 - (t - cut) / (cut * (1 / cut_frac - 1)))
    return peak * (1 + jnp.maximum(p, 0.0) * (ratio - 1)) / ratio

  return schedule


def learning_rate_schedule(
  opt: ml_collections.ConfigDict, num_steps: int
) -> optax.Schedule:
  """BERT's warmup + linear decay to 0, or ULMFiT's slanted triangle."""
  if opt.decay == 'slanted_triangular':
    return slanted_triangular(
      opt.learning_rate, num_steps, opt.cut_frac, opt.ratio
    )
  # BERT's run_classifier: int(num_train_steps * warmup_proportion).
  warmup = int(num_steps * opt.warmup_fraction)
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, opt.learning_rate, warmup),
      optax.linear_schedule(opt.learning_rate, 0.0, max(num_steps - warmup, 1)),
    ],
    [warmup],
  )


_LAYER = re.compile(r'layer_(\d+)$')
# Body parts that sit above every layer: trained like the head.
_ABOVE_LAYERS = ('pooler', 'sentence_head', 'mlm_head', 'lm_head')


def num_layers(cfg: ModelConfig) -> int:
  """L: the layers between the embeddings and the head, all stacks."""
  if model_lib.backbone_family(cfg.family) == 'encoder_decoder':
    return cfg.num_layers + cfg.decoder_layers
  return cfg.num_layers


def layer_depth(names: tuple[str, ...], cfg: ModelConfig) -> int | np.ndarray:
  """Where a parameter sits: 0 embeddings, l = 1..L layer l, L + 1 head.

  A scanned stack's params (name 'layers', layers stacked on axis 0) get
  one depth per layer. An encoder-decoder's decoder layers sit above its
  encoder's; each stack's final norm at its top layer; ALBERT's shared
  layer at the top (it is every layer). Both directions of a biLM share
  depths. Other body params (token, position and type tables, T5's
  relative-bias tables) count as embeddings.
  """
  total = num_layers(cfg)
  if not names or names[0] != 'backbone':
    return total + 1
  stacked = model_lib.backbone_family(cfg.family) == 'encoder_decoder'
  offset = cfg.num_layers if stacked and 'decoder' in names else 0
  top = offset + (cfg.decoder_layers if offset else cfg.num_layers)
  for name in names[1:]:
    if match := _LAYER.match(name):
      return offset + int(match.group(1)) + 1
    if name == 'layers':
      return offset + np.arange(1, top - offset + 1)
    if name in ('shared_layer', 'final_norm'):
      return top
    if name in _ABOVE_LAYERS:
      return total + 1
  return 0


def path_names(path) -> tuple[str, ...]:
  """A tree path's keys as strings: ('backbone', 'encoder', ...)."""
  return tuple(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


class _StepState(NamedTuple):
  count: jax.Array


def scale_by_layer(
  factor: Callable[[tuple[str, ...], jax.Array], Any],
) -> optax.GradientTransformation:
  """Multiplies each update by factor(param path, step).

  The factor broadcasts against the update from its leading axis, so a
  scanned stack's [layers, ...] params can take one factor per layer.
  """

  def init(params):
    del params
    return _StepState(count=jnp.zeros((), jnp.int32))

  def update(updates, state, params=None):
    del params

    def scale(path, u):
      f = jnp.asarray(factor(path_names(path), state.count))
      f = f.reshape(f.shape + (1,) * (u.ndim - f.ndim))
      # where, not a product: a frozen param's update is exactly +0.
      return jnp.where(f == 0, 0, u * f.astype(u.dtype)).astype(u.dtype)

    updates = jax.tree_util.tree_map_with_path(scale, updates)
    return updates, _StepState(count=state.count + 1)

  return optax.GradientTransformation(init, update)


def discriminative_lr(
  cfg: ModelConfig, decay: float
) -> optax.GradientTransformation:
  """ULMFiT's discriminative fine-tuning: layer l's lr x decay^(L - l).

  The head and the top layer keep the full rate, the embeddings get
  decay^L.
  """
  total = num_layers(cfg)

  def factor(names, step):
    del step
    depth = layer_depth(names, cfg)
    return np.float32(decay) ** np.maximum(total - np.asarray(depth), 0)

  return scale_by_layer(factor)


def freeze_layers(
  cfg: ModelConfig, unfreeze_every: int, freeze_backbone: bool
) -> optax.GradientTransformation:
  """Zeroes the updates of frozen params (AdamW's decay included).

  Gradual unfreezing (ULMFiT): the first `unfreeze_every` steps train only
  the head, then each such period one more layer from the top. A frozen
  body never trains (ELMo's feature-based use).
  """
  total = num_layers(cfg)

  def factor(names, step):
    if freeze_backbone:
      return np.float32(names[0] != 'backbone')
    if not unfreeze_every:
      return np.float32(1.0)
    lowest = total + 1 - step // unfreeze_every
    return (np.asarray(layer_depth(names, cfg)) >= lowest).astype(jnp.float32)

  return scale_by_layer(factor)


def skip_unreached(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """`inner`, except that a param whose gradient is exactly zero keeps its
  value and its optimizer state (AdamW's moments; no decay).

  Cross-view training's steps each reach part of the params: a labelled
  batch the task head, an unlabelled one the auxiliary heads (the body
  both). Without this, AdamW's momentum would keep moving the heads a
  step did not train, and its decay shrink them; with it, each kind of
  step updates what its loss reaches, as one optimizer op per loss does
  in the paper's TensorFlow code.
  """

  def update(grads, state, params=None):
    updates, new_state = inner.update(grads, state, params)
    reached = jax.tree.map(lambda g: jnp.any(g != 0), grads)
    updates = jax.tree.map(
      lambda u, r: jnp.where(r, u, jnp.zeros_like(u)), updates, reached
    )
    shape = jax.tree.structure(grads)

    def param_shaped(x) -> bool:  # AdamW's mu and nu mirror the params
      return jax.tree.structure(x) == shape

    def keep(new, old):
      if not param_shaped(new):  # counts, masked states: the new ones
        return new
      return jax.tree.map(lambda n, o, r: jnp.where(r, n, o), new, old, reached)

    new_state = jax.tree.map(keep, new_state, state, is_leaf=param_shaped)
    return updates, new_state

  return optax.GradientTransformation(inner.init, update)


def make_optimizer(
  opt: ml_collections.ConfigDict,
  num_steps: int,
  cfg: ModelConfig,
  *,
  unfreeze_every: int = 0,
  freeze_backbone: bool = False,
  skip_unreached_params: bool = False,
):
  """AdamW with clipping and ULMFiT's options; returns (tx, schedule).

  skip_unreached_params: see skip_unreached (cross-view training).
  """
  schedule = learning_rate_schedule(opt, num_steps)
  chain = optimizer_lib.adamw_chain(opt, schedule)
  # Scaling AdamW's final update scales its learning rate, decay included.
  if opt.layer_lr_decay != 1.0:
    chain.append(discriminative_lr(cfg, opt.layer_lr_decay))
  if unfreeze_every or freeze_backbone:
    chain.append(freeze_layers(cfg, unfreeze_every, freeze_backbone))
  tx = optax.chain(*chain)
  if skip_unreached_params:
    tx = skip_unreached(tx)
  return tx, schedule
