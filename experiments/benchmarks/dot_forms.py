r"""One matrix product alone, in the three forms a train step uses.

  python experiments/benchmarks/dot_forms.py [--shapes=1024x512x2048,...]

For each M x K x N it times, each jitted alone on the default backend:
- `NN`: x[M, K] . W[K, N], a projection's forward;
- `NT`: dy[M, K] . W[N, K] over both last dims, x's gradient (dy W^T);
- `TN`: x[K, M] . dy[K, N] over both first dims, W's gradient (x^T dy);
- `NT+TN`: both gradients' products in one jit, as a backward runs them.
Prints the median of --repeats calls in ms and GFLOP/s. Defaults: BERT-
small's MLP products at 32 x 128 tokens, in both directions.
"""

import argparse
import statistics
import time

import jax


def median_ms(fn, *args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def product(lhs_dim, rhs_dim):
  dims = (((lhs_dim,), (rhs_dim,)), ((), ()))
  return jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims))


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--shapes', default='1024x512x2048,1024x2048x512')
  p.add_argument('--repeats', type=int, default=15)
  args = p.parse_args()
  nn, nt, tn = product(1, 0), product(1, 1), product(0, 0)
  both = jax.jit(lambda dy, w, x, g: (nt(dy, w), tn(x, g)))
  print(f'backend {jax.default_backend()}, median of {args.repeats} calls')
  for shape in args.shapes.split(','):
    M, K, N = (int(d) for d in shape.split('x'))
    keys = jax.random.split(jax.random.key(0), 4)
    a = jax.random.normal(keys[0], (M, K))
    w_kn = jax.random.normal(keys[1], (K, N))
    w_nk = jax.random.normal(keys[2], (N, K))
    a_km = jax.random.normal(keys[3], (K, M))
    gflop = 2 * M * K * N / 1e9
    rows = {
      'NN': median_ms(nn, a, w_kn, repeats=args.repeats),
      'NT': median_ms(nt, a, w_nk, repeats=args.repeats),
      'TN': median_ms(tn, a_km, w_kn, repeats=args.repeats),
    }
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
