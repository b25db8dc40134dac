"""Tensor rules shared by the Hugging Face formats: HF tensors <-> our params.

A `Rule` maps some HF tensors (PyTorch names, [out, in] Linear weights) to
some of our params ('/'-joined paths, einsum-shaped kernels) and back; one
table per architecture serves both import and export, so the two cannot
disagree. A `Format` bundles one HF `model_type`'s table with its config
mapping and the HF classes (layouts) whose files it reads and writes.
"""

import dataclasses
import math
from collections.abc import Callable

import ml_collections
import numpy as np

from pretrain_lm.models.config import ModelConfig

Tensors = dict[str, np.ndarray]

# Parts whose HF names carry the class's base-model prefix ('bert.', ...).
PREFIXED_PARTS = ('body', 'pooler')


@dataclasses.dataclass(frozen=True)
class Rule:
  """`hf` tensors <-> `ours` params, with the maps both ways."""

  hf: tuple[str, ...]
  ours: tuple[str, ...]
  to_ours: Callable[..., tuple[np.ndarray, ...]]
  to_hf: Callable[..., tuple[np.ndarray, ...]]
  # What stores it: 'body' (the Transformer), 'pooler', BERT's 'mlm' and
  # 'nsp' heads, or 'lm' (untied logits, BART's final_logits_bias).
  part: str = 'body'


@dataclasses.dataclass(frozen=True)
class Layout:
  """An HF class's file: its base-model prefix and the parts it stores."""

  prefix: str
  parts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Format:
  """One HF model_type: config mapping, tensor rules and class layouts.

  `model_fields(hf_config)` gives the `model` section but for
  tie_embeddings, which only the tensors show: `output`, the untied output
  layer's name, absent or equal to `words`, the token table. `recipe(config,
  hf_config)` sets the objective and data fields of the imported run;
  `hf_config(cfg)` is the inverse of model_fields and raises ValueError for
  what the format cannot represent; `rules(cfg)` is the tensor table.
  `default_layout(param groups)` picks the class to export our own runs as.
  Names are unprefixed for the prefixed parts. `aliases` are names HF may
  store for a tied copy of another tensor; `ignored` are name suffixes of
  buffers HF rebuilds itself.
  """

  model_type: str
  family: str
  layouts: dict[str, Layout]
  model_fields: Callable[[dict], dict]
  recipe: Callable[[ml_collections.ConfigDict, dict], None]
  hf_config: Callable[[ModelConfig], dict]
  rules: Callable[[ModelConfig], list[Rule]]
  default_layout: Callable[[set[str]], str]
  words: str
  output: str
  aliases: dict[str, str] = dataclasses.field(default_factory=dict)
  ignored: tuple[str, ...] = ()


def _contiguous(*arrays) -> tuple[np.ndarray, ...]:
  return tuple(np.ascontiguousarray(a) for a in arrays)


def same(hf: str, ours: str, part: str = 'body') -> Rule:
  """A tensor stored alike on both sides (embedding tables, norm scales)."""
  return Rule((hf,), (ours,), _contiguous, _contiguous, part)


def vector(hf: str, ours: str, shape: tuple[int, ...], part='body') -> Rule:
  """A bias: flat in HF, e.g. [H, K] for our query bias."""
  return Rule(
    (hf,),
    (ours,),
    lambda b: _contiguous(b.reshape(shape)),
    lambda b: _contiguous(b.reshape(-1)),
    part,
  )


def linear(
  hf: str,
  ours: str,
  shape: tuple[int, ...],
  n_in: int,
  part: str = 'body',
  *,
  transposed: bool = True,
) -> Rule:
  """A dense kernel: ours is `shape` with `n_in` input dims first.

  torch.nn.Linear stores [out, in] (`transposed`); GPT-2's Conv1D stores
  [in, out].
  """
  flat = (math.prod(shape[:n_in]), math.prod(shape[n_in:]))

  def to_ours(w):
    return _contiguous((w.T if transposed else w).reshape(shape))

  def to_hf(k):
    k = k.reshape(flat)
    return _contiguous(k.T if transposed else k)

  return Rule((hf,), (ours,), to_ours, to_hf, part)


def dense(
  hf: str,
  ours: str,
  shape: tuple[int, ...],
  n_in: int,
  *,
  bias: bool,
  part: str = 'body',
  transposed: bool = True,
) -> list[Rule]:
  """`hf`.weight/.bias <-> `ours`_kernel/_bias (see `linear`).

  Without `bias` (a bias-free model of ours) export writes zeros: HF's
  class has the bias, and zero is what the model computes.
  """
  rules = [
    linear(
      f'{hf}.weight',
      f'{ours}_kernel',
      shape,
      n_in,
      part,
      transposed=transposed,
    )
  ]
  if bias:
    rules.append(vector(f'{hf}.bias', f'{ours}_bias', shape[n_in:], part))
  else:
    rules.append(zeros(f'{hf}.bias', (math.prod(shape[n_in:]),), part))
  return rules


