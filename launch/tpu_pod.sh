#!/usr/bin/env bash
# Runs pretraining on every worker of a Cloud TPU VM or pod slice, watches
# every worker, and relaunches the slice after preemption or a failure.
#
#   launch/tpu_pod.sh run --tpu=my-v4 --zone=us-central2-b --accelerator_type=v4-32 \
#       --config=configs/bert.py:size=base --workdir=gs://BUCKET/bert_base \
#       [--config.x.y=value ...]
#
# COMMAND (first argument):
#   create  create the TPU VM unless `gcloud ... describe` finds it (a
#           preempted one is deleted and created again, a stopped one started);
#           with --queued, request it as a queued resource and wait for ACTIVE
#   setup   copy this checkout (the files git tracks or would track, with
#           uncommitted changes) to every worker, or with --code=git clone
#           --repo at --commit there; then install it into a venv
#           (~/pretrain_lm/.venv, Python --python via uv, `pip install -e .[tpu]`)
#   start   start `python -m pretrain_lm.main ARGS` on every worker, detached
#           from this shell (a dropped connection does not stop it); does
#           nothing where a job already runs
#   logs    stream worker --worker's log (~/pretrain_lm_job/log) until its job ends
#   status  print every worker's job state, one line each:
#           worker N: running | exit=N | stopped | lost (gone, no exit code) | none
#   run     create, setup, start; stream worker 0's log while polling every
#           worker. When all workers exit 75 (stopped by a signal or
#           preempted, checkpoint saved: pretrain_lm.train.EXIT_RESUME) or
#           the VM was preempted, relaunch (setting up again if the VM was
#           re-created). When one worker fails (any other exit code, or its
#           job vanished), SIGTERM the job on every worker, print that
#           worker's log tail, and relaunch the whole slice, except after exit
#           65 (non-finite loss: pretrain_lm.train.EXIT_NONFINITE), which
#           stops. Each relaunch resumes from --workdir.
#   stop    SIGTERM the job on every worker: it saves a checkpoint and exits;
#           a `run` watching it ends instead of relaunching
#   delete  delete the TPU VM, or with --queued the queued resource and its
#           VM (the workdir on gs:// stays)
#
# Launcher flags (the rest of the arguments go to pretrain_lm.main unchanged):
#   --tpu=NAME --zone=ZONE      required
#   --project=PROJECT           default: gcloud's configured project
#   --accelerator_type=TYPE     for create: v4-8 (default), v4-32, v5p-32, ...
#   --version=RUNTIME           for create: the TPU software version; default
#                               tpu-ubuntu2204-base (v4); v5p: v2-alpha-tpuv5
#   --spot | --preemptible      for create: the cheaper, preemptible capacity
#   --reserved                  for create: capacity reserved for the project
#   --queued[=ID]               create through `gcloud compute tpus
#                               queued-resources create ID --node-id=TPU`
#                               (ID: TPU-qr), wait until it is ACTIVE; a
#                               SUSPENDED or FAILED one is requested again
#   --create_args='ARGS'        more flags for `create` (--network=..., ...)
#   --shared_fs=DIR             DIR is a filesystem every worker mounts: a
#                               --workdir under it is allowed on a multi-host
#                               slice (repeatable; gs:// always is)
#   --code=copy|git             how setup gets the code (default copy)
#   --repo=URL --commit=REF     for --code=git (default commit: this HEAD)
#   --python=VERSION            the workers' venv Python (default 3.11)
#   --env=NAME=VALUE            set in the job's environment (repeatable)
#   --remote_dir=DIR            the code on the workers (default pretrain_lm,
#                               under the home directory)
#   --worker=N                  for logs: the worker to stream (default 0)
#   --max_restarts=N            relaunches before `run` gives up (default 100)
#   --max_failures=N            of which after a failed worker (default 3)
#   --no_setup                  `run` skips setup on a VM that exists
#   --dry_run                   print the commands instead of running them
# Environment: GCLOUD (default gcloud), RELAUNCH_DELAY (seconds, default 30),
# POLL_INTERVAL (seconds between polls of the workers, default 30),
# STOP_TIMEOUT (seconds the workers get to save before SIGKILL, default 300),
# STRAGGLER_TIMEOUT (seconds a worker may run on after another exited,
# default 600), QUEUE_POLL (seconds between queued-resource polls, default 60).
#
# The same command on every worker: jax.distributed.initialize finds its peers
# from the TPU metadata. Data and workdir must be where all workers see them
# (gs://); on a multi-host slice a local --workdir is refused before anything
# is created. See launch/README.md for a full BERT-base run.
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
version="tpu-ubuntu2204-base" capacity="" create_args="" queued=""
code="copy" repo="" commit="" python_version="3.11" remote_dir="pretrain_lm"
max_restarts=100 max_failures=3 no_setup=0 dry_run=0 log_worker=0
env_args=()
shared_fs=()
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
    --reserved) capacity="--reserved" ;;
    --queued) queued="-" ;;
    --queued=*) queued="${arg#*=}" ;;
    --create_args=*) create_args="${arg#*=}" ;;
    --shared_fs=*) shared_fs+=("${arg#*=}") ;;
    --code=*) code="${arg#*=}" ;;
    --repo=*) repo="${arg#*=}" ;;
    --commit=*) commit="${arg#*=}" ;;
    --python=*) python_version="${arg#*=}" ;;
    --env=*) env_args+=("${arg#*=}") ;;
    --remote_dir=*) remote_dir="${arg#*=}" ;;
    --worker=*) log_worker="${arg#*=}" ;;
    --max_restarts=*) max_restarts="${arg#*=}" ;;
    --max_failures=*) max_failures="${arg#*=}" ;;
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
[[ "$max_failures" =~ ^[0-9]+$ ]] || die "--max_failures=$max_failures is not a number"
[[ "$log_worker" =~ ^[0-9]+$ ]] || die "--worker=$log_worker is not a worker number"
[[ "$queued" != "-" ]] || queued="$tpu-qr"
[[ -z "$queued" || "$capacity" != --preemptible ]] \
  || die "--preemptible is not a queued-resources tier; use --spot or --reserved"
