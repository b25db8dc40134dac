"""The fine-tuning model: a pretrained body named `backbone` and a task head.

The body is `MODELS[family](cfg)` itself, so its parameter subtree is a
pretraining workdir's params minus the heads fine-tuning does not call (the
MLM head, NSP's classifier) and restores from it by a partial restore. Heads
(B batch, L length, D width, C classes, N layer states):

  classification / regression - a vector per row (pooled as `pooling`
      says), dropout, dense D -> C: `logits` [B, C] (regression: [B]).
  span - dense D -> 2 on every token: `start_logits`, `end_logits` [B, L],
      padding at MASKED_LOGIT (BERT's SQuAD head).
  token - dropout, dense D -> C per token: `token_logits` [B, L, C].
  lm - no head of its own: the body's language-model head, restored with
      it, gives `logits` [B, L, V] (an encoder-decoder's decoder length;
      text2text.py lays out the rows).

CoVe (McCann et al., 2017; `cove`) runs an encoder-decoder's encoder alone:
its final states (or the scalar mix of its layers) after the token table's
rows, [E(w); CoVe(w)] as the paper's [GloVe(w); CoVe(w)], feed the same
heads. The paper's task model is a biattentive classification network;
here it is the heads above (mean-pooled dense, or dense per token).

Sentence-BERT's siamese heads (`siamese`) embed two sentences u, v with the
same body: classification reads (u, v, |u - v|), regression is cos(u, v).
T5 classifies text-to-text instead (`label_sequences`): the encoder reads
the row, the decoder each class's label word, and `logits` [B, C] are the
words' log-likelihoods (Raffel et al., 2020, section 2.4).

Cross-view training (Clark et al., 2018; `cvt_views`) adds auxiliary heads,
one per restricted view of the input, to a classification or token head.
On an unlabelled batch (one with `cvt_weight`) the model returns the
primary head's predictions on the whole input, without dropout and
without gradient (`cvt_teacher`), and each auxiliary head's on its view
(`cvt_<view>`); losses.cvt_loss trains the views to match. The views
(config.CVT_VIEWS): 'forward' / 'backward', an encoder's states with each
token attending only to itself and the tokens before / after it (the paper's
forward and backward LSTM states); for a token head also 'future' /
'past', the forward state of the token before / backward state of the
token after (each token's prediction without the token itself); and
'mask', the states of the input with a random cvt_mask_rate of its tokens
replaced by the mask token (any family). A sentence-level auxiliary head
mean-pools its view, except 'mask', which pools as the primary head does.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.finetune import config as config_lib
from pretrain_lm.models import MODELS, layers
from pretrain_lm.models.config import ModelConfig

Array = jax.Array

# Where a span head's padding logits sit: far below any real logit, yet
# finite, so softmax, log-softmax and temperature scaling stay NaN-free.
MASKED_LOGIT = -1e9


def backbone_family(family: str) -> str:
  """The MODELS key of the body: ELECTRA fine-tunes its discriminator."""
  return 'encoder' if family == 'electra' else family


# Where a pretraining family keeps the body's params when they are not where
# the fine-tuning body has them: body subtree name -> pretraining name.
PRETRAINED_NAMES = {'electra': {'encoder': 'discriminator'}}


def resolve_pooling(
  pooling: str,
  family: str,
  has_pooler: bool,
  scalar_mix: bool,
  siamese: bool = False,
  cove: bool = False,
) -> str:
  """The pooling 'auto' stands for, and a check of an explicit one."""
  if pooling == 'pooler' and (not has_pooler or scalar_mix):
    raise ValueError(
      "head.pooling='pooler' needs a body pretrained with model.pooler and "
      'no head.scalar_mix.'
    )
  if pooling != 'auto':
    return pooling
  if family in ('decoder', 'encoder_decoder') and not cove:
    # A causal stack's last real token is the only one that has read the
    # whole row (GPT; BART's final decoder token).
    return 'last'
  if scalar_mix or siamese or cove or family == 'bilm':
    # ELMo's and CoVe's features have no trained summary token;
    # Sentence-BERT found the mean better than [CLS] or max. Average them.
    return 'mean'
  return 'pooler' if has_pooler else 'cls'


def cosine(u_BD: Array, v_BD: Array) -> Array:
  """The cosine similarity of each row pair, float32 [B]."""
  u, v = u_BD.astype(jnp.float32), v_BD.astype(jnp.float32)
  dot = jnp.sum(u * v, axis=-1)
  norms = jnp.linalg.norm(u, axis=-1) * jnp.linalg.norm(v, axis=-1)
  return dot / jnp.maximum(norms, 1e-8)


def backbone_inputs(batch: dict[str, Array], family: str) -> dict:
  """The body's feature dict from a fine-tuning row batch.

  An encoder-decoder reads the same tokens in both stacks (BART's
  classification recipe): the decoder's state at a token has read the whole
  encoded row and the row up to that token. A generative row brings its
  own decoder_input_ids (the target, teacher-forced).
  """
  ids, mask = batch['input_ids'], batch['input_mask']
  if family == 'encoder_decoder':
    return {
      'encoder_input_ids': ids,
      'encoder_input_mask': mask,
      'decoder_input_ids': batch.get('decoder_input_ids', ids),
    }
  inputs = {'input_ids': ids, 'input_mask': mask}
  if 'token_type_ids' in batch:
    inputs['token_type_ids'] = batch['token_type_ids']
  return inputs


# The families whose body has an encoder to run alone (T5, BART, UL2's
# encoder-decoder), for CoVe.
COVE_FAMILIES = ('encoder_decoder',)


def cove_features(
  body: nn.Module, rows: dict[str, Array], *, deterministic: bool
) -> dict[str, Array]:
  """CoVe's inputs from an encoder-decoder body, its decoder never run.

  `hidden` is the encoder's output [B, L, D], `embeddings` the token
  table's rows of the ids [B, L, E] (no scale, positions or norm: the
  paper's GloVe half is a plain lookup), and with the body's
  collect_states `layer_states` the encoder's [N + 1, B, L, D].
  """
  encoded, _ = body.encode(
    {
      'encoder_input_ids': rows['input_ids'],
      'encoder_input_mask': rows['input_mask'],
    },
    deterministic=deterministic,
  )
  outputs = {'embeddings': body.token_embed(rows['input_ids'])}
  if body.collect_states:  # a pair (output, layer states)
    encoded, outputs['layer_states'] = encoded
  outputs['hidden'] = encoded
  return outputs


# The views that read an encoder's forward-only attention (the others of
# 'forward' to 'past' read its backward-only attention).
_FORWARD_VIEWS = ('forward', 'future')


def check_cvt_views(views: tuple[str, ...], head: str, family: str) -> None:
  """Raises ValueError unless each view can be built for this head and body."""
  for view in views:
    if view not in config_lib.CVT_VIEWS:
      raise ValueError(
        f'cvt.views: {view!r}; valid: {list(config_lib.CVT_VIEWS)}.'
      )
    if view in ('future', 'past') and head != 'token':
      raise ValueError(
        f"cvt.views: {view!r} predicts a token's tag without the token; "
        f'it needs a token head, not {head!r}.'
      )
    if view != 'mask' and backbone_family(family) != 'encoder':
      raise ValueError(
        f'cvt.views: {view!r} restricts the attention of a bidirectional '
        f'encoder (BERT, RoBERTa, ALBERT, ELECTRA); a {family!r} body has '
        "only the 'mask' view."
      )


def default_cvt_views(head: str, family: str) -> tuple[str, ...]:
  """The paper's views for tagging, or their sentence-level analogue."""
  if backbone_family(family) != 'encoder':
    return ('mask',)
  if head == 'token':
    return ('forward', 'backward', 'future', 'past')
  return ('forward', 'backward', 'mask')


