"""BERT and RoBERTa <-> the encoder family.

Both are post-LN encoders with learned positions, token types and an
embedding LayerNorm; they differ in names (`bert.`/`cls.predictions` vs
`roberta.`/`lm_head`) and in positions: RoBERTa's (fairseq's) start after
the padding id, so its table has pad_token_id + 1 unused leading rows.
"""

import functools

import ml_collections

from pretrain_lm.convert import layout
from pretrain_lm.convert.layout import Layout, Rule
from pretrain_lm.models.config import ModelConfig

WORDS = 'embeddings.word_embeddings.weight'


def _position_offset(model_type: str, pad_id: int) -> int:
  return pad_id + 1 if model_type == 'roberta' else 0


def _head_names(model_type: str) -> dict[str, str]:
  """HF names of the MLM head's tensors."""
  if model_type == 'roberta':
    head = 'lm_head.'
    return {
      'transform': head + 'dense',
      'norm': head + 'layer_norm',
      'bias': head + 'bias',
      'decoder': head + 'decoder.weight',
      'decoder_bias': head + 'decoder.bias',
    }
  head = 'cls.predictions.'
  return {
    'transform': head + 'transform.dense',
    'norm': head + 'transform.LayerNorm',
    'bias': head + 'bias',
    'decoder': head + 'decoder.weight',
    'decoder_bias': head + 'decoder.bias',
  }


def model_fields(hf: dict, *, model_type: str) -> dict:
  """The `model` section for a BertConfig / RobertaConfig dict."""
  if hf.get('position_embedding_type', 'absolute') != 'absolute':
    raise ValueError(
      f'position_embedding_type={hf["position_embedding_type"]!r}: only '
      "'absolute' positions are supported."
    )
  roberta = model_type == 'roberta'
  pad_id = hf.get('pad_token_id', 1 if roberta else 0)
  D, H = hf.get('hidden_size', 768), hf.get('num_attention_heads', 12)
  act = layout.activation(hf.get('hidden_act', 'gelu'), 'hidden_act')
  if roberta and act != 'gelu':
    # RobertaLMHead applies the exact GELU whatever hidden_act says.
    raise ValueError(f'RoBERTa with hidden_act={hf["hidden_act"]!r}.')
  return dict(
    family='encoder',
    vocab_size=hf.get('vocab_size', 50265 if roberta else 30522),
    num_layers=hf.get('num_hidden_layers', 12),
    emb_dim=D,
    num_heads=H,
    head_dim=D // H,
    mlp_dim=hf.get('intermediate_size', 3072),
    max_len=hf.get('max_position_embeddings', 512)
    - _position_offset(model_type, pad_id),
    type_vocab_size=hf.get('type_vocab_size', 1 if roberta else 2),
    activation=act,
    norm_type='layernorm',
    norm_position='post',
    embed_norm=True,
    layer_norm_eps=hf.get('layer_norm_eps', 1e-12),
    position='learned',
    pooler=True,
    pad_id=pad_id,
    dropout_rate=hf.get('hidden_dropout_prob', 0.1),
    attention_dropout_rate=hf.get('attention_probs_dropout_prob', 0.1),
    initializer_range=hf.get('initializer_range', 0.02),
  )


def recipe(c: ml_collections.ConfigDict, hf: dict, *, model_type: str):
  """MLM (with BERT's NSP when the checkpoint has its head)."""
  del hf
  c.objective.name = 'mlm'
  if model_type == 'roberta':
    c.data.packing = 'full_sentences'
    c.data.seq_len = min(512, c.model.max_len)
    c.optimizer.b2 = 0.98
  else:
    c.data.packing = 'doc_sentences'
    c.data.seq_len = min(128, c.model.max_len)


def hf_config(cfg: ModelConfig, *, model_type: str) -> dict:
  """config.json fields of `cfg`; ValueError if BERT cannot express it."""
  layout.require(
    cfg,
    model_type,
    family='encoder',
    norm_type='layernorm',
    norm_position='post',
    embed_norm=True,
    position='learned',
    embed_scale=False,
    attention_scale=True,
    share_layers=False,
    embed_dim=lambda e: e in (0, cfg.emb_dim),
    type_vocab_size=lambda n: n >= 1,
  )
  layout.check_heads(cfg, model_type)
  act = layout.hf_activation(cfg, model_type)
  if model_type == 'roberta' and act != 'gelu':
    raise ValueError('RoBERTa needs model.activation=gelu (its LM head).')
  return {
    'model_type': model_type,
    'vocab_size': cfg.vocab_size,
    'hidden_size': cfg.emb_dim,
    'num_hidden_layers': cfg.num_layers,
    'num_attention_heads': cfg.num_heads,
    'intermediate_size': cfg.mlp_dim,
    'hidden_act': act,
    'hidden_dropout_prob': cfg.dropout_rate,
    'attention_probs_dropout_prob': cfg.attention_dropout_rate,
    'max_position_embeddings': cfg.max_len
    + _position_offset(model_type, cfg.pad_id),
    'type_vocab_size': cfg.type_vocab_size,
    'initializer_range': cfg.initializer_range,
    'layer_norm_eps': cfg.layer_norm_eps,
    'position_embedding_type': 'absolute',
    'pad_token_id': cfg.pad_id,
    'tie_word_embeddings': cfg.tie_embeddings,
  }


