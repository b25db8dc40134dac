#!/bin/bash
# Exports the GPU rows of the benchmark table, and the variants that say
# where a step's time goes, into .gpu_export/ (run from the repository root
# on a machine with `make .venv/.installed`; carry .gpu_export to the GPU
# machine and run experiments/benchmarks/gpu/run_device.sh there).
set -euo pipefail
PY=${PY:-.venv/bin/python}
BF16=(--config.model.dtype=bfloat16 --config.model.attention_dropout_rate=0)
export_step() {  # NAME, then the export flags
  local name=$1
  shift
  "$PY" experiments/benchmarks/gpu/export.py --platform=cuda \
    --out=".gpu_export/$name" "$@" 2>&1 | tail -1 | cut -c1-120
}
BERT=(--config=configs/bert.py:size=base "${BF16[@]}" --batch_size=256)
GPT=(--config=configs/gpt.py:size=small "${BF16[@]}" --batch_size=32)
T5=(--config=configs/t5.py:size=base "${BF16[@]}" --batch_size=128)
# The table's rows: cuDNN's fused attention, threefry dropout masks.
export_step bert_base_cudnn "${BERT[@]}" --config.model.attention_impl=cudnn
export_step gpt2_small_cudnn "${GPT[@]}" --config.model.attention_impl=cudnn
export_step t5_base_cudnn "${T5[@]}" --config.model.attention_impl=cudnn
# One change each: XLA's attention; RngBitGenerator masks; no dropout.
export_step bert_base_xla "${BERT[@]}" --config.model.attention_impl=xla
JAX_DEFAULT_PRNG_IMPL=unsafe_rbg export_step bert_base_cudnn_rbg \
  "${BERT[@]}" --config.model.attention_impl=cudnn
export_step bert_base_cudnn_nodropout "${BERT[@]}" \
  --config.model.attention_impl=cudnn --config.model.dropout_rate=0
JAX_DEFAULT_PRNG_IMPL=unsafe_rbg export_step gpt2_small_cudnn_rbg \
  "${GPT[@]}" --config.model.attention_impl=cudnn
# Layers under nn.scan: one layer's initialisation and step to compile
# instead of twelve (or 24 for T5), which cuts the initialisation's compile
# several-fold (experiments/benchmarks/init_compile.py times it).
export_step bert_base_cudnn_scan "${BERT[@]}" \
  --config.model.attention_impl=cudnn --config.model.scan_layers=True
export_step t5_base_cudnn_scan "${T5[@]}" \
  --config.model.attention_impl=cudnn --config.model.scan_layers=True
# cuDNN attention's output and gradients for four masks, checked there
# against float32 attention by `attention_check.py run DIR`.
"$PY" experiments/benchmarks/gpu/attention_check.py export \
  .gpu_export/attention_check
du -sh .gpu_export/*
