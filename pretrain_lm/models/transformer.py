"""The layer stack every family is built from: embeddings, layers, masks.

An encoder is a bidirectional Stack, a decoder a causal one, and the
decoder of an encoder-decoder a causal Stack with cross-attention. The
config's variant switches (norm position and type, positions, sharing,
scan, remat) all act here, so every family gets every variant.
"""

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from pretrain_lm.models import kernels, layers
from pretrain_lm.models.config import ModelConfig

Array = jax.Array

REMAT_POLICIES = {
  # Recompute everything in the backward pass: least memory.
  'full': jax.checkpoint_policies.nothing_saveable,
  # Keep matmul outputs, recompute the cheap element-wise ops.
  'dots': jax.checkpoint_policies.checkpoint_dots,
  'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Embedder(nn.Module):
  """Token + position + token-type embeddings, at the table width E.

  Learned positions are looked up, sinusoidal ones added (Vaswani et al.);
  relative and rotary positions act inside attention instead.
  """

  cfg: ModelConfig
  token_embed: layers.Embed

  @nn.compact
  def __call__(
    self,
    ids_BL: Array,
    positions_BL: Array,
    type_ids_BL: Array | None,
    deterministic: bool,
  ) -> Array:
    cfg = self.cfg
    E = cfg.token_dim
    x_BLE = self.token_embed(ids_BL)
    if cfg.embed_scale:
      x_BLE = x_BLE * jnp.sqrt(E).astype(x_BLE.dtype)
    if cfg.position == 'learned':
      x_BLE = x_BLE + layers.Embed(
        cfg.max_len, cfg, E, ('position', 'embed'), name='position_embed'
      )(positions_BL)
    elif cfg.position == 'sinusoidal':
      x_BLE = x_BLE + layers.sinusoidal(positions_BL, E, x_BLE.dtype)
    if cfg.type_vocab_size:
      if type_ids_BL is None:
        type_ids_BL = jnp.zeros_like(ids_BL)
      x_BLE = x_BLE + layers.Embed(
        cfg.type_vocab_size,
        cfg,
        E,
        ('type_vocab', 'embed'),
        name='token_type_embed',
      )(type_ids_BL)
    if cfg.embed_norm:
      x_BLE = layers.norm(cfg, 'embed_norm')(x_BLE)
    x_BLE = nn.Dropout(cfg.dropout_rate)(x_BLE, deterministic=deterministic)
    return nn.with_logical_constraint(x_BLE, layers.BLD)


def to_model_dim(module: nn.Module, x_BLE: Array, cfg: ModelConfig) -> Array:
  """The embeddings at the model width D: ALBERT's factorised embedding
  projects the table width E up to D (`module`'s embed_projection)."""
  if x_BLE.shape[-1] == cfg.emb_dim:
    return x_BLE
  return layers.dense(
    module,
    'embed_projection',
    x_BLE,
    (x_BLE.shape[-1], cfg.emb_dim),
    (None, 'embed'),
    'BLE,ED->BLD',
    use_bias=True,
    std=cfg.initializer_range,
  )


class TransformerLayer(nn.Module):
  """Self-attention (+ cross-attention) + feed-forward, post- or pre-LN.

  Post-LN (BERT, BART): x = norm(x + f(x)). Pre-LN (GPT-2, T5):
  x = x + f(norm(x)). `ctx` holds the stack-wide arrays (masks, positions,
  the relative-bias table, the encoder output) so nn.scan can broadcast it.
  With ctx['kv'] (and 'kv_positions') self-attention reads its keys and
  values from there instead of x, through the same norm: XLNet's query
  stream attends to the content stream with the same weights.
  """

  cfg: ModelConfig
  num_layers: int  # of this stack, for GPT-2's residual init
  causal: bool
  cross_attention: bool
  deterministic: bool
  decode: bool = False
  emit_state: bool = False  # also return the output as the scan's `ys`

  @nn.compact
  def __call__(self, x_BLD: Array, ctx: dict) -> tuple[Array, None]:
    cfg, det = self.cfg, self.deterministic
    out_std = layers.residual_std(cfg, self.num_layers)
    dropout = nn.Dropout(cfg.dropout_rate)

    # cuDNN's kernel skips the key blocks a causal mask hides: not while
    # decoding (the cache masks) nor with a prefix LM's bidirectional prefix.
    causal = self.purely_causal(ctx)

    def self_attention(h, norm):
      kv = h if ctx.get('kv') is None else norm(ctx['kv'])
      return layers.MultiHeadAttention(
        cfg, out_std, decode=self.decode, name='attention'
      )(
        h,
        kv,
        mask=ctx['mask'],
        deterministic=det,
        q_pos_BL=ctx['positions'],
        k_pos_BS=ctx.get('kv_positions', ctx['positions']),
        rel_table=ctx['rel_table'],
        rel_bias=ctx.get('rel_bias'),
        bidirectional=not self.causal,
        causal=causal,
      )

    def cross_attention(h, norm):
      del norm
      return layers.MultiHeadAttention(cfg, out_std, name='cross_attention')(
        h, ctx['encoded'], mask=ctx['cross_mask'], deterministic=det
      )

    def mlp(h, norm):
      del norm
      return layers.Mlp(cfg, out_std, name='mlp')(h, det)

    blocks = [('attention', self_attention)]
    if self.cross_attention:
      blocks.append(('cross_attention', cross_attention))
    blocks.append(('mlp', mlp))
    for name, block in blocks:
      norm = layers.norm(cfg, f'{name}_norm')
      if cfg.norm_position == 'post':
        h = block(x_BLD, lambda kv: kv)
        x_BLD = norm(x_BLD + dropout(h, deterministic=det))
      else:
        x_BLD = x_BLD + dropout(block(norm(x_BLD), norm), deterministic=det)
    x_BLD = nn.with_logical_constraint(x_BLD, layers.BLD)
    return x_BLD, (x_BLD if self.emit_state else None)

  def purely_causal(self, ctx: dict) -> bool:
    """Whether self-attention's mask is purely causal: each query sees no
    later key (no prefix LM, no cache, queries and keys the same rows)."""
    plain = ctx.get('prefix') is None and ctx.get('kv') is None
    return self.causal and plain and not self.decode


def layer_class(cfg: ModelConfig, prevent_cse: bool = True) -> type[nn.Module]:
  """TransformerLayer, rematerialised in the backward pass per model.remat."""
  if cfg.remat == 'none':
    return TransformerLayer
  return nn.remat(
    TransformerLayer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=prevent_cse
  )


# What each query of a bidirectional stack's self-attention may see:
# every key of its segment, or (restricted views, as cross-view training's
# auxiliary modules read them) only those at or before it, or at or after.
DIRECTIONS = ('both', 'forward', 'backward')


def attention_mask(
  q_segments_BL: Array,
  k_segments_BS: Array,
  causal: bool,
  prefix_BL: Array | None = None,
  direction: str = 'both',
) -> Array:
  """[B, 1, L, S]: same packed segment, real key (segment > 0), causal.

  With `prefix_BL` (self-attention, L == S), tokens marked nonzero also see
  each other bidirectionally: a prefix LM's mask (T5's 'prefix_lm', UniLM).
  `direction` 'forward' / 'backward' (self-attention of a non-causal
  stack) keeps the keys at or before / at or after each query.
  """
  if direction not in DIRECTIONS:
    raise ValueError(f'direction={direction!r}; valid: {list(DIRECTIONS)}.')
  if direction != 'both' and causal:
    raise ValueError(f'direction={direction!r} restricts a non-causal stack.')
  mask = q_segments_BL[:, :, None] == k_segments_BS[:, None, :]
  mask = jnp.logical_and(mask, (k_segments_BS != 0)[:, None, :])
  L, S = q_segments_BL.shape[1], k_segments_BS.shape[1]
  if direction != 'both':
    ones = jnp.ones((L, S), bool)
    visible = jnp.tril(ones) if direction == 'forward' else jnp.triu(ones)
    mask = jnp.logical_and(mask, visible[None])
  if causal:
    visible = jnp.tril(jnp.ones((L, S), bool))[None]
    if prefix_BL is not None:
      prefix = prefix_BL.astype(bool)
      visible = jnp.logical_or(
        visible, jnp.logical_and(prefix[:, :, None], prefix[:, None, :])
      )
    mask = jnp.logical_and(mask, visible)
  return mask[:, None]


class Stack(nn.Module):
  """Embeddings, then num_layers TransformerLayers, then (pre-LN) a norm.

  With `collect_states` it returns (x_BLD, states_NBLD): the embedding
  output and every layer's output, N = num_layers + 1, the last one after
  the final norm (ELMo's scalar mix reads them all).

  With `output_positions_BP` it returns only the states at those positions,
  [B, P, D]. When nothing else reads the last layer's output (BERT's MLM
  head reads about 15% of the positions), the last layer computes its
  queries, attention output and MLP at those P positions alone, attending
  to the keys and values of all L: exactly the gathered full output, for
  roughly P/L of that layer's cost. Unrolled, shared (ALBERT) and scanned
  stacks all do (see _layers).

  `direction` restricts a non-causal stack's self-attention to the keys on
  one side of each query (attention_mask).
  """

  cfg: ModelConfig
  embedder: Embedder
  num_layers: int
  causal: bool
  cross_attention: bool = False
  decode: bool = False
  collect_states: bool = False

  @nn.compact
  def __call__(
    self,
    ids_BL: Array,
    *,
    segment_ids_BL: Array,
    positions_BL: Array,
    deterministic: bool,
    type_ids_BL: Array | None = None,
    encoded_BSD: Array | None = None,
    encoder_segment_ids_BS: Array | None = None,
    prefix_BL: Array | None = None,
    output_positions_BP: Array | None = None,
    direction: str = 'both',
  ) -> Array | tuple[Array, Array]:
    cfg = self.cfg
    L = ids_BL.shape[1]
    if output_positions_BP is not None and (self.decode or self.collect_states):
      raise ValueError(
        'Stack: output_positions_BP is for training and scoring; decoding '
        'and collect_states need every position.'
      )
    if cfg.position == 'learned' and cfg.max_len < L:
      raise ValueError(
        f'Sequence length {L} exceeds model.max_len={cfg.max_len} (the '
        'position table); lower data.seq_len or raise model.max_len.'
      )
    x = self.embedder(ids_BL, positions_BL, type_ids_BL, deterministic)
    x = to_model_dim(self, x, cfg)
    x_BLD = nn.with_logical_constraint(x, layers.BLD)
    ctx = self._context(
      segment_ids_BL,
      positions_BL,
      encoded_BSD,
      encoder_segment_ids_BS,
      prefix_BL,
      direction,
    )
    embedded_BLD = x_BLD
    x_BLD, states = self._layers(x_BLD, ctx, deterministic, output_positions_BP)
    if cfg.norm_position == 'pre':
      x_BLD = layers.norm(cfg, 'final_norm')(x_BLD)
    if not self.collect_states:
      return x_BLD
    states = jnp.concatenate([embedded_BLD[None], states[:-1], x_BLD[None]])
    return x_BLD, states

  def _context(
    self,
    segment_ids_BL: Array,
    positions_BL: Array,
    encoded_BSD: Array | None,
    encoder_segment_ids_BS: Array | None,
    prefix_BL: Array | None,
    direction: str,
  ) -> dict:
    """The stack-wide arrays every layer reads (TransformerLayer's ctx):
    masks, positions, the relative-bias table, the encoder output."""
    cfg, L = self.cfg, segment_ids_BL.shape[1]
    ctx = {
      # While decoding, the attention cache builds the causal mask itself.
      'mask': None
      if self.decode
      else attention_mask(
        segment_ids_BL, segment_ids_BL, self.causal, prefix_BL, direction
      ),
      'positions': positions_BL,
      'rel_table': None,
      'encoded': encoded_BSD,
      'cross_mask': None,
      'prefix': prefix_BL,  # a prefix LM's: its mask is not purely causal
    }
    if self.cross_attention:
      ctx['cross_mask'] = attention_mask(
        segment_ids_BL, encoder_segment_ids_BS, causal=False
      )
    if cfg.position == 'relative':
      # One bucket table per stack, shared by its layers (T5).
      ctx['rel_table'] = self.param(
        'relative_bias',
        layers.kernel_init(cfg.initializer_range, (None, 'heads')),
        (cfg.relative_buckets, cfg.num_heads),
        cfg.jnp_param_dtype,
      )
      # By index: the positions' bias wherever positions count up within
      # a segment, as packing makes them. Not while decoding: the cache's
      # keys sit at their positions.
      if not self.decode:
        ctx['rel_bias'] = layers.relative_bias_by_index(
          ctx['rel_table'], L, L, cfg, bidirectional=not self.causal
        )
    return ctx

  def _layers(
    self,
    x_BLD: Array,
    ctx: dict,
    deterministic: bool,
    out_BP: Array | None = None,
  ):
    """Applies the layers: shared, scanned or unrolled, optionally remat.

    Returns the output (at out_BP's positions if given) and, with
    collect_states, each layer's [N, B, L, D].
    """
    cfg = self.cfg
    # prevent_cse is unneeded inside scan and costs speed there.
    layer_cls = layer_class(cfg, prevent_cse=not cfg.scan_layers)
    kwargs = dict(
      cfg=cfg,
      num_layers=self.num_layers,
      causal=self.causal,
      cross_attention=self.cross_attention,
      deterministic=deterministic,
      decode=self.decode,
      emit_state=self.collect_states,
    )
    if cfg.share_layers:
      apply = self._shared_layers
    elif cfg.scan_layers:
      apply = self._scanned_layers
    else:
      apply = self._unrolled_layers
    x_BLD, states, out_BP = apply(layer_cls, kwargs, x_BLD, ctx, out_BP)
    if out_BP is not None:  # initialising: the whole last layer ran
      x_BLD = rows_at(x_BLD, out_BP)
    return x_BLD, states

  # The three ways of applying the layers below each return the output,
  # the states (or None) and the out_BP still to gather: None once the last
  # layer ran at those positions only.

  def _shared_layers(self, layer_cls, kwargs, x_BLD, ctx, out_BP):
    """ALBERT: one set of weights applied num_layers times, scanned with
    the params broadcast; each application keeps its own decode cache.
    With out_BP the last application runs apart, at those positions."""
    last_apart = out_BP is not None
    states = None
    if self.num_layers > last_apart:
      shared = nn.scan(
        layer_cls,
        variable_broadcast='params',
        variable_axes={'cache': 1},
        split_rngs={'params': False, 'dropout': True},
        in_axes=nn.broadcast,
        length=self.num_layers - last_apart,
      )
      x_BLD, states = shared(**kwargs, name='shared_layer')(x_BLD, ctx)
    if last_apart:
      inputs = rows_at(x_BLD, out_BP), outputs_ctx(ctx, x_BLD, out_BP)
      if self.num_layers == 1:  # no scan made the weights: this does
        x_BLD, _ = layer_cls(**kwargs, name='shared_layer')(*inputs)
      else:  # the scan's weights once more (it owns their scope)
        weights = nn.meta.unbox(self.variables['params']['shared_layer'])
        x_BLD, _ = self._apart(
          layer_cls(**kwargs, parent=None),
          weights,
          kwargs['deterministic'],
          *inputs,
        )
      out_BP = None
    return x_BLD, states, out_BP

  def _scanned_layers(self, layer_cls, kwargs, x_BLD, ctx, out_BP):
    """One compiled layer body; parameters stacked on a leading 'layers'
    axis, caches on axis 1 so that their batch axis stays first."""
    scanned = functools.partial(
      nn.scan,
      layer_cls,
      variable_axes={'params': 0, 'cache': 1},
      split_rngs={'params': True, 'dropout': True},
      in_axes=nn.broadcast,
      metadata_params={nn.PARTITION_NAME: 'layers'},
    )
    if out_BP is None or self.is_initializing():
      layers_cls = scanned(length=self.num_layers)
      x_BLD, states = layers_cls(**kwargs, name='layers')(x_BLD, ctx)
      return x_BLD, states, out_BP
    # The scan owns the stacked weights: the N - 1 below are scanned
    # apart, then the last layer runs at out_BP's positions (the same
    # weights and outputs as the whole scan, gathered).
    deterministic = kwargs['deterministic']
    weights = nn.meta.unbox(self.variables['params']['layers'])
    if self.num_layers > 1:
      below = scanned(length=self.num_layers - 1)(**kwargs, parent=None)
      x_BLD, _ = self._apart(
        below,
        jax.tree.map(lambda w: w[:-1], weights),
        deterministic,
        x_BLD,
        ctx,
      )
    x_BLD, _ = self._apart(
      layer_cls(**kwargs, parent=None),
      jax.tree.map(lambda w: w[-1], weights),
      deterministic,
      rows_at(x_BLD, out_BP),
      outputs_ctx(ctx, x_BLD, out_BP),
    )
    return x_BLD, None, None

  def _unrolled_layers(self, layer_cls, kwargs, x_BLD, ctx, out_BP):
    """num_layers layers, each with its own weights (layer_0, layer_1, ...)."""
    states = []
    for i in range(self.num_layers):
      layer = layer_cls(**kwargs, name=f'layer_{i}')
      if out_BP is not None and i == self.num_layers - 1:
        # The last layer's queries at out_BP, its keys and values at all
        # L: the path XLNet's query stream takes through ctx['kv'].
        x_BLD, state = layer(
          rows_at(x_BLD, out_BP), outputs_ctx(ctx, x_BLD, out_BP)
        )
        out_BP = None  # done: x is [B, P, D]
      else:
        x_BLD, state = layer(x_BLD, ctx)
      states.append(state)
    states = jnp.stack(states) if self.collect_states else None
    return x_BLD, states, out_BP

  def _apart(self, module: nn.Module, params, deterministic: bool, *args):
    """An unbound `module` applied to `args` with `params` (weights a scan
    owns), its dropout drawn from a key of this stack's stream."""
    rngs = {} if deterministic else {'dropout': self.make_rng('dropout')}
    return module.apply({'params': params}, *args, rngs=rngs)


def rows_at(x_BL_: Array, positions_BP: Array) -> Array:
  """x's entries at `positions` of each row: [B, L, ...] -> [B, P, ...]."""
  index = positions_BP.reshape(positions_BP.shape + (1,) * (x_BL_.ndim - 2))
  return jnp.take_along_axis(x_BL_, index, axis=1)


def outputs_ctx(ctx: dict, x_BLD: Array, positions_BP: Array) -> dict:
  """A layer's ctx for queries at `positions` only, keys and values at all
  positions of x (self-attention reads them from ctx['kv'])."""

  def query_rows(mask_B1LS):  # [B, 1, L, S] -> [B, 1, P, S]
    index = positions_BP[:, None, :, None]
    return jnp.take_along_axis(mask_B1LS, index, axis=2)

  out = dict(ctx, kv=x_BLD, kv_positions=ctx['positions'])
  out['positions'] = rows_at(ctx['positions'], positions_BP)
  out['mask'] = query_rows(ctx['mask'])
  # The queries are no longer at their indices: the bias follows positions.
  out['rel_bias'] = None
  if ctx['cross_mask'] is not None:
    out['cross_mask'] = query_rows(ctx['cross_mask'])
  return out


def stack_flops_per_token(
  cfg: ModelConfig,
  num_layers: int,
  seq_len: int,
  cross_len: int = 0,
  causal: bool = False,
) -> float:
  """Training FLOPs per token of one stack's layers (PaLM, App. B).

  A matmul with N weights costs 2N FLOPs per token forward and 4N backward,
  6N in all. Counted per layer: the attention and MLP projections
  (4·D·H·K + 2·D·F, or 3·D·F with a GLU), the score and value products of
  attention (2 matmuls of L·H·K per token, 6·2·L·H·K) over the keys they
  run over (attended_keys: L, or fewer for a `causal` stack on cuDNN),
  and, with cross-attention, its query and output projections and its
  products over the cross_len encoder positions (its key and value
  projections run once per encoder position: see kv_flops). The factorised
  embedding projection adds 6·E·D. Embedding lookups, norms and softmax are
  not matmuls and, as in the MFU convention, are left out.
  """
  D, H, K, F = cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
  mlp = (3 if cfg.is_glu else 2) * D * F
  keys = attended_keys(cfg, seq_len, causal)
  per_layer = 6 * (4 * D * H * K + mlp) + 12 * keys * H * K
  if cross_len:
    per_layer += 6 * 2 * D * H * K + 12 * cross_len * H * K
  projection = 6 * cfg.token_dim * D if cfg.token_dim != D else 0
  return float(num_layers * per_layer + projection)


def attended_keys(cfg: ModelConfig, seq_len: int, causal: bool) -> float:
  """Keys per query that self-attention's score and value products run
  over, averaged over a row: seq_len; for a purely causal mask on cuDNN's
  kernel, which skips the blocks above the diagonal in tiles of its own
  choosing, the triangle the mask keeps, (seq_len + 1) / 2 (a floor: the
  diagonal tiles run whole)."""
  impl = kernels.attention_impl(cfg, deterministic=False)
  if causal and impl == 'cudnn':
    return (seq_len + 1) / 2
  return float(seq_len)


def stack_flops_per_row(
  cfg: ModelConfig, num_layers: int, seq_len: int, outputs: int | None = None
) -> float:
  """Training FLOPs of one row of seq_len tokens through a stack's layers.

  With `outputs` (the P output positions a Stack is asked for), the last
  layer counts as it runs: its queries, output projection, MLP and
  attention products at P positions, its keys and values at all seq_len.
  """
  if not outputs or not num_layers:
    return stack_flops_per_token(cfg, num_layers, seq_len) * seq_len
  below = stack_flops_per_token(cfg, num_layers - 1, seq_len) * seq_len
  return below + query_layer_flops(cfg, seq_len, outputs)


def query_layer_flops(cfg: ModelConfig, seq_len: int, queries: int) -> float:
  """Training FLOPs of one layer run for `queries` query positions that
  attend to seq_len keys and values, projected here from seq_len states."""
  D, H, K, F = cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
  mlp = (3 if cfg.is_glu else 2) * D * F
  per_query = 6 * (2 * D * H * K + mlp) + 12 * seq_len * H * K
  return float(queries * per_query + seq_len * kv_flops(cfg, 1))


def kv_flops(cfg: ModelConfig, num_layers: int) -> float:
  """Training FLOPs per attended token of num_layers' key and value
  projections alone (cross-attention's, over the encoder output)."""
  return float(num_layers * 6 * 2 * cfg.emb_dim * cfg.num_heads * cfg.head_dim)


def default_positions(segment_ids_BL: Array) -> Array:
  """0, 1, 2, ... within each run of equal segment ids (packed rows)."""
  L = segment_ids_BL.shape[1]
  index = jnp.broadcast_to(jnp.arange(L), segment_ids_BL.shape)
  start = jnp.concatenate(
    [
      jnp.ones_like(segment_ids_BL[:, :1], bool),
      segment_ids_BL[:, 1:] != segment_ids_BL[:, :-1],
    ],
    axis=1,
  )
  first = jax.lax.cummax(jnp.where(start, index, 0), axis=1)
  return index - first
