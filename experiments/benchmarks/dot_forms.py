r"""One matrix product alone, in the three forms a train step uses.

  python experiments/benchmarks/dot_forms.py [--shapes=1024x512x2048,...]
      [--dtype=bfloat16]

For each M x K x N it times, each jitted alone on the default backend:
- `NN`: x[M, K] . W[K, N], a projection's forward;
- `NT`: dy[M, K] . W[N, K] over both last dims, x's gradient (dy W^T);
- `TN`: x[K, M] . dy[K, N] over both first dims, W's gradient (x^T dy);
- `NT+TN`: both gradients' products in one jit, as a backward runs them.
Prints the median of --repeats calls in ms and GFLOP/s. Defaults: BERT-
small's MLP products at 32 x 128 tokens, in both directions.

With `--dtype=bfloat16` the operands are bfloat16 and each form is timed
twice: with a bfloat16 result, and (`/f32`) accumulating into a float32
result, as layers.matmul_f32_acc does; `TN/f32 copy` is the weight
gradient's product over a transposed copy of x (layers._rows_first), the
form matmul_f32_acc uses.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from pretrain_lm.models import layers


def median_ms(fn, *args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def product(lhs_dim, rhs_dim, result=None):
  dims = (((lhs_dim,), (rhs_dim,)), ((), ()))
  return jax.jit(
    lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=result)
  )


def copy_tn(x_km, dy):
  """x^T dy over a transposed copy of x ([M, K] written out first)."""
  x_mk = layers._rows_first(x_km)
  return jnp.dot(x_mk, dy, preferred_element_type=jnp.float32)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--shapes', default='1024x512x2048,1024x2048x512')
  p.add_argument('--repeats', type=int, default=15)
  p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])
  args = p.parse_args()
  dtype = jnp.dtype(args.dtype)
  nn, nt, tn = product(1, 0), product(1, 1), product(0, 0)
  both = jax.jit(lambda dy, w, x, g: (nt(dy, w), tn(x, g)))
  f32 = jnp.float32
  print(
    f'backend {jax.default_backend()}, {args.dtype} operands, median of '
    f'{args.repeats} calls'
  )
  for shape in args.shapes.split(','):
    M, K, N = (int(d) for d in shape.split('x'))
    keys = jax.random.split(jax.random.key(0), 4)
    a = jax.random.normal(keys[0], (M, K), dtype)
    w_kn = jax.random.normal(keys[1], (K, N), dtype)
    w_nk = jax.random.normal(keys[2], (N, K), dtype)
    a_km = jax.random.normal(keys[3], (K, M), dtype)
    gflop = 2 * M * K * N / 1e9
    rows = {
      'NN': median_ms(nn, a, w_kn, repeats=args.repeats),
      'NT': median_ms(nt, a, w_nk, repeats=args.repeats),
      'TN': median_ms(tn, a_km, w_kn, repeats=args.repeats),
    }
    if dtype != f32:
      r = args.repeats
      rows['NN/f32'] = median_ms(product(1, 0, f32), a, w_kn, repeats=r)
      rows['NT/f32'] = median_ms(product(1, 1, f32), a, w_nk, repeats=r)
      rows['TN/f32'] = median_ms(product(0, 0, f32), a_km, w_kn, repeats=r)
      rows['TN/f32 copy'] = median_ms(jax.jit(copy_tn), a_km, w_kn, repeats=r)
    together = median_ms(both, a, w_nk, a_km, w_kn, repeats=args.repeats)
    cells = [
      f'{name} {ms:.1f} ms ({gflop / ms * 1e3:.0f} GFLOP/s)'
      for name, ms in rows.items()
    ]
    alone = rows['NT'] + rows['TN']
    cells.append(f'NT+TN {together:.1f} ms (the two alone: {alone:.1f})')
    print(f'{M}x{K}x{N}: ' + ', '.join(cells), flush=True)


if __name__ == '__main__':
  main()
