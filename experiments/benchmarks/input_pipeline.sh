#!/usr/bin/env bash
# The input-pipeline table of input_pipeline.md: time to the first batch at
# a step (what a resume there costs) and tokens/s, raw text against
# prepared rows, tiny BERT (MLM), batch 32 x 128; one JSON line per run.
#
#   experiments/benchmarks/input_pipeline.sh CORPORA TOKENIZER > rows.jsonl
#
# CORPORA holds 10mb/text.txt and 100mb/text.txt (WikiText-2 repeated) and
# their preparations prep_10mb/ and prep_100mb/ (prepare_memory.py).
set -euo pipefail
corpora=$1 tok=$2
bench() {
  .venv/bin/python -m pretrain_lm.bench --config=configs/bert.py:size=tiny \
    --what=pipeline --pipeline_cached=false --pipeline_batches=50 \
    --config.data.eval_source= --config.data.eval_batches=1 \
    --config.data.tokenizer="$tok" "$@" 2>/dev/null | tail -n 1
}
# Epochs: 10 MB is 718 batches, 100 MB 6,464; the middle of the first.
for step in 0 359 1000000; do
  bench --config.data.source="prepared:$corpora/prep_10mb" --start_step=$step
done
for step in 0 3232 1000000; do
  bench --config.data.source="prepared:$corpora/prep_100mb" --start_step=$step
done
for step in 0 359 1000; do
  bench --config.data.source="$corpora/10mb/text.txt" --start_step=$step
done
for step in 0 3232; do
  bench --config.data.source="$corpora/100mb/text.txt" --start_step=$step
done
