"""BART <-> the encoder-decoder family.

Post-LN stacks with a LayerNorm on each stack's embeddings (our
embed_norm), learned positions that start at row 2 of HF's table (fairseq's
offset), optional sqrt(d_model) token scaling (scale_embedding ->
model.embed_scale), and a `final_logits_bias` buffer that is zero in the
released checkpoints: import checks it is, export writes zeros.
"""

import ml_collections

from pretrain_lm.convert import layout
from pretrain_lm.convert.layout import Layout, Rule
from pretrain_lm.models.config import ModelConfig

WORDS = 'shared.weight'
POSITION_OFFSET = 2


def _same_both_stacks(hf: dict, name: str, default):
  """A per-stack setting that our model has once: both must agree."""
  enc = hf.get(f'encoder_{name}', default)
  dec = hf.get(f'decoder_{name}', default)
  if enc != dec:
    raise ValueError(
      f'encoder_{name}={enc} != decoder_{name}={dec}: pretrain_lm uses one '
      'value for both stacks.'
    )
  return enc


def model_fields(hf: dict) -> dict:
  """The `model` section for a BartConfig dict."""
  for flag in ('normalize_before', 'add_final_layer_norm'):
    if hf.get(flag, False):  # mBART-style pre-LN stacks
      raise ValueError(f'{flag}=True is not supported.')
  D = hf.get('d_model', 1024)
  H = _same_both_stacks(hf, 'attention_heads', 16)
  return dict(
    family='encoder_decoder',
    vocab_size=hf.get('vocab_size', 50265),
    num_layers=hf.get('encoder_layers', 12),
    num_decoder_layers=hf.get('decoder_layers', 12),
    emb_dim=D,
    num_heads=H,
    head_dim=D // H,
    mlp_dim=_same_both_stacks(hf, 'ffn_dim', 4096),
    max_len=hf.get('max_position_embeddings', 1024),
    type_vocab_size=0,
    activation=layout.activation(
      hf.get('activation_function', 'gelu'), 'activation_function'
    ),
    norm_type='layernorm',
    norm_position='post',
    embed_norm=True,
    layer_norm_eps=1e-5,  # torch.nn.LayerNorm's default
    position='learned',
    embed_scale=bool(hf.get('scale_embedding', False)),
    dropout_rate=hf.get('dropout', 0.1),
    attention_dropout_rate=hf.get('attention_dropout', 0.0),
    initializer_range=hf.get('init_std', 0.02),
  )


def recipe(c: ml_collections.ConfigDict, hf: dict) -> None:
  """BART's denoising (configs/bart.py)."""
  del hf
  c.objective.name = 'denoising'
  c.data.tokenizer_type = 'bpe'
  c.data.packing = 'full_sentences'
  c.data.seq_len = min(512, c.model.max_len)
  c.optimizer.learning_rate = 4e-4
  c.optimizer.b2 = 0.98


def hf_config(cfg: ModelConfig) -> dict:
  """config.json fields of `cfg`; ValueError if BART cannot express it."""
  layout.require(
    cfg,
    'bart',
    family='encoder_decoder',
    norm_type='layernorm',
    norm_position='post',
    embed_norm=True,
    position='learned',
    attention_scale=True,
    output_scale=False,
    share_layers=False,
    type_vocab_size=0,
    layer_norm_eps=1e-5,
    embed_dim=lambda e: e in (0, cfg.emb_dim),
  )
  layout.check_heads(cfg, 'bart')
  return {
    'model_type': 'bart',
    'vocab_size': cfg.vocab_size,
    'd_model': cfg.emb_dim,
    'encoder_layers': cfg.num_layers,
    'decoder_layers': cfg.decoder_layers,
    'encoder_attention_heads': cfg.num_heads,
    'decoder_attention_heads': cfg.num_heads,
    'encoder_ffn_dim': cfg.mlp_dim,
    'decoder_ffn_dim': cfg.mlp_dim,
    'max_position_embeddings': cfg.max_len,
    'activation_function': layout.hf_activation(cfg, 'bart'),
    'dropout': cfg.dropout_rate,
    'attention_dropout': cfg.attention_dropout_rate,
    'activation_dropout': 0.0,
    'init_std': cfg.initializer_range,
    'scale_embedding': cfg.embed_scale,
    'is_encoder_decoder': True,
    'tie_word_embeddings': cfg.tie_embeddings,
  }


def rules(cfg: ModelConfig) -> list[Rule]:
  """The BART tensor table for `cfg`: HF names <-> our param paths."""
  D, F = cfg.emb_dim, cfg.mlp_dim
  out = [layout.same(WORDS, 'token_embed/embedding')]
  stacks = (('encoder', cfg.num_layers), ('decoder', cfg.decoder_layers))
  for stack, num_layers in stacks:
    out.append(
      layout.positions(
        f'{stack}.embed_positions.weight',
        f'{stack}_embeddings/position_embed/embedding',
        POSITION_OFFSET,
      )
    )
    out += layout.norm(
      f'{stack}.layernorm_embedding', f'{stack}_embeddings/embed_norm'
    )
    for i in range(num_layers):
      hf, ours = f'{stack}.layers.{i}.', f'{stack}/layer_{i}/'
      blocks = [('self_attn', 'attention')]
      if stack == 'decoder':
        blocks.append(('encoder_attn', 'cross_attention'))
      for hf_block, block in blocks:
        out += layout.attention(
          {
            'query': f'{hf}{hf_block}.q_proj',
            'key': f'{hf}{hf_block}.k_proj',
            'value': f'{hf}{hf_block}.v_proj',
            'out': f'{hf}{hf_block}.out_proj',
          },
          ours + block,
          cfg,
          bias=cfg.attention_bias,
        )
        out += layout.norm(f'{hf}{hf_block}_layer_norm', f'{ours}{block}_norm')
      out += layout.dense(
        hf + 'fc1', ours + 'mlp/wi', (D, F), 1, bias=cfg.mlp_bias
      )
      out += layout.dense(
        hf + 'fc2', ours + 'mlp/wo', (F, D), 1, bias=cfg.mlp_bias
      )
      out += layout.norm(hf + 'final_layer_norm', ours + 'mlp_norm')
  out.append(layout.zeros('final_logits_bias', (1, cfg.vocab_size), 'lm'))
  if not cfg.tie_embeddings:
    out.append(
      layout.transposed('lm_head.weight', 'lm_head/logits_kernel', 'lm')
    )
  return out


BART = layout.Format(
  model_type='bart',
  family='encoder_decoder',
  layouts={
    'BartForConditionalGeneration': Layout('model.', ('body', 'lm')),
    'BartModel': Layout('', ('body',)),
  },
  model_fields=model_fields,
  recipe=recipe,
  hf_config=hf_config,
  rules=rules,
  default_layout=lambda groups: 'BartForConditionalGeneration',
  words=WORDS,
  output='lm_head.weight',
  aliases={f'{s}.embed_tokens.weight': WORDS for s in ('encoder', 'decoder')},
)
