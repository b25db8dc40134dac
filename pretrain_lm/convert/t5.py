"""T5 (v1.0 and v1.1) <-> the encoder-decoder family.

Three numerical details differ from our defaults and are config switches:
HF's T5 does not divide q.k by sqrt(d_kv) (Mesh TF folds it into the
query's initialisation: model.attention_scale=False), v1.0 scales the final
decoder states by d_model**-0.5 before its tied output layer
(model.output_scale), and v1.1 unties that layer and uses a gated GELU.
The relative-position bias is stored in layer 0 of each stack and shared by
its layers, as our per-stack table is.
"""

import ml_collections
import numpy as np

from pretrain_lm.convert import layout
from pretrain_lm.convert.layout import Layout, Rule
from pretrain_lm.models.config import ModelConfig

WORDS = 'shared.weight'
# feed_forward_proj -> model.activation. 'gated-gelu' uses the tanh GELU
# (HF maps it to gelu_new), as our 'geglu' does.
ACTIVATIONS = {
  'relu': 'relu',
  'gelu': 'gelu',
  'gelu_new': 'gelu_tanh',
  'silu': 'silu',
  'gated-gelu': 'geglu',
  'gated-silu': 'swiglu',
}
HF_ACTIVATIONS = {v: k for k, v in ACTIVATIONS.items()}


def model_fields(hf: dict) -> dict:
  """The `model` section for a T5Config dict."""
  proj = hf.get('feed_forward_proj', 'relu')
  if proj not in ACTIVATIONS:
    raise ValueError(
      f'feed_forward_proj={proj!r} is not supported; known: '
      f'{sorted(ACTIVATIONS)}.'
    )
  # transformers 5 saves the scaling switch; older configs scale exactly
  # when the output layer is tied (v1.0).
  scale = hf.get('scale_decoder_outputs', hf.get('tie_word_embeddings', True))
  num_layers = hf.get('num_layers', 6)
  return dict(
    family='encoder_decoder',
    vocab_size=hf.get('vocab_size', 32128),
    num_layers=num_layers,
    num_decoder_layers=hf.get('num_decoder_layers') or num_layers,
    emb_dim=hf.get('d_model', 512),
    num_heads=hf.get('num_heads', 8),
    head_dim=hf.get('d_kv', 64),
    mlp_dim=hf.get('d_ff', 2048),
    max_len=hf.get('n_positions', 512),
    type_vocab_size=0,
    activation=ACTIVATIONS[proj],
    norm_type='rmsnorm',
    norm_position='pre',
    embed_norm=False,
    layer_norm_eps=hf.get('layer_norm_epsilon', 1e-6),
    position='relative',
    relative_buckets=hf.get('relative_attention_num_buckets', 32),
    relative_max_distance=hf.get('relative_attention_max_distance', 128),
    attention_scale=False,
    output_scale=bool(scale),
    attention_bias=False,
    mlp_bias=False,
    dropout_rate=hf.get('dropout_rate', 0.1),
    attention_dropout_rate=hf.get('dropout_rate', 0.1),
    initializer_range=0.05,
  )


def recipe(c: ml_collections.ConfigDict, hf: dict) -> None:
  """Span corruption over concatenated documents (configs/t5.py)."""
  del hf
  c.objective.name = 'span_corruption'
  c.data.packing = 'concat'
  c.data.seq_len = 512
  c.optimizer.learning_rate = 1e-3
  c.optimizer.weight_decay = 0.0


def hf_config(cfg: ModelConfig) -> dict:
  """config.json fields of `cfg`; ValueError if T5 cannot express it."""
  layout.require(
    cfg,
    't5',
    family='encoder_decoder',
    norm_type='rmsnorm',
    norm_position='pre',
    embed_norm=False,
    position='relative',
    embed_scale=False,
    share_layers=False,
    type_vocab_size=0,
    attention_bias=False,
    mlp_bias=False,
    embed_dim=lambda e: e in (0, cfg.emb_dim),
    activation=lambda a: a in HF_ACTIVATIONS,
  )
  return {
    'model_type': 't5',
    'vocab_size': cfg.vocab_size,
    'd_model': cfg.emb_dim,
    'd_kv': cfg.head_dim,
    'd_ff': cfg.mlp_dim,
    'num_layers': cfg.num_layers,
    'num_decoder_layers': cfg.decoder_layers,
    'num_heads': cfg.num_heads,
    'relative_attention_num_buckets': cfg.relative_buckets,
    'relative_attention_max_distance': cfg.relative_max_distance,
    'dropout_rate': cfg.dropout_rate,
    'layer_norm_epsilon': cfg.layer_norm_eps,
    'feed_forward_proj': HF_ACTIVATIONS[cfg.activation],
    'is_encoder_decoder': True,
    'tie_word_embeddings': cfg.tie_embeddings,
    'scale_decoder_outputs': cfg.output_scale,
  }


