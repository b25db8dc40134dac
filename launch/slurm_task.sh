#!/usr/bin/env bash
# One SLURM task of launch/slurm.sbatch: runs its arguments, records the exit
# code in $PRETRAIN_LM_TASK_DIR/task.$SLURM_PROCID for the batch script, and
# reports a failure with the task's number and host.
#
# Exit 75 (checkpoint saved, resume me) leaves this script as 0: srun
# --kill-on-bad-exit=1 stops the step on a failure, and a task that is done
# saving must not kill peers that are still committing the checkpoint.
set -euo pipefail

# SIGTERM reaches every process of the step; with a trap this shell waits for
# its child (which saves and exits) instead of dying before it.
trap : TERM INT
rc=0
"$@" || rc=$?
task="${SLURM_PROCID:-0}"
if [[ -n "${PRETRAIN_LM_TASK_DIR:-}" ]]; then
  echo "$rc $(hostname)" > "$PRETRAIN_LM_TASK_DIR/task.$task"
fi
if (( rc != 0 && rc != 75 )); then
  echo "pretrain_lm: task $task on $(hostname) exited $rc" >&2
fi
(( rc == 75 )) && exit 0
exit "$rc"
