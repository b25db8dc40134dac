r"""A/B of train-step variants inside one process: a lever on and off.

  python experiments/benchmarks/ab_step.py \
      --config=configs/bert.py:size=small --batch_size=32 --rounds=10 \
      --variants=flax,16,8

Compiles the config's train step (the one `pretrain_lm.main` runs) once per
variant, then times the variants in alternating order on the same batch,
round after round. On a shared machine the speed drifts by more than a
lever is worth between two separate `pretrain_lm.bench` runs; alternating
within one process lets the drift hit every variant alike. Prints each
variant's median step and, per round, its ratio to the first.
`--dtype=bfloat16` sets the config's model.dtype.

Variants of dropout's mask draws (`layers.keep_mask`):
- `flax`: jax.random.bernoulli, one threefry hash per element, as flax's
  nn.Dropout draws them;
- a number of bits per element: `16` (layers.DROPOUT_BITS, the default)
  or `8`;
- `16xor`: 16-bit draws from jax.random.bits, which XORs each hash's two
  words into one (layers.random_words keeps both);
- `16loop`: both words, hashed by jax's threefry2x32 primitive (a 5-step
  loop on CPU) instead of layers.threefry2x32;
- `none`: no masks at all, the floor that no draw can beat (it changes the
  model: dropout off).

Variants of the encoder's last layer (dropout draws at the default):
- `last`: the default, the last layer at the predicted positions only;
- `last_full`: the last layer at every position, then gathered (what
  transformer.Stack computes without output positions).

Variants of causal self-attention (decoders; model.causal_chunk):
- `causal`: the default, query blocks against the keys up to each block's
  end (layers.causal_blocks);
- `causal_full`: the whole L x L square, masked (one block).

Variants of top-1 and sampling over the vocabulary (models/heads.py):
- `vocab`: the default, heads.is_argmax for the token accuracies and
  heads.sample_categorical for ELECTRA's generator samples;
- `vocab_jax`: jnp.argmax(logits) == labels and jax.random.categorical,
  jax's own;
- `vocab_gumbel`: the default's comparisons, and a Gumbel-max sampler
  with block-wise argmax in place of heads.sample_categorical's two-level
  inverse CDF.

Variants of T5's relative attention bias (model.position='relative'):
- `relative`: the default, one [1, H, L, S] bias per stack from the
  query and key indices (layers.relative_bias_by_index);
- `relative_rows`: each layer gathers a [B, H, L, S] bias at every row's
  positions (layers.relative_bias).

Variants of the MLM head's output bias (BERT, ELECTRA's generator):
- `bias`: the default, its gradient summed over the predicted rows by
  layers.broadcast_rows (heads.add_vocab_bias);
- `bias_sum`: `logits + bias`, XLA's reduce summing the gradient.

Variants of the exact GELU (BERT, ELECTRA, BART, RoBERTa):
- `gelu`: the default, Phi from erf (layers.gelu);
- `gelu_erfc`: jax.nn.gelu(approximate=False), Phi from erfc.

Variants of the dense projections (every family):
- `project`: the default, each projection one 2-D matrix product over
  flat views of x and W (layers.project);
- `project_einsum`: jnp.einsum over x's and W's own dims.
- `project_plain`: the default, except that low-precision operands
  (`--dtype=bfloat16`) take XLA's product in their own dtype and jax's
  gradients, without `layers.matmul_f32_acc`;
- `project_nn`: the default, except that a W stored [in, out] gets a
  custom gradient: x's gradient multiplies dy by a materialised copy of
  W^T ([out, in], behind an optimization barrier so XLA cannot fold the
  transpose back), a plain [rows, out] x [out, in] product, instead of
  contracting dy and W over their last dims.

- `project_f32acc`: the default, except that a W stored [in, out] goes
  through layers.matmul_f32_acc in float32 too: W's gradient an `NN`
  product over a transposed copy of x (YNNPACK), not the `TN` product
  XLA:CPU gives Eigen.

Variants of the attention kernel's layout (the einsum kernel):
- `attention`: the default, each block's einsums over slices of q, k and
  v as [B, L, H, K];
- `attention_heads_first`: q, k and v transposed once per layer, behind
  an optimization barrier, to [B, H, L, K], [B, H, K, S] and [B, H, S, K],
  each block's products sliced from those, instead of each block's
  einsum over [B, L, H, K] slices.

Variants of the non-finite step check (train.step_is_finite):
- `finite`: the default, the loss, the gradients' norm and the update's
  norm (a reduction over every parameter before the select);
- `finite_grads`: the loss and the gradients' norm only (a step then
  takes any finite update, however large).

Variants of the step's batch split (train.grad_accum_steps):
- `accum:N`: the same batch as N microbatches in a scan, their gradients
  summed (train.accumulate_gradients), one update; `accum:1` is the
  config's step without the scan. Smaller microbatches keep activations in
  the CPU's caches; the scan adds a float32 gradient sum per microbatch.

With `--init=WORKDIR` (a pretraining workdir), `--config` is a fine-tuning
config (`configs/finetune/glue.py:task=sst2`) and the batch is the task's
first `--batch_size` training rows of `--seq_len` tokens:

  python experiments/benchmarks/ab_step.py \
      --config=configs/finetune/glue.py:task=sst2 --init=workdirs/quickstart \
      --seq_len=64 --batch_size=32 --variants=accum:1,accum:2,accum:4

Variants of XLA's compile options: `xla:NAME=VALUE` compiles the default
step with that DebugOptions field set (jax's `compile(compiler_options=)`),
for example `xla:xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT`
(XLA:CPU hands only the matmuls to YNNPACK, not the reductions). Values
are typed as in train.compiler_options (true/false, numbers, names), and
several options go space-separated in one variant. These add to the
config's own train.compiler_options; `--cpu_compiler_options=` replaces
the config's CPU options for every variant (empty: XLA's defaults, what
the presets use).
"""

