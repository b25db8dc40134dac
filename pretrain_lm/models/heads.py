"""Output heads that sit on a Transformer body."""

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from pretrain_lm.models import layers
from pretrain_lm.models.config import ModelConfig

Array = jax.Array


def cut_vocab(cfg: ModelConfig, x_V: Array) -> Array:
  """x[..., :vocab_size]: the columns of real ids, without the padding.

  With model.vocab_multiple > 1 the token table (and every vocabulary-sized
  output parameter) has model.padded_vocab entries so that the output
  product fills GPU GEMM tiles; no id maps to the padded ones, so their
  logits are dropped before any loss, metric or search reads them. Without
  padding, x itself (no slice op).
  """
  if cfg.padded_vocab == cfg.vocab_size:
    return x_V
  return x_V[..., : cfg.vocab_size]


def output_logits(
  module: nn.Module, h_BPE: Array, embed: layers.Embed
) -> Array:
  """Logits from E-wide states: the tied table's transpose or a kernel.

  The product runs over all model.padded_vocab rows (whole GEMM tiles);
  the logits are cut back to model.vocab_size right after it.
  """
  cfg = module.cfg
  if cfg.tie_embeddings:
    logits_BPV = embed.attend(h_BPE)
  else:
    logits_BPV = layers.dense(
      module,
      'logits',
      h_BPE,
      (h_BPE.shape[-1], cfg.padded_vocab),
      ('embed', 'vocab'),
      'BPE,EV->BPV',
      use_bias=False,
      std=cfg.initializer_range,
    )
  return cut_vocab(cfg, logits_BPV)


class MlmHead(nn.Module):
  """BERT's masked-LM head: dense + activation + norm, then logits + bias.

  It runs only on the P predicted positions' states (gathered by the
  caller, or computed there alone: transformer.Stack's output positions),
  so the [*, V] logits cost B*P*V rather than B*L*V (P is about 15% of L).
  The dense maps D to the token-table width E (ALBERT's factorised
  embedding: 768 -> 128).
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BPD: Array, embed: layers.Embed) -> Array:
    cfg = self.cfg
    x_BPD = nn.with_logical_constraint(x_BPD, layers.BLD)
    h_BPE = layers.dense(
      self,
      'transform',
      x_BPD,
      (cfg.emb_dim, cfg.token_dim),
      # Only the input dim is sharded: the output dim on 'tensor', next to
      # the (vocab, embed)-sharded tied table, makes jax 0.10's XLA compute
      # wrong gradients on (data, fsdp, tensor) meshes (see
      # tests/train_test.py). The D x E kernel is small; Megatron leaves it
      # unsplit too.
      ('embed', None),
      'BPD,DE->BPE',
      use_bias=True,
      std=cfg.initializer_range,
    )
    # BERT's head uses GELU whatever the body's feed-forward uses.
    act = 'gelu' if cfg.is_glu else cfg.activation
    h_BPE = layers.ACTIVATIONS[act](h_BPE)
    h_BPE = layers.norm(cfg, 'transform_norm')(h_BPE)
    logits_BPV = output_logits(self, h_BPE, embed)
    bias_V = self.param(
      'output_bias',
      layers.zeros_init(('vocab',)),
      (cfg.padded_vocab,),
      cfg.jnp_param_dtype,
    )
    logits_BPV = logits_BPV + cut_vocab(cfg, bias_V).astype(cfg.jnp_dtype)
    return nn.with_logical_constraint(logits_BPV, layers.BLV)


class LmHead(nn.Module):
  """Next-token logits at every position (GPT-2, T5, BART): no bias.

  With a factorised embedding the states are first projected D -> E. With
  model.output_scale the states are first scaled by D**-0.5 (Mesh TF's T5
  v1.0, whose tied table has unit-variance rows).
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: Array, embed: layers.Embed) -> Array:
    cfg = self.cfg
    if cfg.output_scale:
      x_BLD = x_BLD * jnp.asarray(cfg.emb_dim**-0.5, x_BLD.dtype)
    if cfg.token_dim != cfg.emb_dim:
      x_BLD = layers.dense(
        self,
        'output_projection',
        x_BLD,
        (cfg.emb_dim, cfg.token_dim),
        ('embed', None),
        'BLD,DE->BLE',
        use_bias=False,
        std=cfg.initializer_range,
      )
    return nn.with_logical_constraint(
      output_logits(self, x_BLD, embed), layers.BLV
    )


def chunked_target_xent(
  model: nn.Module, x_BLD: Array, targets_BL: Array, chunk: int
) -> dict[str, Array]:
  """Next-token cross-entropy without the [B, L, V] logits in memory.

  `model.lm_head(x, model.token_embed)` runs on `chunk` positions at a
  time in a scan, each chunk's logits turned into its cross-entropy and
  argmax-correctness at once and rematerialised in the backward pass, so
  at most [B, chunk, V] logits exist at a time (the full ones are 1.6 GB
  in float32 for GPT-2's 50,257-piece vocabulary at batch 8 x 1024).
  Returns `target_xent` and `target_correct` [B, L] (float32), what
  objectives.clm.loss reads instead of `logits`.
  """
  B, L, D = x_BLD.shape
  n = -(-L // chunk)
  pad = n * chunk - L  # a short last chunk is padded; the pad is cut off
  x = jnp.pad(x_BLD, ((0, 0), (0, pad), (0, 0)))
  t = jnp.pad(targets_BL, ((0, 0), (0, pad)))
  x_NBCD = x.reshape(B, n, chunk, D).swapaxes(0, 1)
  t_NBC = t.reshape(B, n, chunk).swapaxes(0, 1)

  def body(mdl, carry, xs):
    x_BCD, t_BC = xs
    # float32 softmax, as objectives.xent.token_xent (optax).
    logits_BCV = mdl.lm_head(x_BCD, mdl.token_embed).astype(jnp.float32)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits_BCV, t_BC)
    correct = (jnp.argmax(logits_BCV, -1) == t_BC).astype(jnp.float32)
    return carry, (xent, correct)

  scan = nn.scan(
    nn.remat(body),
    variable_broadcast='params',
    split_rngs={'params': False},
    length=n,
  )
  _, (xent_NBC, correct_NBC) = scan(model, None, (x_NBCD, t_NBC))
  unchunk = lambda a: a.swapaxes(0, 1).reshape(B, n * chunk)[:, :L]
  return {
    'target_xent': unchunk(xent_NBC),
    'target_correct': unchunk(correct_NBC),
  }


class Pooler(nn.Module):
  """BERT's pooler: tanh(dense) of the first token's state."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: Array) -> Array:
    cfg = self.cfg
    y_BD = layers.dense(
      self,
      'pooler',
      x_BLD[:, 0],
      (cfg.emb_dim, cfg.emb_dim),
      ('embed', None),
      'BD,DE->BE',
      use_bias=True,
      std=cfg.initializer_range,
    )
    return jnp.tanh(y_BD)


class SentenceHead(nn.Module):
  """A 2-way classifier on the pooled output: BERT's next-sentence (and
  ALBERT's sentence-order) prediction, `cls/seq_relationship`."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, pooled_BD: Array) -> Array:
    cfg = self.cfg
    logits = layers.dense(
      self,
      'sentence',
      pooled_BD,
      (cfg.emb_dim, 2),
      ('embed', None),
      'BD,DC->BC',
      use_bias=True,
      std=cfg.initializer_range,
    )
    return logits.astype(jnp.float32)
