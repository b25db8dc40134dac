"""`python -m pretrain_lm.sweep`: its usage is in __init__.py."""

import argparse
import shlex
import sys
from collections.abc import Sequence

from pretrain_lm.sweep.launchers import LAUNCHERS
from pretrain_lm.sweep.run import run_sweep
from pretrain_lm.sweep.spec import SweepError
from pretrain_lm.sweep.workdirs import summarize


def main(argv: Sequence[str] | None = None) -> int:
  """Runs or summarizes a sweep from command-line flags; the exit code."""
  parser = argparse.ArgumentParser(
    prog='python -m pretrain_lm.sweep',
    allow_abbrev=False,
    # The package docstring's first line.
    description=sys.modules[__package__].__doc__.split('\n', 1)[0],
    epilog='Arguments --config.x=y after the sweep file apply to every run.',
  )
  parser.add_argument('sweep_file', nargs='?', help='experiments/sweeps/*.py')
  parser.add_argument('--base', help='base config, configs/bert.py:size=small')
  parser.add_argument('--workdir_root', help='runs go to WORKDIR_ROOT/NAME')
  parser.add_argument(
    '--launcher',
    default='local',
    help=f'{"|".join(LAUNCHERS)}, a command template or a file with one',
  )
  parser.add_argument('--parallel', type=int, default=1)
  parser.add_argument(
    '--launcher_args',
    default='',
    help="flags for the launcher script, e.g. '--tpu=t --zone=z'",
  )
  parser.add_argument(
    '--tpus',
    default='',
    help='tpu_pod: slices to spread the runs over, a,b,c (one run each)',
  )
  parser.add_argument('--dry_run', action='store_true')
  parser.add_argument('--summarize', metavar='WORKDIR_ROOT')
  parser.add_argument(
    '--format', default='markdown', choices=('markdown', 'csv')
  )
  args, rest = parser.parse_known_args(argv)
  try:
    if args.summarize:
      print(summarize(args.summarize, args.format), end='')
      return 0
    if not (args.sweep_file and args.base and args.workdir_root):
      parser.error('a sweep file, --base and --workdir_root are required')
    return run_sweep(
      args.sweep_file,
      base=args.base,
      workdir_root=args.workdir_root,
      fixed=rest,
      launcher=args.launcher,
      parallel=args.parallel,
      launcher_args=shlex.split(args.launcher_args),
      tpus=[t for t in args.tpus.split(',') if t],
      dry_run=args.dry_run,
    )
  except (SweepError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