import argparse
import atexit
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.extend import random as jex_random  # noqa: E402

from pretrain_lm import configlib, sharding, train  # noqa: E402
from pretrain_lm.bench import step  # noqa: E402
from pretrain_lm.data import pipeline  # noqa: E402
from pretrain_lm.finetune import trainer as ft_trainer  # noqa: E402
from pretrain_lm.models import heads, layers, transformer  # noqa: E402


def flax_mask(rng, shape, keep_prob):
  """flax's draw: a uniform float from one threefry word per element."""
  return jax.random.bernoulli(rng, keep_prob, shape), keep_prob


def xor_words(rng, shape):
  """jax.random.bits' words: one per hash, its two outputs XORed."""
  return jax.random.bits(rng, shape, jnp.uint32)


def looped_hash(k1, k2, x1, x2):
  """jax's threefry2x32 primitive (a 5-step loop on CPU)."""
  return jex_random.threefry2x32_p.bind(k1, k2, x1, x2)


def gumbel_sample(rng, logits):
  """A Gumbel-max sampler, the alternative to heads.sample_categorical's
  inverse CDF: a threefry word and two logs per entry, then the first
  argmax found block by block."""
  u = jnp.maximum(heads._uniforms(rng, logits.shape), jnp.finfo('float32').tiny)
  x = logits.astype(jnp.float32) - jnp.log(-jnp.log(u))
  *lead, V = x.shape
  n = -(-V // 128)
  padded = jnp.pad(
    x, [(0, 0)] * len(lead) + [(0, n * 128 - V)], constant_values=-jnp.inf
  )
  blocks = padded.reshape(*lead, n, 128)
  best = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  inside = jnp.take_along_axis(blocks, best[..., None, None], axis=-2)
  return best * 128 + jnp.argmax(inside[..., 0, :], axis=-1)


@jax.custom_vjp
def matmul_nn(x2, w2):
  """x2 @ w2 whose gradient for x2 multiplies by a stored copy of w2^T."""
  return jax.lax.dot_general(x2, w2, (((1,), (0,)), ((), ())))


def _matmul_nn_fwd(x2, w2):
  return matmul_nn(x2, w2), (x2, w2)


def _matmul_nn_bwd(res, dy):
  x2, w2 = res
  w2_t = jax.lax.optimization_barrier(w2.T)
  dx = jax.lax.dot_general(dy, w2_t, (((1,), (0,)), ((), ())))
  dw = jax.lax.dot_general(x2, dy, (((0,), (0,)), ((), ())))
  return dx, dw


matmul_nn.defvjp(_matmul_nn_fwd, _matmul_nn_bwd)


def project_nn(equation, x, w):
  """layers.project with matmul_nn for the 'lead+in, in+out' equations."""
  return flat_in_out(equation, x, w, matmul_nn)


def project_f32acc(equation, x, w):
  """layers.project with layers.matmul_f32_acc, whatever the dtype, for
  the 'lead+in, in+out' equations: W's gradient an NN product over a
  transposed copy of x, as for bfloat16."""
  return flat_in_out(
    equation, x, w, lambda x2, w2: layers.matmul_f32_acc(x2, w2, 0)
  )


def flat_in_out(equation, x, w, product):
  """layers.project with `product` (x2, w2) -> y2 for the equations whose
  W is stored [in, out]; others go to layers.project as they are."""
  operands, out = equation.split('->')
  x_spec, w_spec = operands.split(',')
  lead = ''.join(c for c in x_spec if c in out)
  contracted = x_spec[len(lead) :]
  w_out = ''.join(c for c in w_spec if c not in contracted)
  if not (
    contracted
    and x_spec == lead + contracted
    and w_spec == contracted + w_out
    and out == lead + w_out
  ):
    return PROJECT(equation, x, w)
  k = math.prod(x.shape[len(lead) :])
  y2 = product(x.reshape(-1, k), w.reshape(k, -1))
  return y2.reshape(*x.shape[: len(lead)], *w.shape[len(contracted) :])


def heads_first_attention(self, q, k, v, mask, bias, deterministic, blocks):
  """MultiHeadAttention._einsum_attention with q, k and v transposed once,
  behind an optimization barrier, to [B, H, L, K], [B, H, K, S] and
  [B, H, S, K], and every block's products taken from those."""
  cfg, dtype = self.cfg, self.cfg.jnp_dtype
  B, L, H, _ = q.shape
  S = k.shape[1]
  if cfg.attention_scale:
    q = q / jnp.sqrt(cfg.head_dim).astype(dtype)
  q_BHLK, k_BHKS, v_BHSK = jax.lax.optimization_barrier(
    (q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))
  )
  probs = []
  for q0, q1, s1 in blocks:
    logits = jnp.einsum(
      'BHLK,BHKS->BHLS', q_BHLK[:, :, q0:q1], k_BHKS[..., :s1]
    ).astype(jnp.float32)
    if bias is not None:
      logits = logits + bias[..., q0:q1, :s1]
    if mask is not None:
      big_neg = jnp.finfo(jnp.float32).min
      logits = jnp.where(mask[..., q0:q1, :s1], logits, big_neg)
    probs.append(jax.nn.softmax(logits, axis=-1).astype(dtype))
  probs = layers.Dropout(cfg.attention_dropout_rate).blocks(
    probs, (B, H, L, S), [(0, 0, q0, 0) for q0, _, _ in blocks], deterministic
  )
  outs = [
    jnp.einsum('BHLS,BHSK->BHLK', p, v_BHSK[:, :, :s1])
    for p, (_, _, s1) in zip(probs, blocks, strict=True)
  ]
  return jnp.concatenate(outs, axis=2).transpose(0, 2, 1, 3)


