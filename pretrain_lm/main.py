r"""Pretrains a model: `python -m pretrain_lm.main --config=... --workdir=...`.

  python -m pretrain_lm.main --config=configs/bert.py:size=tiny \
      --workdir=/tmp/run --config.train.num_steps=300

Rerunning the same command resumes from the latest checkpoint in --workdir;
exit code 75 (signal; checkpoint saved) asks for that, 65 (diverged: too many
non-finite steps in a row) does not. Multi-host: run it on every host.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from pretrain_lm import distributed, validate, xla_flags

_CONFIG = config_flags.DEFINE_config_file(
  'config',
  None,
  'Config file, e.g. configs/bert.py:size=tiny.',
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'Directory for checkpoints, metrics and the tokenizer.'
)
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config, workdir = _CONFIG.value, _WORKDIR.value
  xla_flags.apply_gpu_defaults()  # before JAX starts a backend
  if not flags.FLAGS['verbosity'].present:
    # Orbax logs every save at INFO; metrics and progress are on the console.
    logging.set_verbosity(logging.WARNING)
  # Bad input fails here, in seconds, before tokenizer training or compiling.
  try:
    validate.check_fields(config)  # under a second: no TF, no files
    distributed.initialize_from_flags()  # before anything touches devices
    validate.check_devices(config)  # the mesh against the devices
    validate.check_config(config)  # the rest: sources, objective, files
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None

  from pretrain_lm import checkpoint, train  # slow imports: errors first
  from pretrain_lm.training import loop

  try:  # checkpoints that cannot be resumed as asked: said, not traced
    trainer = train.Trainer(config, workdir)
    trainer.run()
  except checkpoint.RestoreError as e:
    raise SystemExit(f'error: {e}') from None
  loop.exit_if_stopped(trainer)
  if trainer.is_chief:
    print(
      f'\nCheckpoints, metrics.jsonl and TensorBoard logs are in {workdir}.'
      f'\nIn Python: import pretrain_lm; m = pretrain_lm.load({workdir!r})'
    )


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with a clear message for a mistyped config field."""
  try:
    return flags.FLAGS(argv)
  # ValueError: the config file's own, e.g. an unknown `:size=` arg.
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    message = validate.unknown_override(argv) or str(e)
    raise SystemExit(f'error: {message}') from None


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
