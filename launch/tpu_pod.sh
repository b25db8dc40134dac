#!/usr/bin/env bash
# Runs pretraining on every worker of a Cloud TPU VM or pod slice, and
# relaunches it after preemption.
#
#   launch/tpu_pod.sh run --tpu=my-v4 --zone=us-central2-b --accelerator_type=v4-32 \
#       --config=configs/bert.py:size=base --workdir=gs://BUCKET/bert_base \
#       [--config.x.y=value ...]
#
# COMMAND (first argument):
#   create  create the TPU VM unless `gcloud ... describe` finds it (a
#           preempted one is deleted and created again, a stopped one started)
#   setup   copy this checkout (the files git tracks or would track, with
#           uncommitted changes) to every worker, or with --code=git clone
#           --repo at --commit there; then install it into a venv
#           (~/pretrain_lm/.venv, Python --python via uv, `pip install -e .[tpu]`)
#   start   start `python -m pretrain_lm.main ARGS` on every worker, detached
#           from this shell (a dropped connection does not stop it); does
#           nothing where a job already runs
#   logs    stream worker 0's log (~/pretrain_lm_job/log) until the job ends
#   status  print worker 0's job state: running | exit=N | stopped | none
#   run     create, setup, start and logs; then relaunch (setting up again if
#           the VM was re-created) while the job exits 75 (stopped by a signal
#           or preempted, checkpoint saved: pretrain_lm.train.EXIT_RESUME) or
#           the VM was preempted. Each relaunch resumes from --workdir.
#   stop    SIGTERM the job on every worker: it saves a checkpoint and exits;
#           a `run` streaming its logs ends instead of relaunching
#   delete  delete the TPU VM (the workdir on gs:// stays)
#
# Launcher flags (the rest of the arguments go to pretrain_lm.main unchanged):
#   --tpu=NAME --zone=ZONE      required
#   --project=PROJECT           default: gcloud's configured project
#   --accelerator_type=TYPE     for create: v4-8 (default), v4-32, v5p-32, ...
#   --version=RUNTIME           for create: the TPU software version; default
#                               tpu-ubuntu2204-base (v4); v5p: v2-alpha-tpuv5
#   --spot | --preemptible      for create: the cheaper, preemptible capacity
#   --create_args='ARGS'        more flags for `create` (--network=..., ...)
#   --code=copy|git             how setup gets the code (default copy)
#   --repo=URL --commit=REF     for --code=git (default commit: this HEAD)
#   --python=VERSION            the workers' venv Python (default 3.11)
#   --env=NAME=VALUE            set in the job's environment (repeatable)
#   --remote_dir=DIR            the code on the workers (default pretrain_lm,
#                               under the home directory)
#   --max_restarts=N            relaunches before `run` gives up (default 100)
#   --no_setup                  `run` skips setup on a VM that exists
#   --dry_run                   print the commands instead of running them
# Environment: GCLOUD (default gcloud), RELAUNCH_DELAY (seconds, default 30).
#
# The same command on every worker: jax.distributed.initialize finds its peers
# from the TPU metadata. Data and workdir must be gs:// paths all workers see.
# See launch/README.md for a full BERT-base run.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
die() { echo "tpu_pod.sh: error: $*" >&2; exit 2; }

command="${1:-}"
[[ -n "$command" ]] || usage
shift
case "$command" in
  create|setup|start|logs|status|run|stop|delete) ;;
  -h|--help|help) usage ;;
  *) die "unknown command '$command'; one of create setup start logs status run stop delete" ;;
esac

tpu="" zone="" project="" accelerator_type="v4-8"
version="tpu-ubuntu2204-base" capacity="" create_args=""
code="copy" repo="" commit="" python_version="3.11" remote_dir="pretrain_lm"
max_restarts=100 no_setup=0 dry_run=0
env_args=()
main_args=()
for arg in "$@"; do
  case "$arg" in
    --tpu=*) tpu="${arg#*=}" ;;
    --zone=*) zone="${arg#*=}" ;;
    --project=*) project="${arg#*=}" ;;
    --accelerator_type=*) accelerator_type="${arg#*=}" ;;
    --version=*) version="${arg#*=}" ;;
    --spot) capacity="--spot" ;;
    --preemptible) capacity="--preemptible" ;;
    --create_args=*) create_args="${arg#*=}" ;;
    --code=*) code="${arg#*=}" ;;
    --repo=*) repo="${arg#*=}" ;;
    --commit=*) commit="${arg#*=}" ;;
    --python=*) python_version="${arg#*=}" ;;
    --env=*) env_args+=("${arg#*=}") ;;
    --remote_dir=*) remote_dir="${arg#*=}" ;;
    --max_restarts=*) max_restarts="${arg#*=}" ;;
    --no_setup) no_setup=1 ;;
    --dry_run) dry_run=1 ;;
    *) main_args+=("$arg") ;;
  esac