def plain_matmul(x2, w2, w_in):
  """x2 @ w2 with a result in the operands' dtype, jax's own gradients."""
  return jax.lax.dot_general(x2, w2, (((1,), (w_in,)), ((), ())))


def full_last_layer(stack, x_BLD, ctx, deterministic, out_BP=None):
  """Stack._layers with every layer at every position, gathered after."""
  x_BLD, states = STACK_LAYERS(stack, x_BLD, ctx, deterministic)
  if out_BP is not None:
    x_BLD = transformer.rows_at(x_BLD, out_BP)
  return x_BLD, states


STEP_IS_FINITE = train.step_is_finite


STACK_LAYERS = transformer.Stack._layers
EINSUM_ATTENTION = layers.MultiHeadAttention._einsum_attention
HEADS = heads.is_argmax, heads.sample_categorical, heads.add_vocab_bias
GELU = layers.ACTIVATIONS['gelu']
PROJECT = layers.project


def compile_variant(trainer, state, batch, variant: str):
  """The train step compiled with `variant` patched in."""
  patched = (
    'keep_mask',
    'DROPOUT_BITS',
    'random_words',
    'threefry2x32',
    'causal_blocks',
    'relative_bias_by_index',
    'project',
    'matmul_f32_acc',
  )
  if variant.startswith('accum:'):
    jax.clear_caches()
    jitted = trainer.jit_step(int(variant.removeprefix('accum:')))
    return jitted.lower(state, batch).compile()
  if variant.startswith('xla:'):
    options = configlib.parse_compiler_options(
      variant.removeprefix('xla:'), variant
    )
    jax.clear_caches()
    lowered = trainer.train_step.lower(state, batch)
    return lowered.compile(compiler_options=options)
  saved = {name: getattr(layers, name) for name in patched}
  if variant == 'last_full':
    transformer.Stack._layers = full_last_layer
  elif variant in (
    'last',
    'attention',
    'causal',
    'vocab',
    'relative',
    'bias',
    'gelu',
    'project',
    'finite',
  ):
    pass
  elif variant == 'finite_grads':
    train.step_is_finite = lambda loss, grad_norm, updates: (
      jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    )
  elif variant == 'project_einsum':
    layers.project = jnp.einsum
  elif variant == 'project_nn':
    layers.project = project_nn
  elif variant == 'project_f32acc':
    layers.project = project_f32acc
  elif variant == 'attention_heads_first':
    layers.MultiHeadAttention._einsum_attention = heads_first_attention
  elif variant == 'project_plain':
    layers.matmul_f32_acc = plain_matmul
  elif variant == 'gelu_erfc':
    layers.ACTIVATIONS['gelu'] = lambda x: jax.nn.gelu(x, approximate=False)
  elif variant == 'bias_sum':
    heads.add_vocab_bias = lambda logits, bias: logits + bias
  elif variant == 'vocab_gumbel':
    heads.sample_categorical = gumbel_sample
  elif variant == 'vocab_jax':
    heads.is_argmax = lambda logits, labels: jnp.argmax(logits, -1) == labels
    heads.sample_categorical = jax.random.categorical
  elif variant == 'relative_rows':  # no stack bias: layers use the table
    layers.relative_bias_by_index = lambda *args, **kwargs: None
  elif variant == 'causal_full':
    layers.causal_blocks = lambda L, S, chunk: [(0, L, S)]
  elif variant == 'flax':
    layers.keep_mask = flax_mask
  elif variant == '16xor':
    layers.random_words = xor_words
  elif variant == 'none':
    layers.keep_mask = lambda rng, shape, keep_prob: (True, 1.0)
  elif variant == '16loop':
    layers.threefry2x32 = looped_hash
  else:
    layers.DROPOUT_BITS = int(variant)
  try:
    jax.clear_caches()  # retrace: the patch is invisible to jit's cache
    return trainer.train_step.lower(state, batch).compile()
  finally:
    heads.is_argmax, heads.sample_categorical, heads.add_vocab_bias = HEADS
    transformer.Stack._layers = STACK_LAYERS
    layers.MultiHeadAttention._einsum_attention = EINSUM_ATTENTION
    train.step_is_finite = STEP_IS_FINITE
    layers.ACTIVATIONS['gelu'] = GELU
    for name, value in saved.items():
      setattr(layers, name, value)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--config', default='configs/bert.py:size=small')
  p.add_argument('--batch_size', type=int, default=32)
  p.add_argument('--rounds', type=int, default=10)
  p.add_argument('--variants', default='flax,16,8')
  p.add_argument(
    '--cpu_compiler_options',
    default=None,
    help="replaces the config's train.compiler_options.cpu",
  )
  p.add_argument(
    '--init',
    default='',
    help='a pretraining workdir: --config is a fine-tuning config',
  )
  p.add_argument(
    '--seq_len', type=int, default=0, help="fine-tuning's task.seq_len"
  )
  p.add_argument(
    '--dtype', default='', help="the config's model.dtype (e.g. bfloat16)"
  )
  args = p.parse_args()
  config = configlib.load_file(args.config)
  if args.dtype:
    config.model.dtype = args.dtype
  if args.cpu_compiler_options is not None:
    config.train.compiler_options.cpu = args.cpu_compiler_options
  variants = args.variants.split(',')
  workdir = tempfile.mkdtemp(prefix='ab_step_')
  atexit.register(shutil.rmtree, workdir, ignore_errors=True)
  if args.init:  # fine-tuning: its first batch of the task's rows
    config.init.workdir = args.init
    config.train.batch_size = args.batch_size
    config.task.seq_len = args.seq_len or config.task.seq_len
    config.task.max_train_examples = args.batch_size
    config.task.max_eval_examples = args.batch_size
    trainer = ft_trainer.Trainer(config, workdir)
    host = trainer.train_batch(0)
    seq_len = config.task.seq_len
  else:
    config.data.batch_size = args.batch_size
    step.first_stage(config)
    trainer = train.Trainer(config, workdir)
    host = next(
      pipeline.train_dataset(config, trainer.tokenizer).as_numpy_iterator()
    )
    seq_len = config.data.seq_len
  state = trainer.initial_state()
  times = {v: [] for v in variants}
  with trainer.context():
    batch = sharding.host_to_global(host, trainer.mesh)
    steps = {v: compile_variant(trainer, state, batch, v) for v in variants}
    for r in range(args.rounds + 1):  # round 0 warms up
      for v in variants if r % 2 else variants[::-1]:
        start = time.perf_counter()
        state, metrics = steps[v](state, batch)
        jax.block_until_ready((state, metrics))
        if r:
          times[v].append(time.perf_counter() - start)

  print(f'{args.config}, batch {args.batch_size} x {seq_len}')
  first = times[variants[0]]
  for v in variants:
    ratios = [t / b for t, b in zip(times[v], first, strict=True)]
    print(
      f'{v:>9}: median step {statistics.median(times[v]):.3f} s, '
      f'median ratio to {variants[0]} {statistics.median(ratios):.3f}, '
      f'faster in {sum(r < 1 for r in ratios)}/{len(ratios)} rounds'
    )


if __name__ == '__main__':
  sys.exit(main())