def shift(x_BLD: Array, offset: int) -> Array:
  """x at position t + offset (zeros past either end): future is -1."""
  zeros = jnp.zeros_like(x_BLD[:, : abs(offset)])
  if offset < 0:
    return jnp.concatenate([zeros, x_BLD[:, :offset]], axis=1)
  return jnp.concatenate([x_BLD[:, offset:], zeros], axis=1)


def mask_tokens(
  rng: Array, rows: dict[str, Array], rate: float, mask_id: int, keep_ids
) -> dict[str, Array]:
  """`rows` with each real token outside keep_ids replaced by mask_id with
  probability `rate`."""
  ids_BL = rows['input_ids']
  candidate = rows['input_mask'] > 0
  for i in keep_ids:
    candidate = jnp.logical_and(candidate, ids_BL != i)
  hit = jnp.logical_and(
    candidate, jax.random.bernoulli(rng, rate, ids_BL.shape)
  )
  return dict(rows, input_ids=jnp.where(hit, mask_id, ids_BL))


def pool(x_BLD: Array, mask_BL: Array, pooling: str) -> Array:
  """One vector per row: [CLS], the last real token, or mean/max of real."""
  m_BL1 = mask_BL[..., None].astype(x_BLD.dtype)
  if pooling == 'cls':
    return x_BLD[:, 0]
  if pooling == 'last':
    last_B = jnp.maximum(jnp.sum(mask_BL, axis=-1) - 1, 0)
    return jnp.take_along_axis(x_BLD, last_B[:, None, None], axis=1)[:, 0]
  if pooling == 'mean':
    count_B1 = jnp.maximum(jnp.sum(m_BL1, axis=1), 1.0)
    return jnp.sum(x_BLD * m_BL1, axis=1) / count_B1
  if pooling == 'max':
    return jnp.max(jnp.where(m_BL1 > 0, x_BLD, MASKED_LOGIT), axis=1)
  raise ValueError(f'Unknown pooling {pooling!r}.')


