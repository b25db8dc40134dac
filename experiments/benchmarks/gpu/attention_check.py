r"""Checks kernels.cudnn.attention on a GPU against float32 attention.

cuDNN's kernel runs on NVIDIA GPUs only, so the CPU suite can check how
it is lowered (tests/kernels_test.py) but not what it computes. This
script does the rest in two halves, so that the GPU machine needs only
jax and numpy, and runs the program this jax version lowers:

  .venv/bin/python experiments/benchmarks/gpu/attention_check.py \
      export .gpu_export/attention_check          # here, on the CPU
  python3 experiments/benchmarks/gpu/attention_check.py \
      run .gpu_export/attention_check             # on the GPU machine

`export` lowers fused_attention's (output, gradients) for each case's
shapes, for `cuda`. `run` draws each case's bf16 queries, keys, values,
packed-segment mask and output cotangent (numpy's seeded generator, the
same on both machines), computes the attention and its gradients in
float32 from them (an einsum softmax at full matmul precision) and with
the exported kernel, and prints one JSON line per case with the largest
error relative to the reference's largest value; it exits 1 if any is
over 2% (bf16 keeps 8 bits).

Cases: packed bidirectional rows (BERT), packed causal rows (GPT-2, the
kernel's causal mask type), the last layer's predicted rows against all
keys (BERT's output positions), and T5's learned relative bias, whose
gradient the kernel must still return.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

THRESHOLD = 0.02
# name: (B, L query rows, S keys, H, K, causal, learned bias, P outputs)
CASES = {
  'bert_packed': (4, 128, 128, 12, 64, False, False, 0),
  'gpt2_packed_causal': (2, 1024, 1024, 12, 64, True, False, 0),
  'bert_output_rows': (4, 128, 128, 12, 64, False, False, 20),
  't5_bias_causal': (2, 512, 512, 12, 64, True, True, 0),
}


def segments(rng, B, L):
  """Packed rows: 1, 2, ... runs of random lengths, then padding (0)."""
  seg = np.zeros((B, L), np.int32)
  for b in range(B):
    pos, s = 0, 1
    end = L - rng.integers(0, L // 8)
    while pos < end:
      n = min(int(rng.integers(L // 8, L // 2)), end - pos)
      seg[b, pos : pos + n] = s
      pos, s = pos + n, s + 1
  return seg


def draw(name):
  """A case's inputs (bf16, as the model gives them) and its mask."""
  B, L, S, H, K, causal, learned, P = CASES[name]
  rng = np.random.default_rng(len(name))
  seg = segments(rng, B, L)
  mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
  if causal:
    mask &= np.tril(np.ones((L, S), bool))
  q_rows = np.arange(L)[None].repeat(B, 0)
  if P:  # the predicted positions, in order, of real tokens
    q_rows = np.sort(
      np.stack([rng.choice(np.flatnonzero(s), P, replace=False) for s in seg]),
      axis=1,
    )
    mask = np.take_along_axis(mask, q_rows[:, :, None], axis=1)
  Lq = q_rows.shape[1]

  def bf16(*shape):
    return np.asarray(rng.standard_normal(shape), jnp.bfloat16)

  args = {
    'q': bf16(B, Lq, H, K),
    'k': bf16(B, S, H, K),
    'v': bf16(B, S, H, K),
    'mask': mask[:, None],
    # Rows that see no key (padding) are left out of the loss.
    'cotangent': np.where(
      mask.any(-1)[:, :, None, None], rng.standard_normal((B, Lq, H, K)), 0
    ).astype(np.float32),
  }
  if learned:
    args['bias'] = bf16(B, H, Lq, S)
  return args, causal


def grads_of(attention, args):
  """(output, dq, dk, dv[, dbias]) of sum(attention * cotangent)."""
  names = ['q', 'k', 'v'] + (['bias'] if 'bias' in args else [])

  def loss(*xs):
    kw = dict(zip(names, xs, strict=True))
    out = attention(kw['q'], kw['k'], kw['v'], kw.get('bias'), args['mask'])
    return jnp.sum(out.astype(jnp.float32) * args['cotangent']), out

  argnums = tuple(range(len(names)))
  grads, out = jax.grad(loss, argnums=argnums, has_aux=True)(
    *[args[n] for n in names]
  )
  return (out, *grads)


def reference(q, k, v, bias, mask):
  """Float32 softmax attention of the bf16 inputs."""
  scale = 1 / np.sqrt(q.shape[-1])
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  logits = jnp.einsum('BLHK,BSHK->BHLS', q, k) * scale
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  logits = jnp.where(mask, logits, -1e30)
  return jnp.einsum('BHLS,BSHK->BLHK', jax.nn.softmax(logits, -1), v)


def export_cases(directory):
  import export  # noqa: PLC0415 (this directory's, beside the script)

  from pretrain_lm.models.kernels import cudnn as kernel  # noqa: PLC0415

  os.makedirs(directory, exist_ok=True)
  for name in CASES:
    args, causal = draw(name)

    def cudnn(q, k, v, bias, mask, causal=causal):
      return kernel.attention(
        q,
        k,
        v,
        bias_BHLS=bias,
        mask_B1LS=mask,
        scale=1 / np.sqrt(q.shape[-1]),
        causal=causal,
        implementation='cudnn',
      )

    def step(args):
      return grads_of(cudnn, args)

    disabled = [
      jax.export.DisabledSafetyCheck.custom_call(t)
      for t in export.cudnn_targets()
    ]
    with kernel.cudnn_off_gpu(90800):
      exported = jax.export.export(
        jax.jit(step), platforms=['cuda'], disabled_checks=disabled
      )(args)
    with open(os.path.join(directory, f'{name}.bin'), 'wb') as f:
      f.write(exported.serialize())
    print(name, 'exported')


def run_cases(directory):
  worst = 0.0
  for name in CASES:
    with open(os.path.join(directory, f'{name}.bin'), 'rb') as f:
      exported = jax.export.deserialize(bytearray(f.read()))
    args, _ = draw(name)
    with jax.default_matmul_precision('highest'):
      expected = jax.jit(lambda a: grads_of(reference, a))(args)
    got = exported.call(args)
    errors = []
    for g, e in zip(got, expected, strict=True):
      e = np.asarray(e).astype(np.float32)
      g = np.asarray(g).astype(np.float32)
      errors.append(float(np.abs(g - e).max() / np.abs(e).max()))
    worst = max(worst, *errors)
    labels = ['out', 'dq', 'dk', 'dv', 'dbias'][: len(errors)]
    print(json.dumps({'case': name, **dict(zip(labels, errors, strict=True))}))
  print(json.dumps({'worst': worst, 'threshold': THRESHOLD}))
  return 0 if worst <= THRESHOLD else 1


if __name__ == '__main__':
  if len(sys.argv) != 3 or sys.argv[1] not in ('export', 'run'):
    sys.exit(__doc__)
  if sys.argv[1] == 'export':
    export_cases(sys.argv[2])
  else:
    sys.exit(run_cases(sys.argv[2]))
