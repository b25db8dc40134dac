"""The train state, its abstract shapes and shardings, and its creation."""

import contextlib
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm import sharding


@flax.struct.dataclass
class TrainState:
  """Everything a step changes; the whole of it is checkpointed."""

  step: jax.Array
  params: Any
  opt_state: Any
  # Raw key data (uint32[2]): the base key for dropout, folded with the step
  # so a resumed run draws exactly the masks it would have drawn.
  rng: jax.Array


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


@contextlib.contextmanager
def context(mesh: jax.sharding.Mesh):
  """Mesh + logical rules, needed while tracing the model's constraints."""
  with (
    jax.set_mesh(mesh),
    nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES),
  ):
    yield