def rules(cfg: ModelConfig, *, model_type: str) -> list[Rule]:
  """The BERT / RoBERTa tensor table: HF names <-> our param paths."""
  D, F, E = cfg.emb_dim, cfg.mlp_dim, cfg.token_dim
  bias = cfg.attention_bias
  offset = _position_offset(model_type, cfg.pad_id)
  out = [
    layout.same(WORDS, 'token_embed/embedding'),
    layout.positions(
      'embeddings.position_embeddings.weight',
      'embeddings/position_embed/embedding',
      offset,
    ),
    layout.same(
      'embeddings.token_type_embeddings.weight',
      'embeddings/token_type_embed/embedding',
    ),
    *layout.norm('embeddings.LayerNorm', 'embeddings/embed_norm'),
  ]
  for i in range(cfg.num_layers):
    hf, ours = f'encoder.layer.{i}.', f'encoder/layer_{i}/'
    names = ('query', 'key', 'value')
    out += layout.attention(
      {
        **{n: f'{hf}attention.self.{n}' for n in names},
        'out': f'{hf}attention.output.dense',
      },
      ours + 'attention',
      cfg,
      bias=bias,
    )
    out += layout.norm(
      f'{hf}attention.output.LayerNorm', ours + 'attention_norm'
    )
    out += layout.dense(
      f'{hf}intermediate.dense', ours + 'mlp/wi', (D, F), 1, bias=cfg.mlp_bias
    )
    out += layout.dense(
      f'{hf}output.dense', ours + 'mlp/wo', (F, D), 1, bias=cfg.mlp_bias
    )
    out += layout.norm(f'{hf}output.LayerNorm', ours + 'mlp_norm')
  out += layout.dense(
    'pooler.dense', 'pooler/pooler', (D, D), 1, bias=True, part='pooler'
  )

  names = _head_names(model_type)
  out += layout.dense(
    names['transform'], 'mlm_head/transform', (D, E), 1, bias=True, part='mlm'
  )
  out += layout.norm(names['norm'], 'mlm_head/transform_norm', part='mlm')
  out.append(layout.same(names['bias'], 'mlm_head/output_bias', 'mlm'))
  if not cfg.tie_embeddings:
    out.append(
      layout.transposed(names['decoder'], 'mlm_head/logits_kernel', 'mlm')
    )
  if model_type == 'bert':
    out += layout.dense(
      'cls.seq_relationship',
      'sentence_head/sentence',
      (D, 2),
      1,
      bias=True,
      part='nsp',
    )
  return out


def _default_layout(groups: set[str], *, model_type: str) -> str:
  if model_type == 'roberta':
    return 'RobertaForMaskedLM' if 'mlm_head' in groups else 'RobertaModel'
  if 'sentence_head' in groups:
    return 'BertForPreTraining'
  return 'BertForMaskedLM' if 'mlm_head' in groups else 'BertModel'


def _format(model_type: str) -> layout.Format:
  kw = dict(model_type=model_type)
  names = _head_names(model_type)
  if model_type == 'roberta':
    layouts = {
      'RobertaForMaskedLM': Layout('roberta.', ('body', 'mlm')),
      'RobertaModel': Layout('', ('body', 'pooler')),
    }
  else:
    layouts = {
      'BertForPreTraining': Layout('bert.', ('body', 'pooler', 'mlm', 'nsp')),
      'BertForMaskedLM': Layout('bert.', ('body', 'mlm')),
      'BertModel': Layout('', ('body', 'pooler')),
    }
  return layout.Format(
    model_type=model_type,
    family='encoder',
    layouts=layouts,
    model_fields=functools.partial(model_fields, **kw),
    recipe=functools.partial(recipe, **kw),
    hf_config=functools.partial(hf_config, **kw),
    rules=functools.partial(rules, **kw),
    default_layout=functools.partial(_default_layout, **kw),
    words=WORDS,
    output=names['decoder'],
    # HF's MLM decoder carries a tied copy of the head's bias.
    aliases={names['decoder_bias']: names['bias']},
    ignored=('embeddings.position_ids',),
  )


BERT = _format('bert')
ROBERTA = _format('roberta')
