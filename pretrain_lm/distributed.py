"""Multi-host start-up: jax.distributed.initialize, and host agreement.

The decision (`plan`) is a pure function of the environment and the flags:
  1. explicit --coordinator_address/--num_processes/--process_id;
  2. a SLURM job step with more than one task (`srun`);
  3. a Cloud TPU VM (TPU worker variables, or TPU chips on this host);
  4. otherwise a single process, and initialize is not called
     (--distributed=on/off forces either way).
JAX's own cluster detection then fills in what a SLURM or TPU start leaves
unset (coordinator, process count and id).
"""

import dataclasses
import glob
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from absl import flags

_MODE = flags.DEFINE_enum(
  'distributed',
  'auto',
  ['auto', 'on', 'off'],
  'auto: call jax.distributed.initialize when flags, SLURM or a Cloud TPU '
  'VM say so; on: always (JAX detects the cluster); off: never.',
)
_COORDINATOR = flags.DEFINE_string(
  'coordinator_address',
  None,
  'host:port of process 0, for a multi-process run started by hand.',
)
_NUM_PROCESSES = flags.DEFINE_integer(
  'num_processes', None, 'Number of processes (with --coordinator_address).'
)
_PROCESS_ID = flags.DEFINE_integer(
  'process_id', None, 'This process, 0..num_processes-1.'
)
_LOCAL_DEVICE_IDS = flags.DEFINE_list(
  'local_device_ids',
  None,
  'Local device ids this process uses (default: all, or one GPU per SLURM '
  'task).',
)

# Set on the workers of a Cloud TPU slice (GKE, queued resources, multislice,
# older TPU VM images); any of them means "a TPU slice, let JAX detect it".
TPU_VARIABLES = (
  'TPU_WORKER_HOSTNAMES',
  'TPU_PROCESS_ADDRESSES',
  'MEGASCALE_COORDINATOR_ADDRESS',
  'CLOUD_TPU_TASK_ID',
  'TPU_WORKER_ID',
)
# JAX's SLURM detection needs all of these; SLURM_STEP_NODELIST is only set
# inside an `srun` step, not in the batch script itself.
SLURM_VARIABLES = (
  'SLURM_JOB_ID',
  'SLURM_STEP_NODELIST',
  'SLURM_NTASKS',
  'SLURM_PROCID',
  'SLURM_LOCALID',
)


@dataclasses.dataclass(frozen=True)
class Init:
  """How to call jax.distributed.initialize, and why."""

  source: str  # 'flags', 'slurm', 'tpu' or 'on'
  kwargs: dict[str, Any]


def tpu_chips_present() -> bool:
  """TPU chips on this host (/dev/accel* up to v4, /dev/vfio/N from v5)."""
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def plan(
  environ: Mapping[str, str],
  *,
  mode: str = 'auto',
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  local_device_ids: Sequence[int | str] | None = None,
  tpu_chips: bool = False,
) -> Init | None:
  """Decides whether and how to initialize; None means a single process."""
  if mode not in ('auto', 'on', 'off'):
    raise ValueError(f'--distributed={mode!r}; expected auto, on or off.')
  kwargs = {}
  if local_device_ids:
    kwargs['local_device_ids'] = [int(i) for i in local_device_ids]
  explicit = {
    'coordinator_address': coordinator_address,
    'num_processes': num_processes,
    'process_id': process_id,
  }
  given = {k: v for k, v in explicit.items() if v is not None}
  if mode == 'off':
    if given:
      raise ValueError(f'--distributed=off contradicts --{", --".join(given)}.')
    return None
  if given:
    missing = [k for k in explicit if k not in given]
    if missing:
      raise ValueError(
        f'--{", --".join(given)} given without --{", --".join(missing)}: '
        'a multi-process start needs all three.'
      )
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(
        f'--process_id={process_id} must be in [0, --num_processes='
        f'{num_processes}).'
      )
    return Init('flags', {**explicit, **kwargs})
  slurm = all(v in environ for v in SLURM_VARIABLES)
  if slurm and int(environ['SLURM_NTASKS']) > 1:
    # JAX gives each SLURM task one GPU; with one task per node, the task
    # uses all the node's GPUs instead.
    per_node = environ.get('SLURM_NTASKS_PER_NODE', '').split('(')[0]
    gpus = environ.get('SLURM_GPUS_ON_NODE', '')
    if not kwargs and per_node == '1' and gpus.isdigit():
      kwargs['local_device_ids'] = list(range(int(gpus)))
    return Init('slurm', {'cluster_detection_method': 'slurm', **kwargs})
  if any(environ.get(v) for v in TPU_VARIABLES) or tpu_chips:
    return Init('tpu', kwargs)
  if mode == 'on':
    return Init('on', kwargs)
  return None


