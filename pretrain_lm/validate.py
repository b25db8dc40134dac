"""Checks a run config before anything slow happens (tokenizer, compile).

Every message names the config field and says what was expected, so a typo
costs seconds, not a queued pod job.
"""

import importlib.util

import ml_collections
import tensorflow as tf

from pretrain_lm.data import pipeline, sources
from pretrain_lm.models import MODELS
from pretrain_lm.objectives import OBJECTIVES

# pretrain_lm.train.OPTIMIZERS' keys (tests/switches_test.py checks they
# agree); importing train here would slow down every early error.
OPTIMIZER_NAMES = ('adafactor', 'adamw', 'lamb')


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError/FileNotFoundError naming the first bad field."""
  m, d, t, c = config.model, config.data, config.train, config.checkpoint
  _require(
    m.family in MODELS, f'model.family={m.family!r}; valid: {sorted(MODELS)}.'
  )
  _require(
    config.objective.name in OBJECTIVES,
    f'objective.name={config.objective.name!r}; valid: {sorted(OBJECTIVES)}.',
  )
  objective = OBJECTIVES[config.objective.name]
  _require(
    m.family in objective.FAMILIES,
    f'objective.name={config.objective.name!r} trains the '
    f'{list(objective.FAMILIES)} family, not model.family={m.family!r}.',
  )
  _require(
    m.position != 'learned' or d.seq_len <= m.max_len,
    f'data.seq_len={d.seq_len} exceeds model.max_len={m.max_len}, the '
    'size of the learned position table.',
  )
  _require(d.seq_len > 0, f'data.seq_len={d.seq_len} must be > 0.')
  _require(d.batch_size > 0, f'data.batch_size={d.batch_size} must be > 0.')
  _require(t.num_steps > 0, f'train.num_steps={t.num_steps} must be > 0.')
  _require(
    t.grad_accum_steps >= 1 and d.batch_size % t.grad_accum_steps == 0,
    f'train.grad_accum_steps={t.grad_accum_steps} must be >= 1 and divide '
    f'data.batch_size={d.batch_size}.',
  )
  pipeline.seq_len_stages(config)  # raises naming data.seq_len_schedule
  _require(
    config.optimizer.name in OPTIMIZER_NAMES,
    f'optimizer.name={config.optimizer.name!r}; valid: '
    f'{list(OPTIMIZER_NAMES)}.',
  )
  for name in ('log_every', 'eval_every'):
    _require(t[name] > 0, f'train.{name}={t[name]} must be > 0.')
  _require(c.every > 0, f'checkpoint.every={c.every} must be > 0.')
  _require(
    t.exit_interval >= 0, f'train.exit_interval={t.exit_interval} must be >= 0.'
  )
  _require(
    config.optimizer.warmup_steps >= 0, 'optimizer.warmup_steps must be >= 0.'
  )
  rates = config.objective
  _require(
    0 < rates.mask_rate < 1,
    f'objective.mask_rate={rates.mask_rate} must be in (0, 1).',
  )
  _require(
    rates.mask_token_rate + rates.random_token_rate <= 1,
    'objective.mask_token_rate + objective.random_token_rate must be '
    '<= 1 (the rest is kept unchanged).',
  )
  # The objective's own fields (its rates, the packing it needs).
  if hasattr(objective, 'check_config'):
    objective.check_config(config)

  sources.check_source(d.source, 'data.source', tfds_data_dir=d.tfds_data_dir)
  if d.eval_source:
    sources.check_source(
      d.eval_source, 'data.eval_source', tfds_data_dir=d.tfds_data_dir
    )
  if d.tokenizer and not tf.io.gfile.exists(d.tokenizer):
    raise FileNotFoundError(
      f'data.tokenizer: no tokenizer file at {d.tokenizer!r}.'
    )
  if c.init_from and not tf.io.gfile.exists(c.init_from):
    raise FileNotFoundError(
      f'checkpoint.init_from: {c.init_from!r} does not exist.'
    )


def unknown_override(argv: list[str]) -> str | None:
  """Explains the first `--config.a.b=...` in argv that names no field.

  absl's own message for a locked-config typo is an AttributeError deep in a
  traceback; this one names the field and lists the valid ones.
  """
  config_arg = next(
    (a.split('=', 1)[1] for a in argv if a.startswith('--config=')), None
  )
  if config_arg is None:
    return None
  path, _, arg = config_arg.partition(':')
  try:
    spec = importlib.util.spec_from_file_location('_config_file', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg or None)
  except Exception:  # noqa: BLE001 - absl reports config-file errors itself
    return None
  for a in argv:
    if not a.startswith('--config.'):
      continue
    name = a[len('--config.') :].split('=', 1)[0]
    node, walked = config, []
    for part in name.split('.'):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        where = '.'.join(walked) or 'the config'
        valid = (
          sorted(node.keys())
          if isinstance(node, ml_collections.ConfigDict)
          else []
        )
        return (
          f'Unknown config field {name!r} in {a!r}: {where} has no '
          f'field {part!r}. Valid fields of {where}: {valid}.'
        )
      node = node[part]
      walked.append(part)
  return None
