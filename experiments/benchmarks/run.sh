#!/usr/bin/env bash
# Every CPU row of experiments/benchmarks/README.md, one JSON line each in
# $OUT (default experiments/benchmarks/cpu.jsonl); `python
# experiments/benchmarks/table.py $OUT` prints the tables. About 30 minutes
# on a 2-core CPU; run it on an otherwise idle machine. The BERT rows
# against the peer need its transformers 4.x (peer.py says how to install
# it); without it they are skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-experiments/benchmarks/cpu.jsonl}
# The CPU has no datasheet peak: XLA's best matmul, measured first, is the
# one MFU divides by (float32; bfloat16 for the bf16 row).
peak() {
  "$PY" experiments/benchmarks/matmul_peak.py --dtype="$1" | tail -n 1 \
    | tee -a "$OUT" | "$PY" -c 'import json, sys
print(json.load(sys.stdin)["xla_matmul_flops"])'
}
PEAK=$(peak float32)
PEAK_BF16=$(peak bfloat16)
bench() {
  "$PY" -m pretrain_lm.bench "$@" \
    --config.train.peak_flops_per_device="${P:-$PEAK}" | tail -n 1 >> "$OUT"
}
peer() {
  "$PY" experiments/benchmarks/peer.py "$@" \
    --config.train.peak_flops_per_device="$PEAK" | tail -n 1 >> "$OUT" \
    || echo "peer row skipped: $*" >&2
}

# Train steps: BERT at three sizes (the tiny rows keep BERT's 30,522-piece
# vocabulary, as Turc et al.'s compact BERTs do), then the other families
# at their presets' shapes, a CPU-sized batch.
bench --config=configs/bert.py:size=base --batch_size=32 --steps=5
bench --config=configs/bert.py:size=small --batch_size=32
bench --config=configs/bert.py:size=tiny --config.model.vocab_size=30522 --batch_size=32
bench --config=configs/gpt.py:size=small --batch_size=4 --steps=5
bench --config=configs/t5.py:size=base --batch_size=8 --steps=5
bench --config=configs/bart.py:size=base --batch_size=8 --steps=5
bench --config=configs/electra.py:size=small --batch_size=32
# BERT against Hugging Face's Flax BERT, one step of each in turn.
peer --config=configs/bert.py:size=base --batch_size=32 --steps=5
peer --config=configs/bert.py:size=small --batch_size=32
# Levers, each against the baseline just before it (BERT-base, batch 16).
lever() { bench --config=configs/bert.py:size=base --batch_size=16 --steps=3 "$@"; }
lever
JAX_DEFAULT_PRNG_IMPL=unsafe_rbg lever
P=$PEAK_BF16 lever --config.model.dtype=bfloat16
lever --config.model.attention_dropout_rate=0.0
lever --config.model.attention_dropout_rate=0.0 --config.model.attention_impl=xla
# Compile time with the layers scanned (the rows above are unrolled).
for c in bert.py:size=base gpt.py:size=small t5.py:size=base; do
  bench --config=configs/$c --config.model.scan_layers=True --batch_size=4 \
      --steps=2 --warmup=1
done
# Input pipelines (raw text, cached ids) and packing; 32 rows a batch (a
# preset's 512 rows of 1024 tokens are more than the bundled corpus holds).
for c in bert.py:size=base gpt.py:size=small t5.py:size=base; do
  bench --config=configs/$c --what=pipeline --batch_size=32
done
# KV-cached decoding against full recomputation at length 512.
bench --config=configs/gpt.py:size=small --what=decode --repeats=1
