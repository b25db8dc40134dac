"""The frozen ModelConfig every module takes, and the SIZES preset tables."""

import dataclasses
from typing import Any

import jax.numpy as jnp

# Valid values of the string-choice fields, checked at construction.
CHOICES = {
  # The keys of pretrain_lm.models.MODELS (a test checks they agree).
  'family': (
    'encoder',
    'decoder',
    'encoder_decoder',
    'electra',
    'bilm',
    'plm',
  ),
  'norm_type': ('layernorm', 'rmsnorm'),
  'norm_position': ('pre', 'post'),
  'activation': ('relu', 'gelu', 'gelu_tanh', 'silu', 'geglu', 'swiglu'),
  'position': ('learned', 'sinusoidal', 'relative', 'rotary'),
  'remat': ('none', 'full', 'dots', 'dots_no_batch'),
  'attention_impl': ('einsum', 'xla', 'cudnn', 'auto'),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture hyper-parameters; configlib.base_config documents them."""

  family: str = 'encoder'
  size: str = ''
  vocab_size: int = 30522
  num_layers: int = 12
  num_decoder_layers: int = 0  # encoder-decoder: 0 means num_layers
  emb_dim: int = 768
  embed_dim: int = 0  # factorised token embedding width E; 0 = emb_dim
  num_heads: int = 12
  head_dim: int = 64
  mlp_dim: int = 3072
  max_len: int = 512
  type_vocab_size: int = 2  # 0: no token-type embedding
  activation: str = 'gelu'
  norm_type: str = 'layernorm'
  norm_position: str = 'post'
  embed_norm: bool = True
  layer_norm_eps: float = 1e-12
  position: str = 'learned'
  embed_scale: bool = False
  attention_scale: bool = True
  output_scale: bool = False
  relative_buckets: int = 32
  relative_max_distance: int = 128
  rotary_base: float = 10_000.0
  tie_embeddings: bool = True
  share_layers: bool = False
  attention_bias: bool = True
  mlp_bias: bool = True
  pooler: bool = False
  pad_id: int = 0
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  initializer_range: float = 0.02
  scaled_residual_init: bool = False
  generator_width: float = 0.25
  scan_layers: bool = False
  remat: str = 'none'
  attention_impl: str = 'einsum'
  logits_chunk: int = 0
  vocab_multiple: int = 1  # token table rows padded to a multiple of this
  dtype: str = 'float32'
  param_dtype: str = 'float32'

  def __post_init__(self):
    for name, valid in CHOICES.items():
      if getattr(self, name) not in valid:
        raise ValueError(
          f'model.{name}={getattr(self, name)!r}; valid: {list(valid)}.'
        )
    for name in (
      'vocab_size',
      'num_layers',
      'emb_dim',
      'num_heads',
      'head_dim',
      'mlp_dim',
      'max_len',
      'vocab_multiple',
    ):
      if getattr(self, name) <= 0:
        raise ValueError(f'model.{name}={getattr(self, name)} must be > 0.')
    if self.position == 'rotary' and self.head_dim % 2:
      raise ValueError(
        f'model.position=rotary needs an even model.head_dim, got '
        f'{self.head_dim}.'
      )
    if not 0 < self.generator_width <= 1:
      raise ValueError(
        f'model.generator_width={self.generator_width} must be in (0, 1].'
      )

  @classmethod
  def from_config(cls, model_config: Any) -> 'ModelConfig':
    """Builds it from the `model` section of a run config (a ConfigDict)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in model_config.items() if k in fields})

  @property
  def token_dim(self) -> int:
    """E: the width of the token embedding table (factorised if < D)."""
    return self.embed_dim or self.emb_dim

  @property
  def padded_vocab(self) -> int:
    """The token table's rows: vocab_size up to a multiple of
    vocab_multiple. Logits beyond vocab_size are cut off at the head."""
    m = self.vocab_multiple
    return -(-self.vocab_size // m) * m

  @property
  def decoder_layers(self) -> int:
    return self.num_decoder_layers or self.num_layers

  @property
  def is_glu(self) -> bool:
    return self.activation in ('geglu', 'swiglu')

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)