def _query(hf: str, ours: str, cfg: ModelConfig) -> Rule:
  """The query kernel; 1/sqrt(d_kv) folded in if our model scales q.k."""
  rule = layout.linear(hf, ours, (cfg.emb_dim, cfg.num_heads, cfg.head_dim), 1)
  if not cfg.attention_scale:
    return rule
  scale = np.float32(cfg.head_dim**-0.5)
  return Rule(
    rule.hf,
    rule.ours,
    lambda w: rule.to_ours(w / scale),
    lambda k: rule.to_hf(k * scale),
  )


def _attention(hf: str, ours: str, cfg: ModelConfig) -> list[Rule]:
  D, H, K = cfg.emb_dim, cfg.num_heads, cfg.head_dim
  return [
    _query(f'{hf}.q.weight', f'{ours}/query_kernel', cfg),
    layout.linear(f'{hf}.k.weight', f'{ours}/key_kernel', (D, H, K), 1),
    layout.linear(f'{hf}.v.weight', f'{ours}/value_kernel', (D, H, K), 1),
    layout.linear(f'{hf}.o.weight', f'{ours}/out_kernel', (H, K, D), 2),
  ]


def _mlp(hf: str, ours: str, cfg: ModelConfig) -> list[Rule]:
  D, F = cfg.emb_dim, cfg.mlp_dim
  wis = ('wi_0', 'wi_1') if cfg.is_glu else ('wi',)
  return [
    *(
      layout.linear(f'{hf}.{w}.weight', f'{ours}/{w}_kernel', (D, F), 1)
      for w in wis
    ),
    layout.linear(f'{hf}.wo.weight', f'{ours}/wo_kernel', (F, D), 1),
  ]


def rules(cfg: ModelConfig) -> list[Rule]:
  """The T5 tensor table for `cfg`: HF names <-> our param paths."""
  out = [layout.same(WORDS, 'token_embed/embedding')]
  stacks = (('encoder', cfg.num_layers), ('decoder', cfg.decoder_layers))
  for stack, num_layers in stacks:
    out.append(
      layout.same(
        f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight',
        f'{stack}/relative_bias',
      )
    )
    for i in range(num_layers):
      hf, ours = f'{stack}.block.{i}.layer.', f'{stack}/layer_{i}/'
      out += _attention(hf + '0.SelfAttention', ours + 'attention', cfg)
      out += layout.norm(
        hf + '0.layer_norm', ours + 'attention_norm', bias=False
      )
      mlp = 1
      if stack == 'decoder':
        out += _attention(
          hf + '1.EncDecAttention', ours + 'cross_attention', cfg
        )
        out += layout.norm(
          hf + '1.layer_norm', ours + 'cross_attention_norm', bias=False
        )
        mlp = 2
      out += _mlp(f'{hf}{mlp}.DenseReluDense', ours + 'mlp', cfg)
      out += layout.norm(f'{hf}{mlp}.layer_norm', ours + 'mlp_norm', bias=False)
    out += layout.norm(
      f'{stack}.final_layer_norm', f'{stack}/final_norm', bias=False
    )
  if not cfg.tie_embeddings:
    out.append(
      layout.transposed('lm_head.weight', 'lm_head/logits_kernel', 'lm')
    )
  return out


T5 = layout.Format(
  model_type='t5',
  family='encoder_decoder',
  layouts={
    'T5ForConditionalGeneration': Layout('', ('body', 'lm')),
    'T5Model': Layout('', ('body',)),
  },
  model_fields=model_fields,
  recipe=recipe,
  hf_config=hf_config,
  rules=rules,
  default_layout=lambda groups: 'T5ForConditionalGeneration',
  words=WORDS,
  output='lm_head.weight',
  aliases={f'{s}.embed_tokens.weight': WORDS for s in ('encoder', 'decoder')},
)
