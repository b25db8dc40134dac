#!/bin/bash
# The decoding row (KV cache against full recompute, batch 1 and 32) on a
# GPU machine that has JAX and flax's dependencies but not TensorFlow or
# ml_collections: `--what=decode` imports no TensorFlow, so it runs there
# with flax and ml_collections carried as wheels in .whl/ (fetch them here
# with `pip download --no-deps --only-binary=:all: --python-version 3.12
# -d .whl flax==0.12.8 ml-collections==1.1.0`). Run from the repository
# root; writes $OUT/decode.log.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
timeout "${DECODE_TIMEOUT:-300}" python3 -m pretrain_lm.bench \
  --config=configs/gpt.py:size=small --config.model.dtype=bfloat16 \
  --what=decode 2>&1 | grep -v '^W0000\|^I0000' | tee "$OUT/decode.log"