done
[[ -n "$tpu" ]] || die "--tpu=NAME is required"
[[ -n "$zone" ]] || die "--zone=ZONE is required"
[[ "$code" == copy || "$code" == git ]] || die "--code=$code; use copy or git"
[[ "$code" == copy || -n "$repo" ]] || die "--code=git needs --repo=URL"
[[ "$max_restarts" =~ ^[0-9]+$ ]] || die "--max_restarts=$max_restarts is not a number"
for e in ${env_args[@]+"${env_args[@]}"}; do
  [[ "$e" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env=$e is not NAME=VALUE"
done
has_main_arg() {
  local a
  for a in ${main_args[@]+"${main_args[@]}"}; do [[ "$a" != "$1"* ]] || return 0; done
  return 1
}
if [[ "$command" == run || "$command" == start ]]; then
  has_main_arg --config= \
    || die "$command needs --config=... (and --workdir=...) for pretrain_lm.main"
  has_main_arg --workdir= \
    || die "$command needs --workdir=gs://... for pretrain_lm.main"
fi

gcloud_cmd=("${GCLOUD:-gcloud}" compute tpus tpu-vm)
where=(--zone="$zone")
[[ -z "$project" ]] || where+=(--project="$project")

# Shell-quotes each argument (POSIX single quotes: readable in a dry run,
# safe in the workers' shell for values with spaces or quotes).
quote() {
  local a out=()
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
      out+=("$a")
    else
      out+=("'${a//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

# Dry-run output goes to fd 3, so that $(...) never captures it.
exec 3>&1
x() {
  if (( dry_run )); then quote "$@" >&3; return 0; fi
  "$@" 3>&-
}
# Runs a shell script on one worker (0) or on all of them (all).
on_workers() { x "${gcloud_cmd[@]}" ssh "$tpu" "${where[@]}" --worker="$1" --command="$2"; }

# The job's files on every worker: log, pid (the wrapper shell), child
# (python), rc (its exit code), stopped (written by `stop`).
J='"$HOME"/pretrain_lm_job'
D="\"\$HOME\"/$(quote "$remote_dir")"

job_running="[ -f $J/pid ] && kill -0 \$(cat $J/pid) 2>/dev/null"

vm_state() {  # READY, CREATING, PREEMPTED, STOPPED, ...; empty if absent
  if (( dry_run )); then
    x "${gcloud_cmd[@]}" describe "$tpu" "${where[@]}" --format='value(state)'
    return 0
  fi
  "${gcloud_cmd[@]}" describe "$tpu" "${where[@]}" --format='value(state)' 2>/dev/null 3>&- || true
}

created=0
cmd_create() {
  local state
  state="$(vm_state)"
  case "$state" in
    "") ;;
    PREEMPTED|TERMINATED)
      echo "TPU $tpu is $state: deleting it to create it again." >&2
      x "${gcloud_cmd[@]}" delete "$tpu" "${where[@]}" --quiet ;;
    STOPPED|STOPPING)
      echo "TPU $tpu is $state: starting it." >&2
      x "${gcloud_cmd[@]}" start "$tpu" "${where[@]}"
      return 0 ;;
    *) echo "TPU $tpu exists ($state)." >&2; return 0 ;;
  esac
  local extra=()
  [[ -z "$capacity" ]] || extra+=("$capacity")
  # Word-split on purpose: --create_args holds several flags.
  # shellcheck disable=SC2206
  [[ -z "$create_args" ]] || extra+=($create_args)
  x "${gcloud_cmd[@]}" create "$tpu" "${where[@]}" \
    --accelerator-type="$accelerator_type" --version="$version" ${extra[@]+"${extra[@]}"}
  created=1
}

tarball=""
cleanup() { [[ -z "$tarball" ]] || rm -f "$tarball"; }
trap cleanup EXIT

