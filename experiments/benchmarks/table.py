"""Markdown tables from the JSON lines of the bench, peer.py and matmul_peak.py.

python experiments/benchmarks/table.py experiments/benchmarks/cpu.jsonl
"""

import json
import re
import sys


def name(r: dict) -> str:
  """'bert.py:size=base' from the run's arguments."""
  m = re.search(r'--config=configs/(\S+)', r['args'])
  return m.group(1) if m else r['args']


def overrides(r: dict) -> str:
  """The run's --config.* overrides, and a PRNG other than the default."""
  args = [a for a in r['args'].split() if a.startswith('--config.')]
  if r.get('prng_impl', 'threefry2x32') != 'threefry2x32':
    args.append(f'JAX_DEFAULT_PRNG_IMPL={r["prng_impl"]}')
  return ' '.join(args)


def pct(v) -> str:
  return f'{v:.0%}' if v is not None else '-'


def train_tables(rows: list[dict], peaks: list[dict]) -> None:
  unrolled = [r for r in rows if 'scan_layers=True' not in r['args']]
  print(
    '| model | batch x length | step s (median) | tokens/s | model '
    'GFLOP/token | TFLOP/s | MFU | peak TFLOP/s | compile s |'
  )
  print('|---|---|---:|---:|---:|---:|---:|---:|---:|')
  for r in unrolled:
    peak = r.get('peak_tflops')
    print(
      f'| {name(r)} {overrides(r)} | {r["batch_size"]} x {r["seq_len"]} '
      f'| {r["step_s"]:.3f} | {r["tokens_per_s"]:,.0f} '
      f'| {r["model_flops_per_token"] / 1e9:.3f} '
      f'| {r["achieved_tflops"]:.3f} | {pct(r.get("mfu"))} '
      f'| {f"{peak:.3f}" if peak else "-"} | {r["compile_s"]:.1f} |'
    )
  if peaks:
    print()
    print('| matmul peak | dtype | XLA TFLOP/s | NumPy | PyTorch |')
    print('|---|---|---:|---:|---:|')
    for r in peaks:
      tflops = [
        r.get(f'{k}_matmul_flops', 0) / 1e12 for k in ('xla', 'numpy', 'torch')
      ]
      print(
        f'| {r["device_kind"]} | {r["dtype"]} | '
        + ' | '.join(f'{t:.3f}' for t in tflops)
        + ' |'
      )
  scanned = [r for r in rows if 'scan_layers=True' in r['args']]
  if scanned:
    print()
    print('| model | compile s, layers unrolled | compile s, scanned |')
    print('|---|---:|---:|')
    for r in scanned:
      same = [u for u in unrolled if name(u) == name(r)]
      before = f'{same[0]["compile_s"]:.1f}' if same else '-'
      print(f'| {name(r)} | {before} | {r["compile_s"]:.1f} |')


def peer_table(rows: list[dict]) -> None:
  print(
    '| model | batch x length | ours tokens/s | peer tokens/s | speedup '
    '| ours MFU | peer MFU | peer FLOPs / ours |'
  )
  print('|---|---|---:|---:|---:|---:|---:|---:|')
  for r in rows:
    flops = r['peer_model_flops_per_token'] / r['model_flops_per_token']
    print(
      f'| {name(r)} | {r["batch_size"]} x {r["seq_len"]} '
      f'| {r["tokens_per_s"]:,.0f} | {r["peer_tokens_per_s"]:,.0f} '
      f'| {r["speedup_vs_peer"]:.2f}x | {pct(r.get("mfu"))} '
      f'| {pct(r.get("peer_mfu"))} | {flops:.2f}x |'
    )


def pipeline_table(rows: list[dict], train_rows: list[dict]) -> None:
  print(
    '| pipeline | batch x length | raw text tokens/s per core | cached ids '
    'tokens/s per core | non-pad tokens | train step eats (tokens/s) '
    '| pipeline / train step | one H100 at 50% MFU needs, per 8 cores |'
  )
  print('|---|---|---:|---:|---:|---:|---:|---:|')
  for r in rows:
    eats = [t['tokens_per_s'] for t in train_rows if name(t) == name(r)]
    # Rows before bench.inputs named the stream's figures raw_*.
    raw = r.get('tokens_per_s', r.get('raw_tokens_per_s'))
    raw_core = r.get(
      'tokens_per_s_per_core', r.get('raw_tokens_per_s_per_core')
    )
    ratio = f'{raw / eats[0]:,.0f}x' if eats else '-'
    # Prepared corpora and --pipeline_cached=false have no cached figure.
    cached = r.get('cached_tokens_per_s_per_core')
    eats_s = f'{eats[0]:,.0f}' if eats else '-'
    print(
      f'| {name(r)} | {r["batch_size"]} x {r["seq_len"]} '
      f'| {raw_core:,.0f} '
      f'| {f"{cached:,.0f}" if cached else "-"} '
      f'| {r["non_pad_fraction"]:.2%} '
      f'| {eats_s} | {ratio} '
      f'| {r["h100_tokens_per_s_per_8_cores_needed"]:,.0f} |'
    )


def decode_table(rows: list[dict]) -> None:
  print(
    '| model | length | batch | cached tokens/s | cached s/token step '
    '| full forward s | cache speedup |'
  )
  print('|---|---:|---:|---:|---:|---:|---:|')
  for r in rows:
    for key, d in r.items():
      if key.startswith('batch') and isinstance(d, dict):
        print(
          f'| {name(r)} | {r["length"]} | {key[5:]} '
          f'| {d["cached_tokens_per_s"]:,.1f} | {d["cached_s_per_step"]:.4f} '
          f'| {d["full_forward_s"]:.3f} | {d["cache_speedup"]:.1f}x |'
        )


def main(path: str) -> None:
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.startswith('{')]
  by = {
    w: [r for r in rows if r.get('what') == w]
    for w in ('train', 'peer', 'matmul_peak', 'pipeline', 'decode')
  }
  r0 = next(r for r in reversed(rows) if 'cpu' in r)  # older: fewer fields
  family = r0.get('cpu_family')
  model = ' '.join(
    x for x in (r0.get('cpu_model'), family and f'(family/model {family})') if x
  )
  print(
    f'Machine: {" ".join(x for x in (r0["cpu"], model) if x)}, '
    f'{r0["cpu_cores"]} cores, backend '
    f'{r0["backend"]}, jax {r0["jax"]}, {r0["date"]}.\n'
  )
  train_tables(by['train'], by['matmul_peak'])
  # Lines written before peer.py held the peer's figures in train rows.
  peers = by['peer'] + [r for r in by['train'] if 'peer_tokens_per_s' in r]
  if peers:
    print()
    peer_table(peers)
  print()
  pipeline_table(by['pipeline'], by['train'])
  print()
  decode_table(by['decode'])


if __name__ == '__main__':
  main(sys.argv[1])