def initialize_from_flags() -> Init | None:
  """Calls jax.distributed.initialize if the flags or environment say so."""
  init = plan(
    os.environ,
    mode=_MODE.value,
    coordinator_address=_COORDINATOR.value,
    num_processes=_NUM_PROCESSES.value,
    process_id=_PROCESS_ID.value,
    local_device_ids=_LOCAL_DEVICE_IDS.value,
    tpu_chips=_MODE.value == 'auto' and tpu_chips_present(),
  )
  if init is None:
    return None
  import jax

  try:
    jax.distributed.initialize(**init.kwargs)
  except ValueError as e:
    # TPU chips alone do not make a slice: a single TPU VM outside GCE's
    # metadata (a container, a dev box) runs as one process.
    if init.source != 'tpu' or 'coordinator_address' not in str(e):
      raise
    return None
  return init


def fingerprint(config_json: str, commit: str, workdir: str) -> dict[str, str]:
  """What every host of one run must agree on."""
  return {
    'config': hashlib.sha256(config_json.encode()).hexdigest()[:16],
    'commit': commit,
    'workdir': workdir,
  }


def mismatch_message(prints: Sequence[Mapping[str, str]]) -> str | None:
  """Names the processes that differ from process 0, and in what; or None."""
  lines = []
  for key in ('config', 'commit', 'workdir'):
    want = prints[0][key]
    differ = [i for i, p in enumerate(prints) if p[key] != want]
    if differ:
      values = ', '.join(f'process {i}: {prints[i][key]}' for i in differ)
      lines.append(
        f'  {key}: process 0 has {want}, but {values} '
        f'({len(differ)} of {len(prints)} processes differ)'
      )
  if not lines:
    return None
  return (
    'The hosts of this run disagree (every host must run the same code '
    'with the same config and --workdir):\n' + '\n'.join(lines)
  )


_WIDTH = 256  # bytes per field when the fingerprints are all-gathered


def check_hosts_agree(config, workdir: str) -> None:
  """Raises a ValueError naming the hosts whose config/commit/workdir differ."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from pretrain_lm import workdir as workdir_lib

  if jax.process_count() == 1:
    return
  mine = fingerprint(config_json(config), workdir_lib.git_commit(), workdir)
  encoded = np.zeros((len(mine), _WIDTH), np.uint8)
  for row, value in enumerate(mine.values()):
    data = value.encode()[:_WIDTH]
    encoded[row, : len(data)] = np.frombuffer(data, np.uint8)
  gathered = np.asarray(multihost_utils.process_allgather(encoded))
  prints = [
    {
      key: bytes(gathered[p, row]).rstrip(b'\0').decode(errors='replace')
      for row, key in enumerate(mine)
    }
    for p in range(gathered.shape[0])
  ]
  message = mismatch_message(prints)
  if message:
    raise ValueError(message)


def config_json(config) -> str:
  """The resolved config as canonical JSON (the hash all hosts compare)."""
  return json.dumps(config.to_dict(), sort_keys=True, default=str)
