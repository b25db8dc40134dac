"""Each run's config, checked as main.py checks it, before anything starts."""

from collections.abc import Sequence

import ml_collections

from pretrain_lm.sweep.spec import Overrides, SweepError, override_flags


def resolve_config(argv: Sequence[str]) -> ml_collections.ConfigDict:
  """The config main.py would build from `--config=... --config.x=y` argv.

  Raises SweepError naming the field for an unknown field or a value of the
  wrong type.
  """
  from absl import flags
  from ml_collections import config_flags

  from pretrain_lm import validate

  argv = ['pretrain_lm.main', *argv]
  flag_values = flags.FlagValues()
  try:
    holder = config_flags.DEFINE_config_file(
      'config', None, '', flag_values=flag_values, sys_argv=argv
    )
    flag_values(argv)
    return holder.value
  except (flags.Error, AttributeError, KeyError, TypeError) as e:
    raise SweepError(validate.unknown_override(argv) or str(e)) from None


def check_run(
  base: str, fixed: Sequence[str], overrides: Overrides
) -> ml_collections.ConfigDict:
  """The run's resolved config, after every check main.py makes at start."""
  from pretrain_lm import validate

  config = resolve_config(
    [f'--config={base}', *fixed, *override_flags(overrides)]
  )
  # A value that does not survive the trip through the command line (a
  # string with a comma for a tuple field, say) would run something else.
  for key, value in overrides.items():
    got = config
    for part in key.split('.'):
      got = got[part]
    if isinstance(value, list):
      value = tuple(value)
    if got != value:
      raise SweepError(
        f'{key}={value!r} reads back from the command line as {got!r}.'
      )
  try:
    validate.check_config(config)
  except (ValueError, FileNotFoundError) as e:
    raise SweepError(str(e)) from None
  return config
