#!/bin/bash
# Times train steps exported by `python -m pretrain_lm.bench.export` on a
# GPU machine that has JAX but not our input stack; run from the
# repository root: run_device.sh DIR... (experiments/benchmarks/README.md,
# "Train steps on one H100", has the export commands and the results).
# Each step runs in its own process under a time limit, so one that fails
# or hangs leaves the others' figures.
export PYTHONUNBUFFERED=1
# Exports that differ only in dropout or the attention kernel have the same
# initialisation program, byte for byte: compile it once (the step programs
# all differ, so compile_s stays real).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
  --format=csv | tee "$OUT/machine.txt"
python3 -c 'import jax, jaxlib; print("jax", jax.__version__, jax.devices())' \
  2>&1 | tee -a "$OUT/machine.txt"
# The datasheet peak is what MFU is taken against; XLA's best bf16 matmul
# on the same card (bench/peak.py: fastest of 5 calls) is context.
python3 -c 'from pretrain_lm.bench import peak
tflops = peak.xla_matmul_flops("bfloat16", sizes=(8192,)) / 1e12
print(f"XLA bf16 matmul 8192^3: {tflops:.0f} TFLOP/s (fastest of 5)")' \
  2>&1 | grep -v '^W0000\|^I0000' | tee -a "$OUT/machine.txt"
for d in "$@"; do
  echo "== $d"
  timeout "${STEP_TIMEOUT:-300}" python3 -m pretrain_lm.bench.run_exported \
    "$d" --steps=20 --warmup=3 >>"$OUT/gpu.jsonl" 2>"$OUT/$(basename "$d").err"
  echo "rc $?"; tail -c 600 "$OUT/$(basename "$d").err" | grep -v '^W0000\|^I0000'
done
python3 - "$OUT/gpu.jsonl" <<'PY'
import json, sys
print(f"{'step':<28}{'attn':<7}{'prng':<13}{'batch':>6}{'step_ms':>9}{'tok/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'compile_s':>10}{'GiB':>6}")
for line in open(sys.argv[1]):
  r = json.loads(line)
  print(f"{r['exported'].split('/')[-1]:<28}{r['attention_impl']:<7}"
        f"{r.get('prng_impl', ''):<13}{r['batch_size']:>6}"
        f"{r['step_s']*1e3:>9.1f}{r['tokens_per_s']:>10.0f}{r['achieved_tflops']:>9.1f}"
        f"{r.get('mfu', 0):>7.1%}{r['compile_s']:>10.1f}{r['memory_gib']:>6.1f}")
PY
