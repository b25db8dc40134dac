"""What every Pretrained method stands on: the loaded objects and the rows.

`Core` holds the run's config, model, params and tokenizer, runs the model
under its mesh, frames texts as pretraining rows and feeds rows to a jitted
function in evenly sized, mesh-split calls. The per-purpose methods
(fill_mask.py, generate.py, embed.py) are mixins on top of it.
"""

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn

from pretrain_lm import sharding
from pretrain_lm.data import tokenizer as tokenizer_lib

MASK_TEXT = '[MASK]'
# The shortest padded row length: shorter buckets only add compilations.
_MIN_BUCKET = 8


def bucket(n: int, cap: int) -> int:
  """n rounded up to a power of two (at least _MIN_BUCKET), at most cap."""
  return min(max(_MIN_BUCKET, 1 << max(n - 1, 0).bit_length()), cap)


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def pad_rows(rows: Sequence[Sequence[int]], length: int, pad_id: int):
  """Rows of ids -> (ids int32[N, length], mask int32[N, length])."""
  ids_NL = np.full((len(rows), length), pad_id, np.int32)
  mask_NL = np.zeros((len(rows), length), np.int32)
  for i, row in enumerate(rows):
    ids_NL[i, : len(row)] = row
    mask_NL[i, : len(row)] = 1
  return ids_NL, mask_NL


def as_list(texts: str | Sequence[str]) -> tuple[list[str], bool]:
  """(texts as a list, whether a single string was given)."""
  if isinstance(texts, str):
    return [texts], True
  texts = list(texts)
  if not texts:
    raise ValueError('Got no texts.')
  return texts, False


@dataclasses.dataclass
class Core:
  """The loaded objects each per-purpose mixin builds on.

  Its fields are Pretrained's attributes (documented there): config, model,
  params, tokenizer, step and mesh.
  """

  config: ml_collections.ConfigDict
  model: nn.Module
  params: Any
  tokenizer: tokenizer_lib.Tokenizer
  step: int
  mesh: jax.sharding.Mesh | None = None
  # Jitted functions by (method, static options); jax.jit keeps one
  # compilation per input shape inside each.
  _jitted: dict = dataclasses.field(
    default_factory=dict, init=False, repr=False, compare=False
  )

  @property
  def family(self) -> str:
    """The model family (a pretrain_lm.models.MODELS key)."""
    return self.model.cfg.family

  @contextlib.contextmanager
  def context(self):
    """The mesh and logical axis rules the model's constraints need.

    Wrap direct `m.model.apply(...)` calls in it when loaded with a mesh
    (the methods here enter it themselves); without a mesh it does nothing.

    Example:
      with m.context():
        out = m.model.apply({'params': m.params}, batch,
                            deterministic=True)
    """
    if self.mesh is None:
      yield
      return
    with (
      jax.set_mesh(self.mesh),
      nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES),
    ):
      yield

  def __call__(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """The model's outputs for a feature batch, without dropout.

    Args:
      batch: the model's input features as arrays, e.g. {'input_ids':
        int32[B, L]} (an encoder-decoder takes 'encoder_input_ids' and
        'decoder_input_ids'); see the family's model in pretrain_lm.models.

    Returns:
      The model's output dict, e.g. 'hidden' [B, L, D] and 'logits' or
      'mlm_logits' [B, L, V].

    Example:
      m = pretrain_lm.load('workdirs/gpt_tiny')
      ids = [m.tokenizer.encode('ROMEO:')]
      m({'input_ids': ids})['logits'].shape  # (1, 6, model vocab_size)
    """
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    fn = self._jit(
      ('apply',),
      lambda: functools.partial(self.model.apply, deterministic=True),
    )
    with self.context():
      return fn({'params': self.params}, batch)

  # Framing.

  @property
  def _starts_with_cls(self) -> bool:
    """Whether pretraining rows started with [CLS] (not 'concat' packing)."""
    packing = self.config.get('data', {}).get('packing')
    if packing is None:  # a config without it: the family's usual packing
      return self.family not in ('decoder', 'bilm')
    return packing != 'concat'

  def _frame(self, ids: list[int]) -> list[int]:
    """A text's ids as a pretraining row: ([CLS]) ids [SEP]."""
    tok = self.tokenizer
    return ([tok.cls_id] if self._starts_with_cls else []) + ids + [tok.sep_id]

  def _mask_texts(self) -> list[str]:
    """The texts that stand for the mask token: '[MASK]', the tokenizer's."""
    own = getattr(self.tokenizer, 'mask_token', None)
    return [MASK_TEXT] + ([own] if own and own != MASK_TEXT else [])

  def _markers(self, sentinels: bool) -> re.Pattern:
    """A regex whose split() keeps the mask (and sentinel) markers."""
    options = [re.escape(m) for m in self._mask_texts()]
    if sentinels:
      options.append(r'<extra_id_\d+>')
    return re.compile('(' + '|'.join(options) + ')')

  def _check_mask_token(self) -> None:
    if self.tokenizer.mask_id < 0:  # tokenizer_lib.NO_ID
      raise ValueError(
        f'Tokenizer {self.tokenizer.path!r} has no mask token, so a text '
        f'cannot hold {MASK_TEXT!r}.'
      )

  # Shapes and calls.

  @property
  def _batch_shards(self) -> int:
    """How many ways the mesh splits a batch (1 without a mesh)."""
    if self.mesh is None:
      return 1
    axes = sharding.batch_sharding(self.mesh).spec[0]
    axes = (axes,) if isinstance(axes, str) else axes or ()
    return math.prod(self.mesh.shape[a] for a in axes)

  def _rows_per_call(self, num_rows: int, batch_size: int) -> int:
    """Rows of one call: a power of two up to batch_size, split evenly."""
    rows = min(1 << max(num_rows - 1, 0).bit_length(), max(batch_size, 1))
    return round_up(rows, self._batch_shards)

  def _put(self, array: np.ndarray) -> jax.Array | np.ndarray:
    """Rows onto the mesh's batch axes (left to jit without a mesh)."""
    if self.mesh is None:
      return array
    return jax.device_put(array, sharding.batch_sharding(self.mesh))

  def _jit(self, key: tuple, make):
    """The jitted function for `key`, built by make() on first use."""
    if key not in self._jitted:
      self._jitted[key] = jax.jit(make())
    return self._jitted[key]

  def _run_rows(self, fn, arrays: dict[str, np.ndarray], batch_size: int):
    """fn(params, batch) over the rows in chunks: the chunks' outputs.

    Every chunk has the same row count (the last one padded with copies of
    its first row), so fn compiles once per row length; the caller joins
    the outputs and drops the padding rows at the end.
    """
    num_rows = len(arrays['input_ids'])
    chunk = self._rows_per_call(num_rows, batch_size)
    outputs = []
    with self.context():
      for start in range(0, num_rows, chunk):
        part = {k: v[start : start + chunk] for k, v in arrays.items()}
        short = chunk - len(part['input_ids'])
        part = {
          k: np.concatenate([v, np.repeat(v[:1], short, axis=0)])
          for k, v in part.items()
        }
        out = fn(self.params, {k: self._put(v) for k, v in part.items()})
        outputs.append(np.asarray(out))
    return outputs
