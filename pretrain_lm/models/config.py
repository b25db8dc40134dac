"""The frozen ModelConfig every module takes, and the SIZES preset table."""

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture hyper-parameters; see configlib.base_config for meanings."""

  family: str = 'encoder'
  size: str = ''
  vocab_size: int = 30522
  num_layers: int = 12
  emb_dim: int = 768
  num_heads: int = 12
  head_dim: int = 64
  mlp_dim: int = 3072
  max_len: int = 512
  type_vocab_size: int = 2
  activation: str = 'gelu'
  norm_position: str = 'post'
  layer_norm_eps: float = 1e-12
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  initializer_range: float = 0.02
  dtype: str = 'float32'
  param_dtype: str = 'float32'

  def __post_init__(self):
    if self.norm_position not in ('pre', 'post'):
      raise ValueError(
        f"model.norm_position={self.norm_position!r}; expected 'pre' or 'post'."
      )
    for name in (
      'vocab_size',
      'num_layers',
      'emb_dim',
      'num_heads',
      'head_dim',
      'mlp_dim',
      'max_len',
    ):
      if getattr(self, name) <= 0:
        raise ValueError(f'model.{name}={getattr(self, name)} must be > 0.')

  @classmethod
  def from_config(cls, model_config: Any) -> 'ModelConfig':
    """Builds it from the `model` section of a run config (a ConfigDict)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in model_config.items() if k in fields})

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)


# Transformer body sizes. BERT tiny/mini/small/medium are the compact BERTs of
# Turc et al. (2019), base/large those of Devlin et al. (2019).
SIZES: dict[str, dict[str, int]] = {
  'tiny': dict(num_layers=2, emb_dim=128, num_heads=2, mlp_dim=512),
  'mini': dict(num_layers=4, emb_dim=256, num_heads=4, mlp_dim=1024),
  'small': dict(num_layers=4, emb_dim=512, num_heads=8, mlp_dim=2048),
  'medium': dict(num_layers=8, emb_dim=512, num_heads=8, mlp_dim=2048),
  'base': dict(num_layers=12, emb_dim=768, num_heads=12, mlp_dim=3072),
  'large': dict(num_layers=24, emb_dim=1024, num_heads=16, mlp_dim=4096),
}


def size_preset(size: str) -> dict[str, int]:
  """The SIZES entry for `size`, with head_dim = emb_dim / num_heads."""
  if size not in SIZES:
    raise ValueError(f'Unknown model size {size!r}; valid: {sorted(SIZES)}.')
  preset = dict(SIZES[size])
  preset['head_dim'] = preset['emb_dim'] // preset['num_heads']
  return preset
