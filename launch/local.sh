#!/usr/bin/env bash
# Runs pretraining on this machine with the repository's virtualenv.
#
#   launch/local.sh [--dry_run] [--fake_devices=N] --config=configs/bert.py:size=tiny \
#       --workdir=/tmp/run [--config.x.y=value ...]
#
# Every argument but the two below goes to `python -m pretrain_lm.main`.
#   --dry_run         print the command instead of running it
#   --fake_devices=N  split the CPU into N XLA devices, to try mesh layouts
#                     (e.g. --config.mesh.fsdp=2 --config.mesh.tensor=2)
# Rerunning the same command resumes from the workdir's latest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
env_prefix=""
args=()
for arg in "$@"; do
  case "$arg" in
    --dry_run) dry_run=1 ;;
    --fake_devices=*)
      export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${arg#*=}"
      export JAX_PLATFORMS=cpu
      env_prefix="$(printf 'XLA_FLAGS=%q JAX_PLATFORMS=cpu ' "$XLA_FLAGS")" ;;
    *) args+=("$arg") ;;
  esac
done

python=".venv/bin/python"
[[ -x "$python" ]] || { echo "error: $python not found; run 'make test' or 'make quickstart' first" >&2; exit 1; }
cmd=("$python" -m pretrain_lm.main "${args[@]}")
if (( dry_run )); then
  printf '%s' "$env_prefix"; printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