for e in ${env_args[@]+"${env_args[@]}"}; do
  [[ "$e" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env=$e is not NAME=VALUE"
done
for d in ${shared_fs[@]+"${shared_fs[@]}"}; do
  [[ "$d" == /* ]] || die "--shared_fs=$d is not an absolute path"
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

# Hosts of an accelerator type; empty when this script does not know it.
# v2-v5p count TensorCores, 8 per host; v5e and v6e count chips, 4 per host
# beyond the single-host sizes (1, 4, 8).
hosts_of() {
  local n="${1##*-}"
  [[ "$n" =~ ^[0-9]+$ ]] || return 0
  case "$1" in
    v2-*|v3-*|v4-*|v5p-*) echo $(( n <= 8 ? 1 : n / 8 )) ;;
    v5litepod-*|v5e-*|v6e-*) echo $(( n <= 8 ? 1 : n / 4 )) ;;
  esac
}

# A multi-host job needs a workdir every worker reaches: each host writes its
# part of every checkpoint there. Refused before anything is created.
check_workdir() {  # HOSTS (empty: unknown) WHAT
  local a workdir="" d
  for a in ${main_args[@]+"${main_args[@]}"}; do
    [[ "$a" != --workdir=* ]] || workdir="${a#--workdir=}"
  done
  [[ -n "$workdir" && "$1" != 1 && "$workdir" != gs://* ]] || return 0
  for d in ${shared_fs[@]+"${shared_fs[@]}"}; do
    [[ "$workdir" != "${d%/}"/* ]] || return 0
  done
  die "--workdir=$workdir is not on storage all workers of $2 reach: use a gs:// path, or name the filesystem every worker mounts with --shared_fs=DIR"
}

gcloud_cmd=("${GCLOUD:-gcloud}" compute tpus tpu-vm)
qr_cmd=("${GCLOUD:-gcloud}" compute tpus queued-resources)
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
# Runs a shell script on one worker (N) or on all of them (all).
on_workers() { x "${gcloud_cmd[@]}" ssh "$tpu" "${where[@]}" --worker="$1" --command="$2"; }

# The job's files on every worker: log, pid (the wrapper shell), child
# (python), rc (its exit code), stopped (written by `stop`).
# shellcheck disable=SC2016  # $HOME expands on the workers
J='"$HOME"/pretrain_lm_job'
D="\"\$HOME\"/$(quote "$remote_dir")"

job_running="[ -f $J/pid ] && kill -0 \$(cat $J/pid) 2>/dev/null"
# A wrapper that left no exit code died with its VM or was killed.
job_state="if $job_running; then echo running; elif [ -f $J/stopped ]; then echo stopped; elif [ -f $J/rc ]; then echo exit=\$(cat $J/rc); elif [ -f $J/pid ]; then echo lost; else echo none; fi"

vm_state() {  # READY, CREATING, PREEMPTED, STOPPED, ...; empty if absent
  if (( dry_run )); then
    x "${gcloud_cmd[@]}" describe "$tpu" "${where[@]}" --format='value(state)'
    return 0
  fi
  "${gcloud_cmd[@]}" describe "$tpu" "${where[@]}" --format='value(state)' 2>/dev/null 3>&- || true
}

# The VM's workers (one network endpoint each); the accelerator type's host
# count where describe cannot tell.
worker_count() {
  local n=0
  if (( ! dry_run )); then
    n="$("${gcloud_cmd[@]}" describe "$tpu" "${where[@]}" --flatten=networkEndpoints \
      --format='value(networkEndpoints.ipAddress)' 2>/dev/null 3>&- | grep -c . || true)"
  fi
  (( n > 0 )) || n="$(hosts_of "$accelerator_type")"
  echo "${n:-1}"
}

qr_state() {  # WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, SUSPENDED, ...
  if (( dry_run )); then
    x "${qr_cmd[@]}" describe "$queued" "${where[@]}" --format='value(state.state)'
    return 0
  fi
  "${qr_cmd[@]}" describe "$queued" "${where[@]}" --format='value(state.state)' 2>/dev/null 3>&- || true
}

wait_active() {
  local state last="?"
  while true; do
    state="$(qr_state)"
    (( ! dry_run )) || return 0
    [[ "$state" == "$last" ]] || echo "Queued resource $queued: ${state:-not found}" >&2
    last="$state"
    case "$state" in
      ACTIVE) return 0 ;;
      FAILED|SUSPENDED|"")
        echo "tpu_pod.sh: queued resource $queued is ${state:-gone}; see \`gcloud compute tpus queued-resources describe $queued --zone=$zone\`." >&2
        exit 1 ;;
    esac
    sleep "${QUEUE_POLL:-60}"
  done
}

create_args_array() {
  extra=()
  [[ -z "$capacity" ]] || extra+=("$capacity")
  # Word-split on purpose: --create_args holds several flags.
  # shellcheck disable=SC2206
  [[ -z "$create_args" ]] || extra+=($create_args)
}

created=0
cmd_create_queued() {
  local state
  state="$(qr_state)"
  case "$state" in
    "") ;;
    ACTIVE)
      state="$(vm_state)"
      # Not found is asked twice: a failed describe must not cost the slice.
      [[ -n "$state" ]] || (( dry_run )) || { sleep 5; state="$(vm_state)"; }
      case "$state" in
        PREEMPTED|TERMINATED|"")
          echo "Queued resource $queued is ACTIVE, TPU $tpu ${state:-absent}: requesting it again." >&2
          x "${qr_cmd[@]}" delete "$queued" "${where[@]}" --force --quiet ;;
        *) echo "TPU $tpu exists ($state, queued resource $queued)." >&2; return 0 ;;
      esac ;;
    FAILED|SUSPENDED|SUSPENDING)
      echo "Queued resource $queued is $state: deleting it to request it again." >&2
      x "${qr_cmd[@]}" delete "$queued" "${where[@]}" --force --quiet ;;
    *)
      echo "Queued resource $queued is $state: waiting for ACTIVE." >&2
      wait_active
      created=1
      return 0 ;;
  esac
  create_args_array
  x "${qr_cmd[@]}" create "$queued" --node-id="$tpu" "${where[@]}" \
    --accelerator-type="$accelerator_type" --runtime-version="$version" ${extra[@]+"${extra[@]}"}
  wait_active
  created=1
}

cmd_create() {
  local state
  if [[ -n "$queued" ]]; then cmd_create_queued; return 0; fi
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
  create_args_array
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
  local install
  install="cd $D && { command -v uv >/dev/null || [ -x ~/.local/bin/uv ] || curl -LsSf https://astral.sh/uv/install.sh | sh; } && export PATH=\"\$HOME/.local/bin:\$PATH\" && { [ -x .venv/bin/python ] || uv venv -q --python $(quote "$python_version") .venv; } && uv pip install -q --python .venv/bin/python -e '.[tpu]'"
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

workers=""  # the VM's worker count, once asked
cmd_start() {
  [[ -n "$workers" ]] || workers="$(worker_count)"
  check_workdir "$workers" "TPU $tpu ($workers workers)"
  local env_prefix
  env_prefix="$(quote env PRETRAIN_LM_GIT_COMMIT="$(code_commit)" ${env_args[@]+"${env_args[@]}"})"
  local main_cmd
  main_cmd="$(quote .venv/bin/python -m pretrain_lm.main ${main_args[@]+"${main_args[@]}"})"
  # The wrapper records the exit code; `stop` signals only the python child,
  # so the wrapper lives to write it.
  local wrapper="echo \$\$ > $J/pid; cd $D; $env_prefix $main_cmd >> $J/log 2>&1 < /dev/null & echo \$! > $J/child; wait \$!; echo \$? > $J/rc"
  # The start returns once the wrapper's pid is written: a poll right after
  # must not mistake the previous job's files for this one's.
  on_workers all "mkdir -p $J; if $job_running; then echo \"\$(hostname): a job is already running; not starting another\"; exit 0; fi; rm -f $J/pid $J/rc $J/stopped $J/child; echo \"=== start \$(date -u) ===\" >> $J/log; nohup setsid bash -c $(quote "$wrapper") > /dev/null 2>&1 < /dev/null & for i in \$(seq 300); do [ -f $J/pid ] && break; sleep 0.1; done"
}

logs_script="for i in \$(seq 60); do [ -f $J/pid ] && break; sleep 1; done; exec tail -n 20 --pid=\"\$(cat $J/pid)\" -F $J/log"
cmd_logs() { on_workers "$log_worker" "$logs_script"; }

# Every worker's state into `states` (ssh to each at once): running, exit=N,
# stopped, lost, none, or unreachable where ssh failed.
states=()
poll_workers() {
  local i dir s pids=()
  states=()
  if (( dry_run )); then  # the happy path: the job finished
    for (( i = 0; i < workers; i++ )); do on_workers "$i" "$job_state"; states+=(exit=0); done
    return 0
  fi
  dir="$(mktemp -d "${TMPDIR:-/tmp}/tpu_pod.XXXXXX")"
  for (( i = 0; i < workers; i++ )); do
    on_workers "$i" "$job_state" > "$dir/$i" 2>/dev/null &
    pids+=($!)
  done
  for (( i = 0; i < workers; i++ )); do
    wait "${pids[i]}" || true
    s="$(tail -n 1 "$dir/$i")"
    states+=("${s:-unreachable}")
  done
  rm -rf "$dir"
}

cmd_status() {
  local i
  workers="$(worker_count)"
  poll_workers
  for i in "${!states[@]}"; do echo "worker $i: ${states[i]}"; done
}

signal_job() {  # SIGNAL [MARK]: signal the python child on every worker
  local said="stopping (saving a checkpoint)"
  [[ "$1" == TERM ]] || said="SIG$1 sent"
  on_workers all "${2:+touch $J/stopped; }if [ -f $J/child ] && kill -$1 \$(cat $J/child) 2>/dev/null; then echo \"\$(hostname): $said\"; fi; true"
}

cmd_stop() { signal_job TERM mark; }

cmd_delete() {
  if [[ -n "$queued" ]]; then
    # --force deletes the TPU VM first.
    x "${qr_cmd[@]}" delete "$queued" "${where[@]}" --force --quiet
  else
    x "${gcloud_cmd[@]}" delete "$tpu" "${where[@]}" --quiet
  fi
}

# SIGTERM on every worker (each saves if its peers still answer), then
# SIGKILL for those still running after STOP_TIMEOUT seconds.
halt_job() {
  local deadline=$(( SECONDS + ${STOP_TIMEOUT:-300} ))
  signal_job TERM >&2 || true
  while (( ! dry_run )); do
    poll_workers
    [[ " ${states[*]} " == *" running "* ]] || return 0
    if (( SECONDS >= deadline )); then
      echo "tpu_pod.sh: still running after ${STOP_TIMEOUT:-300} s: SIGKILL." >&2
      signal_job KILL >&2 || true
      return 0
    fi
    sleep "${POLL_INTERVAL:-30}"
  done
}

describe_failure() {  # WORKER CODE -> a phrase
  case "$2" in
    lost) echo "worker $1's job vanished without an exit code" ;;
    none) echo "worker $1 has no job" ;;
    unreachable) echo "worker $1 cannot be reached" ;;
    hung) echo "worker $1 still ran ${STRAGGLER_TIMEOUT:-600} s after another worker's job ended" ;;
    *) echo "worker $1 exited $2" ;;
  esac
}

# Polls every worker until the job is over; sets outcome (finished, stopped,
# resume, preempted, failed) and, for failed, fail_worker and fail_code.
outcome="" fail_worker="" fail_code=""
watch_job() {
  local i s log_pid="" running unreachable ended stopped resumed vm
  local straggle_since="" unreachable_polls=0
  outcome=""
  # Worker 0's log streams here while the loop below watches them all.
  if (( dry_run )); then
    on_workers 0 "$logs_script"
  else
    "${gcloud_cmd[@]}" ssh "$tpu" "${where[@]}" --worker=0 --command="$logs_script" 3>&- &
    log_pid=$!
  fi
  while [[ -z "$outcome" ]]; do
    poll_workers
    running=0 unreachable=0 ended=0 stopped=0 resumed=0 fail_worker="" fail_code=""
    for i in "${!states[@]}"; do
      s="${states[i]}"
      case "$s" in
        running) running=$(( running + 1 )) ;;
        stopped) stopped=$(( stopped + 1 )) ;;
        exit=0) ended=$(( ended + 1 )) ;;
        exit=75) ended=$(( ended + 1 )) resumed=$(( resumed + 1 )) ;;
        unreachable) unreachable=$(( unreachable + 1 )) ;;
        *) [[ -n "$fail_worker" ]] || fail_worker="$i" fail_code="${s#exit=}" ;;
      esac
    done
    if [[ -n "$fail_worker" ]] || (( unreachable )); then
      # A worker gone with its VM is a preemption, not a failure.
      vm="$(vm_state)"
      if [[ "$vm" != READY ]]; then
        outcome=preempted fail_code="${vm:-gone}"
      elif [[ -n "$fail_worker" ]]; then
        outcome=failed
      elif (( ++unreachable_polls >= 5 )); then
        for i in "${!states[@]}"; do
          [[ "${states[i]}" != unreachable ]] || { fail_worker="$i"; break; }
        done
        outcome=failed fail_code=unreachable
      fi
    elif (( running )); then
      unreachable_polls=0
      # Workers end within seconds of each other; one that runs on long
      # after another ended waits for a peer that is gone.
      if (( ended && ! stopped )); then
        straggle_since="${straggle_since:-$SECONDS}"
        if (( SECONDS - straggle_since >= ${STRAGGLER_TIMEOUT:-600} )); then
          for i in "${!states[@]}"; do
            [[ "${states[i]}" != running ]] || { fail_worker="$i"; break; }
          done
          outcome=failed fail_code=hung
        fi
      fi
    elif (( stopped )); then
      outcome=stopped
    elif (( resumed )); then
      outcome=resume
    else
      outcome=finished
    fi
    [[ -n "$outcome" ]] || sleep "${POLL_INTERVAL:-30}"
  done
  if [[ "$outcome" == failed ]]; then
    echo "tpu_pod.sh: $(describe_failure "$fail_worker" "$fail_code"): stopping the job on every worker." >&2
    halt_job
  fi
  # The stream ends with worker 0's job; a broken connection may linger.
  if [[ -n "$log_pid" ]]; then
    for i in $(seq 50); do kill -0 "$log_pid" 2>/dev/null || break; sleep 0.2; done
    kill "$log_pid" 2>/dev/null || true
    wait "$log_pid" 2>/dev/null || true
  fi
  if [[ "$outcome" == failed ]]; then
    echo "--- worker $fail_worker: last lines of its log ---" >&2
    on_workers "$fail_worker" "tail -n 30 $J/log" >&2 || true
    echo "--- end of worker $fail_worker's log ---" >&2
  fi
}

cmd_run() {
  local restarts=0 failures=0 setup_needed=$(( ! no_setup )) reason rc
  # Before anything is created: the type says how many hosts it will have
  # (unknown types count as multi-host).
  local hosts
  hosts="$(hosts_of "$accelerator_type")"
  check_workdir "$hosts" "--accelerator_type=$accelerator_type (${hosts:-an unknown number of} hosts)"
  while true; do
    cmd_create
    if (( setup_needed || created )); then cmd_setup; fi
    setup_needed=0 created=0
    workers="$(worker_count)"
    cmd_start
    watch_job
    case "$outcome" in
      finished) echo "tpu_pod.sh: the job finished on all $workers workers." >&2; return 0 ;;
      stopped) echo "tpu_pod.sh: the job was stopped; 'run' again to resume." >&2; return 0 ;;
      resume) reason="the job exited 75 (signal; checkpoint saved)" ;;
      preempted) reason="TPU $tpu is $fail_code" ;;
      failed)
        reason="$(describe_failure "$fail_worker" "$fail_code")"
        rc=1
        [[ ! "$fail_code" =~ ^[0-9]+$ ]] || rc="$fail_code"
        if [[ "$fail_code" == 65 ]]; then
          echo "tpu_pod.sh: $reason (non-finite loss or gradients: pretrain_lm.train.EXIT_NONFINITE); not relaunching. See worker $fail_worker's log above." >&2
          return 65
        fi
        failures=$(( failures + 1 ))
        if (( failures > max_failures )); then
          echo "tpu_pod.sh: $reason; giving up after $max_failures relaunches after failures (--max_failures)." >&2
          return "$rc"
        fi ;;
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
