"""embed and embed_sentences: token states per layer, pooled vectors."""

import dataclasses
import functools
import warnings
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from pretrain_lm.models import MODELS
from pretrain_lm.models import encoder_decoder as encoder_decoder_lib
from pretrain_lm.pretrained import core

# Families whose model returns every layer's states with collect_states.
_COLLECT_STATES_FAMILIES = ('encoder', 'decoder', 'encoder_decoder')
POOLINGS = ('mean', 'max', 'cls', 'last')


@dataclasses.dataclass
class Embeddings:
  """embed's answer: numpy arrays, rows in the order of the texts.

  Attributes:
    states: float32 token states, [N, L, D] for one layer (an int or
      'last'), [S, N, L, D] for S layers (a list or 'all').
    mask: int32[N, L], 1 on the row's tokens (specials included), 0 on
      padding.
    ids: int32[N, L], the token ids (pad_id on padding).
    layers: the state indices in `states`: 0 is the embedding output, k the
      output of layer k.
    pooled: with pooling, float32 [N, D] or [S, N, D]; else None.
  """

  states: np.ndarray
  mask: np.ndarray
  ids: np.ndarray
  layers: tuple[int, ...]
  pooled: np.ndarray | None = None


class EmbedMixin(core.Core):
  """Pretrained.embed and .embed_sentences (every family)."""

  @property
  def num_states(self) -> int:
    """Token states per row: the embedding output, then every layer."""
    return self.model.cfg.num_layers + 1

  def _states_fn(self, layers: tuple[int, ...]):
    """fn(params, batch) -> the selected states [S, B, L, D]."""
    cfg, family = self.model.cfg, self.family
    select = jnp.asarray(layers)

    if family == 'encoder_decoder':
      model = encoder_decoder_lib.EncoderDecoderModel(cfg, collect_states=True)

      def states(params, batch):
        (_, states_NBLD), _ = model.apply(
          {'params': params},
          {
            'encoder_input_ids': batch['input_ids'],
            'encoder_segment_ids': batch['segment_ids'],
          },
          deterministic=True,
          method=encoder_decoder_lib.EncoderDecoderModel.encode,
        )
        return states_NBLD[select].astype(jnp.float32)

      return states
    if family in _COLLECT_STATES_FAMILIES:
      model = MODELS[family](cfg, collect_states=True)
    else:
      model = self.model

    def states(params, batch):
      if family == 'electra':
        # One masked slot of weight 0: nothing is replaced, so the
        # discriminator reads the text itself.
        dummy = jnp.zeros((batch['input_ids'].shape[0], 1), jnp.int32)
        batch = dict(
          batch,
          masked_positions=dummy,
          masked_ids=dummy,
          masked_weights=dummy.astype(jnp.float32),
        )
      out = model.apply({'params': params}, batch, deterministic=True)
      if 'layer_states' in out:
        return out['layer_states'][select].astype(jnp.float32)
      return out['hidden'][None].astype(jnp.float32)

    return states

  def _layer_indices(self, layers) -> tuple[tuple[int, ...], bool]:
    """(state indices in [0, num_states), whether to drop the layer axis)."""
    n = self.num_states
    if isinstance(layers, str):
      if layers not in ('last', 'all'):
        raise ValueError(
          f"layers={layers!r}: use 'last', 'all', an int or a list of ints."
        )
      squeeze = layers == 'last'
      indices = [n - 1] if squeeze else list(range(n))
    else:
      squeeze = isinstance(layers, (int, np.integer))
      indices = [int(layers)] if squeeze else [int(i) for i in layers]
    for i in indices:
      if not -n <= i < n:
        raise ValueError(
          f'Layer {i} out of range: this model has {n} states (0 = the '
          f'embedding output, {n - 1} = the last layer).'
        )
    indices = tuple(i % n for i in indices)
    per_layer = self.family in (*_COLLECT_STATES_FAMILIES, 'bilm')
    if not per_layer and indices != (n - 1,):
      raise ValueError(
        f'The {self.family!r} family gives only its last layer '
        f"(layers='last'), not layers={layers!r}."
      )
    return indices, squeeze

  def embed(
    self,
    texts: str | Sequence[str],
    layers: str | int | Sequence[int] = 'last',
    pooling: str | None = None,
    batch_size: int = 32,
  ) -> Embeddings:
    """Token states of texts, per layer: frozen features for a probe.

    Texts are framed as pretraining rows ([CLS] text [SEP], or text [SEP]
    for 'concat' families), truncated to model.max_len with a warning, and
    padded to one length; padding does not change the real tokens' states.
    An encoder-decoder gives its encoder's states; bilm both directions'
    side by side (2D wide).

    Args:
      texts: a text or a list of texts (N rows).
      layers: 'last', 'all' (the embedding output, then every layer), a
        state index (0 = embedding output, -1 = last) or a list of them.
      pooling: None, or one vector per row: 'mean' / 'max' over its real
        tokens, 'cls' its first token ([CLS] families only), 'last' its last
        real token ([SEP]; what a causal model has read all of).
      batch_size: the most rows per model call.

    Returns:
      Embeddings (numpy arrays).

    Example:
      m = pretrain_lm.load('workdirs/quickstart')  # make quickstart
      feats = m.embed(['a short text', 'another'], layers='all',
                      pooling='mean')
      feats.states.shape  # (num_states, 2, L, D)
      feats.pooled.shape  # (num_states, 2, D)
    """
    indices, squeeze = self._layer_indices(layers)
    if pooling not in (None, *POOLINGS):
      raise ValueError(f'pooling={pooling!r} is not None or one of {POOLINGS}.')
    if pooling == 'cls' and not self._starts_with_cls:
      raise ValueError(
        f"pooling='cls': this model's rows have no [CLS] ({self.family!r} "
        "family, 'concat' packing); use 'last', 'mean' or 'max'."
      )
    texts, _ = core.as_list(texts)
    max_len = self.model.cfg.max_len
    rows = []
    for t in texts:
      row = self._frame(self.tokenizer.encode(t))
      if len(row) > max_len:
        warnings.warn(
          f'Truncating a text of {len(row)} tokens to model.max_len='
          f'{max_len}: {t[:40]!r}...',
          stacklevel=2,
        )
        row = row[: max_len - 1] + [self.tokenizer.sep_id]
      rows.append(row)
    length = core.bucket(max(map(len, rows)), max_len)
    ids_NL, mask_NL = core.pad_rows(rows, length, self.tokenizer.pad_id)
    fn = self._jit(
      ('embed', indices), functools.partial(self._states_fn, indices)
    )
    outputs = self._run_rows(
      fn, {'input_ids': ids_NL, 'segment_ids': mask_NL}, batch_size
    )
    states_SNLD = np.concatenate(outputs, axis=1)[:, : len(texts)]
    pooled_SND = (
      None if pooling is None else pool(states_SNLD, mask_NL, pooling)
    )
    if squeeze:
      states_SNLD = states_SNLD[0]
      pooled_SND = None if pooled_SND is None else pooled_SND[0]
    return Embeddings(states_SNLD, mask_NL, ids_NL, indices, pooled_SND)

  def embed_sentences(
    self,
    texts: str | Sequence[str],
    pooling: str = 'mean',
    normalize: bool = True,
    layer: int | str = 'last',
    batch_size: int = 32,
  ) -> np.ndarray:
    """One vector per text, float32 [N, D] (Sentence-BERT's pooling).

    Args:
      texts: a text or a list of texts.
      pooling: 'mean' (over the real tokens), 'max', 'cls' or 'last'.
      normalize: scale each vector to unit L2 norm (cosine = dot product).
      layer: the state pooled ('last', or an index as in embed).
      batch_size: the most rows per model call.

    Returns:
      float32[N, D], rows in the order of the texts.

    Example:
      m = pretrain_lm.load('workdirs/quickstart')  # make quickstart
      v = m.embed_sentences(['a cat sat', 'a dog sat', 'stocks fell'])
      v @ v.T  # cosine similarities
    """
    if isinstance(layer, str) and layer != 'last':
      raise ValueError(f"layer={layer!r}: use 'last' or one state index.")
    vectors_ND = self.embed(
      texts, layers=layer, pooling=pooling, batch_size=batch_size
    ).pooled
    if normalize:
      norm_N1 = np.linalg.norm(vectors_ND, axis=-1, keepdims=True)
      vectors_ND = vectors_ND / np.maximum(norm_N1, 1e-12)
    return vectors_ND


def pool(states_SNLD: np.ndarray, mask_NL: np.ndarray, pooling: str):
  """Per-row vectors of token states (embed's pooling).

  Args:
    states_SNLD: float token states [S, N, L, D].
    mask_NL: 1 on each row's tokens, 0 on padding.
    pooling: 'mean' or 'max' over the row's tokens, 'cls' its first token,
      'last' its last one.

  Returns:
    float [S, N, D].

  Example:
    feats = m.embed(texts, layers='all')
    pretrained.pool(feats.states, feats.mask, 'max')
  """
  mask_1NL1 = mask_NL[None, :, :, None].astype(bool)
  if pooling == 'mean':
    total = np.where(mask_1NL1, states_SNLD, 0).sum(axis=2)
    return total / mask_NL.sum(axis=1)[None, :, None]
  if pooling == 'max':
    return np.where(mask_1NL1, states_SNLD, -np.inf).max(axis=2)
  if pooling == 'cls':
    return states_SNLD[:, :, 0]
  last_N = mask_NL.sum(axis=1) - 1
  return states_SNLD[:, np.arange(mask_NL.shape[0]), last_N]