def masked_layer_norm(x_NBLD: Array, mask_BL: Array, eps: float = 1e-12):
  """Each layer of each row normalised over its real tokens and width.

  AllenNLP's ScalarMix pools the statistics over the whole batch; per row,
  a prediction does not depend on the rows batched with it.
  """
  m = mask_BL[None, :, :, None].astype(x_NBLD.dtype)
  count = jnp.maximum(jnp.sum(m, axis=(2, 3), keepdims=True), 1.0)
  count = count * x_NBLD.shape[-1]
  mean = jnp.sum(x_NBLD * m, axis=(2, 3), keepdims=True) / count
  var = jnp.sum(jnp.square((x_NBLD - mean) * m), axis=(2, 3), keepdims=True)
  return (x_NBLD - mean) / jnp.sqrt(var / count + eps)


class ScalarMix(nn.Module):
  """ELMo's task-specific layer mix (Peters et al., 2018, eq. 1).

  gamma * sum_j softmax(w)_j * h_j over the N layer states, optionally
  layer-normalising each h_j first (the paper's section 3.3).
  """

  layer_norm: bool

  @nn.compact
  def __call__(self, states_NBLD: Array, mask_BL: Array) -> Array:
    N = states_NBLD.shape[0]
    w_N = self.param(
      'weights',
      nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
      (N,),
      jnp.float32,
    )
    gamma = self.param(
      'gamma',
      nn.with_logical_partitioning(nn.initializers.ones, ()),
      (),
      jnp.float32,
    )
    x_NBLD = states_NBLD.astype(jnp.float32)
    if self.layer_norm:
      x_NBLD = masked_layer_norm(x_NBLD, mask_BL)
    s_N = jax.nn.softmax(w_N)
    return gamma * jnp.einsum('N,NBLD->BLD', s_N, x_NBLD)


