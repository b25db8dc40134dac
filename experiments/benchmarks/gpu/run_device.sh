#!/bin/bash
# Times train steps exported by experiments/benchmarks/gpu/export.py on a
# GPU machine that has JAX but not our input stack; run from the
# repository root: run_device.sh DIR... (experiments/benchmarks/README.md,
# Train step: GPU, has the export commands and the results).
#
# Two passes. First every DIR's init and step compile side by side, one
# process each (`run_exported --compile_only`, shapes only, no device
# memory), into JAX's persistent compilation cache: XLA:GPU compiles are
# mostly single-threaded and take a minute or so each, so side by side
# they take about the time of the slowest. Then each DIR is timed alone,
# in its own process under a time limit (so one that fails or hangs leaves
# the others' figures), loading its programs from the cache; the DIRs
# named in $PROFILE (default: all) also get two profiled steps
# (trace_summary.py).
# The DIRs in $FLAGGED are compiled and timed a second time with
# XLA_FLAGS=$FLAGGED_XLA_FLAGS (one change of XLA's own options).
# Writes $OUT/machine.txt, compile.jsonl, gpu.jsonl and steps.log.
export PYTHONUNBUFFERED=1
# pretrain_lm from this checkout: the machine need not have it installed.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
RUN_EXPORTED=experiments/benchmarks/gpu/run_exported.py
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
LOG=$OUT/steps.log
quiet() { grep -v '^W0000\|^I0000'; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
  --format=csv | tee "$OUT/machine.txt"
python3 -c 'import jax, jaxlib; print("jax", jax.__version__, jax.devices())' \
  2>&1 | tee -a "$OUT/machine.txt"
# The datasheet peak is what MFU is taken against; XLA's best bf16 matmul
# on the same card (matmul_peak.py: fastest of 5 calls) is context.
python3 experiments/benchmarks/matmul_peak.py --dtype=bfloat16 --xla_only \
  --sizes="${PEAK_SIZE:-8192}" 2>&1 | quiet | tee -a "$OUT/machine.txt"
# Each entry: a DIR, and the XLA_FLAGS it runs under.
entries=()
for d in "$@"; do entries+=("$d|${XLA_FLAGS:-}"); done
for d in ${FLAGGED:-}; do entries+=("$d|${XLA_FLAGS:-} $FLAGGED_XLA_FLAGS"); done
echo "[$(date +%T)] compiling ${#entries[@]} steps side by side" | tee -a "$LOG"
i=0
for e in "${entries[@]}"; do
  # No preallocation: each compiling process would take 75% of the card.
  XLA_FLAGS=${e#*|} XLA_PYTHON_CLIENT_PREALLOCATE=false \
    timeout "${COMPILE_TIMEOUT:-240}" python3 "$RUN_EXPORTED" \
    "${e%%|*}" --compile_only >>"$OUT/compile.jsonl" 2>"/tmp/compile_$i.err" &
  i=$((i + 1))
done
wait
i=0
for e in "${entries[@]}"; do
  { echo "== compile $e"; quiet <"/tmp/compile_$i.err" | tail -c 600; } >>"$LOG"
  i=$((i + 1))
done
echo "[$(date +%T)] timing" | tee -a "$LOG"
for e in "${entries[@]}"; do
  d=${e%%|*}
  flags=()
  if [[ " ${PROFILE:-$*} " == *" $d "* ]]; then
    flags=(--profile_dir="/tmp/profile")
  fi
  echo "== $e" | tee -a "$LOG"
  XLA_FLAGS=${e#*|} timeout "${STEP_TIMEOUT:-150}" python3 "$RUN_EXPORTED" \
    "$d" --steps=20 --warmup=3 "${flags[@]}" \
    >>"$OUT/gpu.jsonl" 2>/tmp/step.err
  echo "rc $?" | tee -a "$LOG"
  quiet </tmp/step.err | tee -a "$LOG" | grep -v '^ \|^==' | tail -c 400
done
python3 - "$OUT/gpu.jsonl" "$OUT/compile.jsonl" <<'PY'
import json, sys
compiled = {}
for line in open(sys.argv[2]):
  r = json.loads(line)
  compiled[r['exported'], r.get('xla_flags', '')] = r
print(f"{'step':<28}{'attn':<7}{'prng':<13}{'batch':>6}{'step_ms':>9}{'piped':>7}"
      f"{'tok/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'MFUpipe':>8}{'compile_s':>10}"
      f"{'init_c_s':>9}{'GiB':>6}{'busy':>6}  XLA_FLAGS")
for line in open(sys.argv[1]):
  r = json.loads(line)
  c = compiled.get((r['exported'], r.get('xla_flags', '')), {})
  busy = ''
  if 'profile' in r:
    p = r['profile']
    streams = [t['busy_ms'] for n, t in p['timelines'].items() if n.startswith('Stream')]
    busy = f"{max(streams) / (p['wall_s'] * 1e3):.0%}" if streams else '?'
  print(f"{r['exported'].split('/')[-1]:<28}{r['attention_impl']:<7}"
        f"{r.get('prng_impl', ''):<13}{r['batch_size']:>6}"
        f"{r['step_s']*1e3:>9.1f}{r.get('step_s_pipelined', 0)*1e3:>7.1f}"
        f"{r['tokens_per_s']:>10.0f}{r['achieved_tflops']:>9.1f}"
        f"{r.get('mfu', 0):>7.1%}{r.get('mfu_pipelined', 0):>8.1%}"
        f"{c.get('compile_s', float('nan')):>10.1f}"
        f"{c.get('init_compile_s', float('nan')):>9.1f}{r['memory_gib']:>6.1f}{busy:>6}"
        f"  {r.get('xla_flags', '')}")
PY
