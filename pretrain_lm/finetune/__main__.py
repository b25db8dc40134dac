r"""Fine-tunes a pretraining workdir on a downstream task.

  python -m pretrain_lm.finetune --config=configs/finetune/glue.py:task=sst2 \
      --init=workdirs/quickstart --workdir=workdirs/quickstart_sst2

Rerunning the same command resumes from the latest checkpoint in --workdir;
exit code 75 (signal; checkpoint saved) asks for that, 65 (diverged: too many
non-finite steps in a row) does not, as in pretraining (pretrain_lm.main).
--config.<section>.<field>=value overrides any config field. From Python,
see pretrain_lm.finetune (its docstring runs the same Trainer).
"""

from absl import app, flags, logging
from ml_collections import config_flags

from pretrain_lm import validate, xla_flags
from pretrain_lm.finetune import config as config_lib

_CONFIG = config_flags.DEFINE_config_file(
  'config',
  None,
  'Config file, e.g. configs/finetune/glue.py:task=sst2.',
  lock_config=True,
)
_INIT = flags.DEFINE_string(
  'init', None, 'The pretraining workdir to start from (init.workdir).'
)
_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'Directory for checkpoints, metrics and results.json.'
)
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  """Checks the config, fine-tunes and prints the dev scores.

  Args:
    argv: the command line left after absl's flag parsing (no arguments).
  """
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config, workdir = _CONFIG.value, _WORKDIR.value
  xla_flags.apply_gpu_defaults()  # before JAX starts a backend
  if _INIT.value is not None:
    config.init.workdir = _INIT.value
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  # Bad input fails here, in seconds, before anything is built or compiled;
  # a missing data file fails as the run reads its data, before compiling.
  try:
    config_lib.check_config(config, workdir)
    from pretrain_lm import checkpoint  # JAX import is slow
    from pretrain_lm.finetune import trainer
    from pretrain_lm.training import loop

    run = trainer.Trainer(config, workdir)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None

  try:  # checkpoints that cannot be resumed as asked: said, not traced
    results = run.run()
  except checkpoint.RestoreError as e:
    raise SystemExit(f'error: {e}') from None
  loop.exit_if_stopped(run)
  best, final = results['best'], results['final']
  name = 'eval_' + results['metric']
  if final:
    print(
      f'\nDev {results["metric"]}: {final[name]:.4f} at the last step '
      f'{final["step"]}; best {best[name]:.4f} at step {best["step"]}.'
    )
  print(
    f'Checkpoints, metrics.jsonl, TensorBoard logs and results.json are in '
    f'{workdir}.'
  )


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with a clear message for a mistyped config field."""
  # A fine-tuning-only spelling of a pretraining field: say which to set.
  message = config_lib.renamed_override(argv)
  if message:
    raise SystemExit(f'error: {message}')
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError) as e:
    message = validate.unknown_override(argv) or str(e)
    raise SystemExit(f'error: {message}') from None


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