cmd_setup() {
  local fetch
  if [[ "$code" == copy ]]; then
    # Tracked and untracked-but-not-ignored files: what `git status` shows,
    # without .git, .venv or workdirs.
    [[ -n "$tarball" ]] || tarball="$(mktemp "${TMPDIR:-/tmp}/pretrain_lm.XXXXXX")"
    if (( dry_run )); then
      echo "# git ls-files -co --exclude-standard | tar czf $tarball -T -" >&3
    else
      git ls-files -co --exclude-standard -z | tar czf "$tarball" --null -T -
    fi
    x "${gcloud_cmd[@]}" scp "$tarball" "$tpu:pretrain_lm.tgz" "${where[@]}" --worker=all
    # Replace the code, keep the installed venv.
    fetch="mkdir -p $D && find $D -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} + && tar xzf ~/pretrain_lm.tgz -C $D && rm ~/pretrain_lm.tgz"
  else
    fetch="{ [ -d $D/.git ] || git clone -q $(quote "$repo") $D; } && cd $D && git fetch -q origin && git checkout -q $(quote "$(code_commit)")"
  fi
  # uv brings its own Python, whatever the TPU image ships.
  local install="cd $D && { command -v uv >/dev/null || [ -x ~/.local/bin/uv ] || curl -LsSf https://astral.sh/uv/install.sh | sh; } && export PATH=\"\$HOME/.local/bin:\$PATH\" && { [ -x .venv/bin/python ] || uv venv -q --python $(quote "$python_version") .venv; } && uv pip install -q --python .venv/bin/python -e '.[tpu]'"
  # Never pull the code from under a running job (`run` re-attaching).
  on_workers all "set -e; if $job_running; then echo \"\$(hostname): a job is running; setup skipped\"; exit 0; fi; $fetch && $install"
}

# The commit the workers run (recorded in each run's run_metadata.json).
code_commit() {
  if [[ "$code" == git ]]; then
    echo "${commit:-$(git rev-parse HEAD)}"
    return 0
  fi
  local id
  id="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
  [[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] || id+="+dirty"
  echo "$id"
}

cmd_start() {
  local env_prefix
  env_prefix="$(quote env PRETRAIN_LM_GIT_COMMIT="$(code_commit)" ${env_args[@]+"${env_args[@]}"})"
  local main_cmd
  main_cmd="$(quote .venv/bin/python -m pretrain_lm.main ${main_args[@]+"${main_args[@]}"})"
  # The wrapper records the exit code; `stop` signals only the python child,
  # so the wrapper lives to write it.
  local wrapper="echo \$\$ > $J/pid; cd $D; $env_prefix $main_cmd >> $J/log 2>&1 < /dev/null & echo \$! > $J/child; wait \$!; echo \$? > $J/rc"
  on_workers all "mkdir -p $J; if $job_running; then echo \"\$(hostname): a job is already running; not starting another\"; exit 0; fi; rm -f $J/rc $J/stopped $J/child; echo \"=== start \$(date -u) ===\" >> $J/log; nohup setsid bash -c $(quote "$wrapper") > /dev/null 2>&1 < /dev/null &"
}

cmd_logs() {
  on_workers 0 "for i in \$(seq 60); do [ -f $J/pid ] && break; sleep 1; done; tail -n 20 --pid=\"\$(cat $J/pid)\" -F $J/log"
}

cmd_status() {
  on_workers 0 "if $job_running; then echo running; elif [ -f $J/stopped ]; then echo stopped; elif [ -f $J/rc ]; then echo exit=\$(cat $J/rc); else echo none; fi"
  # A dry run shows the happy path: the job finished.
  if (( dry_run )); then echo exit=0; fi
}

cmd_stop() {
  on_workers all "touch $J/stopped; if [ -f $J/child ]; then kill -TERM \$(cat $J/child) 2>/dev/null && echo \"\$(hostname): stopping (saving a checkpoint)\"; fi; true"
}

cmd_delete() {
  x "${gcloud_cmd[@]}" delete "$tpu" "${where[@]}" --quiet
}

cmd_run() {
  local restarts=0 setup_needed=$(( ! no_setup )) status state
  while true; do
    cmd_create
    if (( setup_needed || created )); then cmd_setup; fi
    setup_needed=0 created=0
    cmd_start
    while true; do
      cmd_logs || true
      status="$(cmd_status 2>/dev/null | tail -n 1)" || status=""
      # The log stream broke, not the job: attach again.
      [[ "$status" == running ]] || break
      sleep 5
    done
    case "$status" in
      exit=0) echo "tpu_pod.sh: the job finished." >&2; return 0 ;;
      stopped) echo "tpu_pod.sh: the job was stopped; 'run' again to resume." >&2; return 0 ;;
      exit=75) reason="the job exited 75 (signal; checkpoint saved)" ;;
      *)
        state="$(vm_state)"
        if [[ "$state" == READY ]]; then
          echo "tpu_pod.sh: the job failed (${status:-no status}); see the log above." >&2
          [[ "$status" =~ ^exit=([0-9]+)$ ]] && return "${BASH_REMATCH[1]}"
          return 1
        fi
        reason="TPU $tpu is ${state:-gone} (${status:-unreachable})" ;;
    esac
    restarts=$(( restarts + 1 ))
    if (( restarts > max_restarts )); then
      echo "tpu_pod.sh: $reason; giving up after $max_restarts relaunches." >&2
      return 1
    fi
    echo "tpu_pod.sh: $reason; relaunch $restarts/$max_restarts in ${RELAUNCH_DELAY:-30} s." >&2
    sleep "${RELAUNCH_DELAY:-30}"
  done
}

"cmd_$command"