class FinetuneModel(nn.Module):
  """A pretrained body and a task head; returns the head's outputs.

  The body runs without dropout and without gradient when frozen (ELMo's
  feature-based use); the optimizer leaves its params unchanged too.
  """

  cfg: ModelConfig
  head: str  # one of config.HEADS
  num_labels: int
  pooling: str = 'auto'
  dropout: float = 0.1
  scalar_mix: bool = False
  mix_layer_norm: bool = False
  freeze_backbone: bool = False
  # Text-to-text (T5): each class's decoder ids, start token to end token.
  label_sequences: tuple[tuple[int, ...], ...] = ()
  # Sentence-BERT: the batch holds a second sentence as b_input_ids, ...
  siamese: bool = False
  # CoVe: the encoder alone, after the token table's rows when
  # cove_embeddings.
  cove: bool = False
  cove_embeddings: bool = True
  # Cross-view training: the auxiliary heads' views (config.CVT_VIEWS),
  # the mask view's rate and token, and the ids it never masks ([CLS],
  # [SEP]).
  cvt_views: tuple[str, ...] = ()
  cvt_mask_rate: float = 0.15
  cvt_mask_id: int = 0
  cvt_keep_ids: tuple[int, ...] = ()

  def __post_init__(self):
    # Checked as the model is built, before anything compiles.
    if self.cove and backbone_family(self.cfg.family) not in COVE_FAMILIES:
      raise ValueError(
        'head.cove reads the encoder of an encoder-decoder (model.family '
        f"{COVE_FAMILIES[0]!r}: the t5, bart and ul2 configs); this body's "
        f'model.family is {self.cfg.family!r}.'
      )
    if self.cove and (self.label_sequences or self.head == 'lm'):
      raise ValueError(
        'head.cove feeds a classification, span or token head; a text '
        "generating one (head 'lm', head.text_to_text) needs the decoder."
      )
    if self.cvt_views:
      if self.head not in ('classification', 'token'):
        raise ValueError(
          'Cross-view training (cvt) serves classification and token '
          f'heads, not {self.head!r}.'
        )
      if self.label_sequences or self.siamese or self.cove:
        raise ValueError(
          'Cross-view training (cvt) needs a plain classification or token '
          'head: not with head.text_to_text, head.siamese or head.cove.'
        )
      check_cvt_views(self.cvt_views, self.head, self.cfg.family)
    super().__post_init__()

  @nn.compact
  def __call__(self, batch: dict[str, Array], *, deterministic: bool):
    """The head's outputs on a batch (the module docstring lists them)."""
    # Long by design: the body, the layer mix and dropout are made once in
    # this compact scope, and the closures on them (encode, sentence,
    # primary) serve the siamese, primary and cross-view heads alike.
    cfg = self.cfg
    family = backbone_family(cfg.family)
    if self.head not in config_lib.HEADS:
      raise ValueError(f'head={self.head!r}; valid: {config_lib.HEADS}.')
    if family == 'bilm':  # its layer states are always collected
      body = MODELS[family](cfg, name='backbone')
    else:
      body = MODELS[family](
        cfg, collect_states=self.scalar_mix, name='backbone'
      )
    if self.label_sequences:
      return {'logits': self._score_labels(body, batch, deterministic)}
    if self.head == 'lm':
      if family not in ('decoder', 'encoder_decoder'):
        raise ValueError(
          f"head 'lm' generates text: it needs a decoder or an "
          f'encoder-decoder, not {cfg.family!r}.'
        )
      outputs = body(
        backbone_inputs(batch, family), deterministic=deterministic
      )
      return {'logits': outputs['logits']}
    mix = None
    if self.scalar_mix:
      mix = ScalarMix(self.mix_layer_norm, name='scalar_mix')

    def encode(rows, deterministic=deterministic, direction='both'):
      """The states the head reads [B, L, D], and the body's outputs."""
      frozen = deterministic or self.freeze_backbone
      if self.cove:
        outputs = cove_features(body, rows, deterministic=frozen)
      elif direction != 'both':  # an encoder's restricted view (CVT)
        outputs = body(
          backbone_inputs(rows, family),
          deterministic=frozen,
          direction=direction,
        )
      else:
        outputs = body(backbone_inputs(rows, family), deterministic=frozen)
      if self.freeze_backbone:
        outputs = jax.lax.stop_gradient(outputs)
      if mix is None:
        h_BLD = outputs['hidden']
      else:
        h_BLD = mix(outputs['layer_states'], rows['input_mask'])
        h_BLD = h_BLD.astype(cfg.jnp_dtype)
      if self.cove and self.cove_embeddings:
        # [E(w); CoVe(w)]: D + E wide.
        h_BLD = jnp.concatenate([outputs['embeddings'], h_BLD], axis=-1)
      return nn.with_logical_constraint(h_BLD, layers.BLD), outputs

    def sentence(rows, deterministic=deterministic):
      """One vector per row, as `pooling` says."""
      h_BLD, outputs = encode(rows, deterministic)
      pooling = resolve_pooling(
        self.pooling,
        family,
        'pooled' in outputs,
        self.scalar_mix,
        self.siamese,
        self.cove,
      )
      if pooling == 'pooler':
        return outputs['pooled']
      return pool(h_BLD, rows['input_mask'], pooling)

    drop = nn.Dropout(self.dropout)
    if self.siamese:
      # Sentence-BERT (Reimers & Gurevych, 2019): one body, two sentences.
      u_BD = sentence(batch)
      v_BD = sentence({k[2:]: v for k, v in batch.items() if k[:2] == 'b_'})
      if self.head == 'regression':
        return {'logits': cosine(u_BD, v_BD)}
      x_BF = jnp.concatenate([u_BD, v_BD, jnp.abs(u_BD - v_BD)], axis=-1)
      return {
        'logits': self._dense('classifier', x_BF, x_BF.shape[-1], 'BD,DC->BC')
      }

    def primary(rows, deterministic=deterministic):
      """The task head's outputs on rows."""
      if self.head in ('classification', 'regression'):
        x_BD = drop(sentence(rows, deterministic), deterministic=deterministic)
        logits_BC = self._dense('classifier', x_BD, x_BD.shape[-1], 'BD,DC->BC')
        if self.head == 'regression':
          return {'logits': logits_BC[:, 0]}
        return {'logits': logits_BC}

      h_BLD, _ = encode(rows, deterministic)
      mask_BL = rows['input_mask']
      D = h_BLD.shape[-1]  # 2 x emb_dim for a biLM, D + E for CoVe
      if self.head == 'span':
        # No dropout before BERT's SQuAD output layer.
        logits_BLC = self._dense('span', h_BLD, D, 'BLD,DC->BLC', classes=2)
        logits_BLC = jnp.where(mask_BL[..., None] > 0, logits_BLC, MASKED_LOGIT)
        return {
          'start_logits': logits_BLC[..., 0],
          'end_logits': logits_BLC[..., 1],
        }
      h_BLD = drop(h_BLD, deterministic=deterministic)
      return {'token_logits': self._dense('token', h_BLD, D, 'BLD,DC->BLC')}

    if self.cvt_views and ('cvt_weight' in batch or self.is_initializing()):
      return self._cross_views(
        batch, deterministic, primary, encode, sentence, drop
      )
    return primary(batch)

  def _cross_views(
    self, batch, deterministic, primary, encode, sentence, drop
  ) -> dict:
    """CVT's outputs on an unlabelled batch: the primary head's fixed
    predictions (cvt_teacher) and each view's auxiliary head's (cvt_<view>).

    The teacher runs without dropout; the views with the run's dropout.
    """
    (teacher,) = primary(batch, deterministic=True).values()
    outputs = {'cvt_teacher': jax.lax.stop_gradient(teacher)}
    training = not (deterministic or self.is_initializing())
    mask_BL = batch['input_mask']
    states = {}  # a direction's states, shared by its two token views

    def view_states(direction):
      if direction not in states:
        states[direction], _ = encode(batch, direction=direction)
      return states[direction]

    for view in self.cvt_views:
      if view == 'mask':
        rows = batch
        if training:
          rows = mask_tokens(
            self.make_rng('dropout'),
            batch,
            self.cvt_mask_rate,
            self.cvt_mask_id,
            self.cvt_keep_ids,
          )
        if self.head == 'classification':
          x = sentence(rows)
        else:
          x, _ = encode(rows)
      else:
        x = view_states('forward' if view in _FORWARD_VIEWS else 'backward')
        if view in ('future', 'past'):
          x = shift(x, -1 if view == 'future' else 1)
        if self.head == 'classification':
          x = pool(x, mask_BL, 'mean')
      x = drop(x, deterministic=not training)
      equation = 'BD,DC->BC' if x.ndim == 2 else 'BLD,DC->BLC'
      outputs[f'cvt_{view}'] = self._dense(
        f'cvt_{view}', x, x.shape[-1], equation
      )
    return outputs

  def _score_labels(self, body, batch, deterministic: bool) -> Array:
    """[B, C]: log p(label word c | row), teacher-forced per class."""
    encoded, segments = body.encode(
      {
        'encoder_input_ids': batch['input_ids'],
        'encoder_input_mask': batch['input_mask'],
      },
      deterministic=deterministic,
    )
    B = batch['input_ids'].shape[0]
    scores = []
    # One decoder pass per class: GLUE has at most 3 short label words.
    for sequence in self.label_sequences:
      ids_T = jnp.asarray(sequence, jnp.int32)
      inputs_BT = jnp.broadcast_to(ids_T[:-1], (B, len(sequence) - 1))
      _, logits_BTV = body.decode_logits(
        {'decoder_input_ids': inputs_BT},
        encoded,
        segments,
        deterministic=deterministic,
      )
      logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
      targets_BT1 = jnp.broadcast_to(ids_T[1:, None], (B, len(sequence) - 1, 1))
      logp_BT = jnp.take_along_axis(logp_BTV, targets_BT1, axis=-1)[..., 0]
      scores.append(jnp.sum(logp_BT, axis=-1))
    return jnp.stack(scores, axis=-1)

  def _dense(self, name, x, D, equation, classes=None):
    """The head's output layer, float32 logits (sharded as BERT's heads)."""
    y = layers.dense(
      self,
      name,
      x,
      (D, classes or self.num_labels),
      ('embed', None),
      equation,
      use_bias=True,
      std=self.cfg.initializer_range,
    )
    return y.astype(jnp.float32)