def zeros(hf: str, shape: tuple[int, ...], part: str = 'body') -> Rule:
  """An HF tensor we do not model because it is zero; import checks it is."""

  def to_ours(t):
    if np.any(t != 0):
      raise ValueError(
        f'{hf} is not all zeros, and pretrain_lm has no such parameter.'
      )
    return ()

  return Rule((hf,), (), to_ours, lambda: (np.zeros(shape, np.float32),), part)


def norm(hf: str, ours: str, *, bias: bool = True, part='body') -> list[Rule]:
  """LayerNorm weight/bias (or T5's RMSNorm weight) <-> scale/bias."""
  rules = [same(f'{hf}.weight', f'{ours}/scale', part)]
  if bias:
    rules.append(same(f'{hf}.bias', f'{ours}/bias', part))
  return rules


def positions(hf: str, ours: str, offset: int) -> Rule:
  """A learned position table whose first `offset` rows are never used.

  RoBERTa's (fairseq's) positions start after the padding id, BART's at 2;
  ours start at 0, so import drops those rows and export writes zeros.
  """

  def to_hf(t):
    return _contiguous(
      np.concatenate([np.zeros((offset, t.shape[1]), t.dtype), t])
    )

  return Rule((hf,), (ours,), lambda t: _contiguous(t[offset:]), to_hf)


def transposed(hf: str, ours: str, part: str) -> Rule:
  """An untied output layer: HF's [V, D] weight <-> our [D, V] kernel."""

  def flip(t):
    return _contiguous(t.T)

  return Rule((hf,), (ours,), flip, flip, part)


def attention(
  hf: dict[str, str],
  ours: str,
  cfg: ModelConfig,
  *,
  bias: bool,
  out_bias: bool | None = None,
) -> list[Rule]:
  """q/k/v/out projections: HF Linear names by role -> `ours`/*_kernel."""
  D, H, K = cfg.emb_dim, cfg.num_heads, cfg.head_dim
  out_bias = bias if out_bias is None else out_bias
  rules = []
  for role in ('query', 'key', 'value'):
    rules += dense(hf[role], f'{ours}/{role}', (D, H, K), 1, bias=bias)
  rules += dense(hf['out'], f'{ours}/out', (H, K, D), 2, bias=out_bias)
  return rules


def require(cfg: ModelConfig, model_type: str, **wanted) -> None:
  """Raises one ValueError naming every field that `model_type` lacks."""
  wrong = []
  for name, want in wanted.items():
    got = getattr(cfg, name)
    ok = want(got) if callable(want) else got == want
    if not ok:
      wrong.append(
        f'model.{name}={got!r}'
        + ('' if callable(want) else f' (needs {want!r})')
      )
  if wrong:
    raise ValueError(
      f'The Hugging Face {model_type!r} architecture cannot represent '
      f'{", ".join(wrong)}.'
    )


def check_heads(cfg: ModelConfig, model_type: str) -> None:
  """HF's attention splits the width evenly: num_heads * head_dim = D."""
  if cfg.num_heads * cfg.head_dim != cfg.emb_dim:
    raise ValueError(
      f'The Hugging Face {model_type!r} architecture needs model.num_heads '
      f'* model.head_dim == model.emb_dim, got {cfg.num_heads} * '
      f'{cfg.head_dim} != {cfg.emb_dim}.'
    )


# HF `hidden_act` / `activation_function` names -> model.activation. The
# tanh-approximation GELU has several HF names; export writes 'gelu_new'.
ACTIVATIONS = {
  'gelu': 'gelu',
  'gelu_new': 'gelu_tanh',
  'gelu_pytorch_tanh': 'gelu_tanh',
  'gelu_fast': 'gelu_tanh',
  'relu': 'relu',
  'silu': 'silu',
  'swish': 'silu',
}
HF_ACTIVATIONS = {
  'gelu': 'gelu',
  'gelu_tanh': 'gelu_new',
  'relu': 'relu',
  'silu': 'silu',
}


def activation(name: str, where: str) -> str:
  """model.activation for an HF activation name; ValueError if unknown."""
  if name not in ACTIVATIONS:
    raise ValueError(
      f'{where}: activation {name!r} is not supported; known: '
      f'{sorted(ACTIVATIONS)}.'
    )
  return ACTIVATIONS[name]


def hf_activation(cfg: ModelConfig, model_type: str) -> str:
  if cfg.activation not in HF_ACTIVATIONS:
    raise ValueError(
      f'The Hugging Face {model_type!r} architecture cannot represent '
      f'model.activation={cfg.activation!r}; valid: {sorted(HF_ACTIVATIONS)}.'
    )
  return HF_ACTIVATIONS[cfg.activation]
