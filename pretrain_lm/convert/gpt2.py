"""GPT-2 <-> the decoder family.

GPT-2 stores its projections as Conv1D weights, [in, out] (not Linear's
[out, in]), and fuses query, key and value into one `c_attn`.
"""

import ml_collections
import numpy as np

from pretrain_lm.convert import layout
from pretrain_lm.convert.layout import Layout, Rule
from pretrain_lm.models.config import ModelConfig

WORDS = 'wte.weight'


def model_fields(hf: dict) -> dict:
  """The `model` section for a GPT2Config dict."""
  if hf.get('scale_attn_by_inverse_layer_idx', False):
    raise ValueError('scale_attn_by_inverse_layer_idx=True is not supported.')
  D, H = hf.get('n_embd', 768), hf.get('n_head', 12)
  return dict(
    family='decoder',
    vocab_size=hf.get('vocab_size', 50257),
    num_layers=hf.get('n_layer', 12),
    emb_dim=D,
    num_heads=H,
    head_dim=D // H,
    mlp_dim=hf.get('n_inner') or 4 * D,
    max_len=hf.get('n_positions', 1024),
    type_vocab_size=0,
    activation=layout.activation(
      hf.get('activation_function', 'gelu_new'), 'activation_function'
    ),
    norm_type='layernorm',
    norm_position='pre',
    embed_norm=False,
    layer_norm_eps=hf.get('layer_norm_epsilon', 1e-5),
    position='learned',
    attention_scale=hf.get('scale_attn_weights', True),
    scaled_residual_init=True,
    dropout_rate=hf.get('resid_pdrop', 0.1),
    attention_dropout_rate=hf.get('attn_pdrop', 0.1),
    initializer_range=hf.get('initializer_range', 0.02),
  )


def recipe(c: ml_collections.ConfigDict, hf: dict) -> None:
  """Next-token prediction over concatenated documents (configs/gpt.py)."""
  del hf
  c.objective.name = 'clm'
  c.data.tokenizer_type = 'bpe'
  c.data.packing = 'concat'
  c.data.seq_len = c.model.max_len
  c.optimizer.learning_rate = 6e-4
  c.optimizer.b2 = 0.95
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.1
  c.optimizer.warmup_steps = 2000
  c.optimizer.decay = 'cosine'
  c.optimizer.final_learning_rate = 6e-5


def hf_config(cfg: ModelConfig) -> dict:
  """config.json fields of `cfg`; ValueError if GPT-2 cannot express it."""
  layout.require(
    cfg,
    'gpt2',
    family='decoder',
    norm_type='layernorm',
    norm_position='pre',
    embed_norm=False,
    position='learned',
    embed_scale=False,
    output_scale=False,
    share_layers=False,
    type_vocab_size=0,
    embed_dim=lambda e: e in (0, cfg.emb_dim),
  )
  layout.check_heads(cfg, 'gpt2')
  return {
    'model_type': 'gpt2',
    'vocab_size': cfg.vocab_size,
    'n_positions': cfg.max_len,
    'n_embd': cfg.emb_dim,
    'n_layer': cfg.num_layers,
    'n_head': cfg.num_heads,
    'n_inner': cfg.mlp_dim,
    'activation_function': layout.hf_activation(cfg, 'gpt2'),
    'resid_pdrop': cfg.dropout_rate,
    'embd_pdrop': cfg.dropout_rate,
    'attn_pdrop': cfg.attention_dropout_rate,
    'layer_norm_epsilon': cfg.layer_norm_eps,
    'initializer_range': cfg.initializer_range,
    'scale_attn_weights': cfg.attention_scale,
    'tie_word_embeddings': cfg.tie_embeddings,
  }


def _fused_qkv(hf: str, ours: str, cfg: ModelConfig) -> list[Rule]:
  """c_attn's [D, 3D] weight and [3D] bias <-> query/key/value."""
  D, H, K = cfg.emb_dim, cfg.num_heads, cfg.head_dim
  roles = ('query', 'key', 'value')

  def split(shape):
    return lambda t: tuple(
      np.ascontiguousarray(x.reshape(shape)) for x in np.split(t, 3, axis=-1)
    )

  def join(*ts):
    flat = [t.reshape(*t.shape[: t.ndim - 2], -1) for t in ts]
    return (np.ascontiguousarray(np.concatenate(flat, axis=-1)),)

  rules = [
    Rule(
      (f'{hf}.weight',),
      tuple(f'{ours}/{r}_kernel' for r in roles),
      split((D, H, K)),
      join,
    )
  ]
  if cfg.attention_bias:
    rules.append(
      Rule(
        (f'{hf}.bias',),
        tuple(f'{ours}/{r}_bias' for r in roles),
        split((H, K)),
        join,
      )
    )
  else:
    rules.append(layout.zeros(f'{hf}.bias', (3 * H * K,)))
  return rules


def rules(cfg: ModelConfig) -> list[Rule]:
  """The GPT-2 tensor table for `cfg`: HF names <-> our param paths."""
  D, F, H, K = cfg.emb_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim
  conv = dict(transposed=False)
  out = [
    layout.same(WORDS, 'token_embed/embedding'),
    layout.same('wpe.weight', 'embeddings/position_embed/embedding'),
  ]
  for i in range(cfg.num_layers):
    hf, ours = f'h.{i}.', f'decoder/layer_{i}/'
    out += layout.norm(hf + 'ln_1', ours + 'attention_norm')
    out += _fused_qkv(hf + 'attn.c_attn', ours + 'attention', cfg)
    out += layout.dense(
      hf + 'attn.c_proj',
      ours + 'attention/out',
      (H, K, D),
      2,
      bias=cfg.attention_bias,
      **conv,
    )
    out += layout.norm(hf + 'ln_2', ours + 'mlp_norm')
    out += layout.dense(
      hf + 'mlp.c_fc', ours + 'mlp/wi', (D, F), 1, bias=cfg.mlp_bias, **conv
    )
    out += layout.dense(
      hf + 'mlp.c_proj', ours + 'mlp/wo', (F, D), 1, bias=cfg.mlp_bias, **conv
    )
  out += layout.norm('ln_f', 'decoder/final_norm')
  if not cfg.tie_embeddings:
    out.append(
      layout.transposed('lm_head.weight', 'lm_head/logits_kernel', 'lm')
    )
  return out


GPT2 = layout.Format(
  model_type='gpt2',
  family='decoder',
  layouts={
    'GPT2LMHeadModel': Layout('transformer.', ('body', 'lm')),
    'GPT2Model': Layout('', ('body',)),
  },
  model_fields=model_fields,
  recipe=recipe,
  hf_config=hf_config,
  rules=rules,
  default_layout=lambda groups: 'GPT2LMHeadModel',
  words=WORDS,
  output='lm_head.weight',
  # The causal-mask buffers of older checkpoints.
  ignored=('.attn.bias', '.attn.masked_bias'),
)