# Body sizes per architecture line, as the papers define them; the config
# files pick a table and a key (`size=`). head_dim is emb_dim / num_heads
# unless a preset gives it.
SIZES: dict[str, dict[str, dict[str, int]]] = {
  # tiny/mini/small/medium: the compact BERTs of Turc et al. (2019);
  # base/large: Devlin et al. (2019).
  'bert': dict(
    tiny=dict(num_layers=2, emb_dim=128, num_heads=2, mlp_dim=512),
    mini=dict(num_layers=4, emb_dim=256, num_heads=4, mlp_dim=1024),
    small=dict(num_layers=4, emb_dim=512, num_heads=8, mlp_dim=2048),
    medium=dict(num_layers=8, emb_dim=512, num_heads=8, mlp_dim=2048),
    base=dict(num_layers=12, emb_dim=768, num_heads=12, mlp_dim=3072),
    large=dict(num_layers=24, emb_dim=1024, num_heads=16, mlp_dim=4096),
  ),
  # GPT-2 (Radford et al., 2019); tiny is nanoGPT's CPU Shakespeare model.
  'gpt2': dict(
    tiny=dict(num_layers=4, emb_dim=128, num_heads=4, mlp_dim=512),
    small=dict(num_layers=12, emb_dim=768, num_heads=12, mlp_dim=3072),
    medium=dict(num_layers=24, emb_dim=1024, num_heads=16, mlp_dim=4096),
    large=dict(num_layers=36, emb_dim=1280, num_heads=20, mlp_dim=5120),
    xl=dict(num_layers=48, emb_dim=1600, num_heads=25, mlp_dim=6400),
  ),
  # T5 v1.0 (Raffel et al., 2020): num_layers per stack.
  't5': dict(
    tiny=dict(num_layers=2, emb_dim=128, num_heads=2, mlp_dim=512),
    small=dict(num_layers=6, emb_dim=512, num_heads=8, mlp_dim=2048),
    base=dict(num_layers=12, emb_dim=768, num_heads=12, mlp_dim=3072),
    large=dict(num_layers=24, emb_dim=1024, num_heads=16, mlp_dim=4096),
  ),
  # T5 v1.1 (GeGLU): narrower feed-forward, 64-wide heads throughout.
  't5_v1_1': dict(
    tiny=dict(num_layers=2, emb_dim=128, num_heads=2, mlp_dim=320),
    small=dict(
      num_layers=8, emb_dim=512, num_heads=6, head_dim=64, mlp_dim=1024
    ),
    base=dict(num_layers=12, emb_dim=768, num_heads=12, mlp_dim=2048),
    large=dict(num_layers=24, emb_dim=1024, num_heads=16, mlp_dim=2816),
  ),
  # BART (Lewis et al., 2020): num_layers per stack.
  'bart': dict(
    tiny=dict(num_layers=2, emb_dim=128, num_heads=2, mlp_dim=512),
    base=dict(num_layers=6, emb_dim=768, num_heads=12, mlp_dim=3072),
    large=dict(num_layers=12, emb_dim=1024, num_heads=16, mlp_dim=4096),
  ),
  # ALBERT (Lan et al., 2020): E = 128 for every size.
  'albert': dict(
    tiny=dict(num_layers=2, emb_dim=128, num_heads=2, mlp_dim=512),
    base=dict(num_layers=12, emb_dim=768, num_heads=12, mlp_dim=3072),
    large=dict(num_layers=24, emb_dim=1024, num_heads=16, mlp_dim=4096),
    xlarge=dict(num_layers=24, emb_dim=2048, num_heads=16, mlp_dim=8192),
  ),
  # ELECTRA (Clark et al., 2020): the discriminator's body.
  'electra': dict(
    # tiny: 4 heads so that a half-width generator keeps 2 (one per
    # 'tensor' shard on a 2-way tensor axis).
    tiny=dict(num_layers=2, emb_dim=128, num_heads=4, mlp_dim=512),
    small=dict(num_layers=12, emb_dim=256, num_heads=4, mlp_dim=1024),
    base=dict(num_layers=12, emb_dim=768, num_heads=12, mlp_dim=3072),
    large=dict(num_layers=24, emb_dim=1024, num_heads=16, mlp_dim=4096),
  ),
}


def size_preset(size: str, table: str = 'bert') -> dict[str, int]:
  """SIZES[table][size], with head_dim = emb_dim / num_heads by default."""
  if size not in SIZES[table]:
    raise ValueError(
      f'Unknown model size {size!r} for {table}; valid: {sorted(SIZES[table])}.'
    )
  preset = dict(SIZES[table][size])
  preset.setdefault('head_dim', preset['emb_dim'] // preset['num_heads'])
  return preset
