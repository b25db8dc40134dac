r"""Sweeps of config overrides: expand, validate, run or launch, summarize.

A sweep is a Python file whose `get_sweep()` returns a list of override
dicts, built with `choice`, `product` and `zip` from this module:

  # experiments/sweeps/bert_lr.py
  from pretrain_lm import sweep

  def get_sweep():
    return sweep.product(
      sweep.choice('optimizer.learning_rate', [1e-4, 3e-4]),
      sweep.choice('optimizer.warmup_steps', [1000, 10_000]),
    )

Run it (from the repository root):

  python -m pretrain_lm.sweep experiments/sweeps/bert_lr.py \
      --base=configs/bert.py:size=small --workdir_root=gs://bucket/bert_lr \
      [--dry_run] [--launcher=local|tpu_pod|slurm|TEMPLATE|FILE] \
      [--parallel=N] [--launcher_args='--tpu=my-v4 --zone=us-central2-b'] \
      [--tpus=a,b,c] [--config.train.num_steps=100000 ...]

Every override of every run is checked against the base config (field names,
types, `pretrain_lm.validate`) before anything starts. Each run gets the
workdir `WORKDIR_ROOT/NAME`, NAME made of its overrides
(`learning_rate=0.0003-warmup_steps=1000`); `--config.x=y` flags after the
sweep file apply to every run and stay out of the names. Runs whose workdir
already reached `train.num_steps` are skipped, so rerunning the same command
resumes an interrupted sweep. `--launcher=local` runs
`python -m pretrain_lm.main` here, `--parallel` at a time; `tpu_pod` runs
`launch/tpu_pod.sh run` once per run, one after the other on the same slice,
or with `--tpus=a,b,c` on whichever of those slices is free; `slurm` submits
`launch/slurm.sbatch` once per run. Any other scheduler (GKE/XPK, ...) takes
a command template, given inline or as a file holding it:

  --launcher='xpk workload create --cluster=C --workload={job} \
      --tpu-type=v5p-32 --command="{command}"'

with the placeholders {name} (the run's name), {job} (the name in lowercase
letters, digits and '-', at most 39 characters, for Kubernetes), {workdir},
{command} (`python -m pretrain_lm.main` and the run's flags, as one command
line) and {args} (the flags alone); `{{` and `}}` are literal braces. Each
value is shell-quoted for where it stands: unquoted it is one word ({args}:
one per flag); inside '...' or "..." it is quoted for the shell that later
runs the quoted text, so paths with spaces or quotes reach the run intact.
The rendered line runs in `sh`, `--parallel` at a time.
`WORKDIR_ROOT/sweep.json` lists the runs.

  python -m pretrain_lm.sweep --summarize WORKDIR_ROOT [--format=csv]

prints each run's overrides, last step, last train loss and last eval
metrics as a markdown (default) or CSV table.

The package, one file per job: spec.py (choice, product, zip, loading a
sweep file, run names), check.py (each run's config, checked), launchers.py
(each run's command: a launcher script or a template), run.py (run_sweep),
workdirs.py (finished steps, sweep.json, summaries) and __main__.py (the
flags).
"""

from collections.abc import Sequence

from pretrain_lm.sweep.check import check_run, resolve_config
from pretrain_lm.sweep.launchers import (
  LAUNCHERS,
  PLACEHOLDERS,
  Command,
  job_name,
  load_template,
  render_template,
)
from pretrain_lm.sweep.run import EXIT_RESUME, run_sweep
from pretrain_lm.sweep.spec import (
  MAX_NAME_LEN,
  Overrides,
  SweepError,
  choice,
  format_value,
  labels,
  load_sweep,
  override_flags,
  product,
  run_names,
  zip,
)
from pretrain_lm.sweep.workdirs import (
  SWEEP_FILE,
  completed_step,
  is_finished,
  join,
  summarize,
  summary_rows,
)


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m pretrain_lm.sweep` on argv; returns its exit code."""
  # Imported on use: `python -m` runs __main__.py as a script, and runpy
  # warns when the package has imported it as a module before that.
  from pretrain_lm.sweep import __main__ as cli

  return cli.main(argv)


__all__ = [
  'EXIT_RESUME',
  'LAUNCHERS',
  'MAX_NAME_LEN',
  'PLACEHOLDERS',
  'SWEEP_FILE',
  'Command',
  'Overrides',
  'SweepError',
  'check_run',
  'choice',
  'completed_step',
  'format_value',
  'is_finished',
  'job_name',
  'join',
  'labels',
  'load_sweep',
  'load_template',
  'main',
  'override_flags',
  'product',
  'render_template',
  'resolve_config',
  'run_names',
  'run_sweep',
  'summarize',
  'summary_rows',
  'zip',
]
