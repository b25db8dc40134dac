"""Checks a run config before anything slow happens (tokenizer, compile).

Every message names the config field and says what was expected, so a typo
costs a second, not a queued pod job: the field checks run before
TensorFlow (the data and objective modules) is even imported.
"""

import difflib
import importlib.util
import math
import os
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections

from pretrain_lm import configlib, profiling, sharding
from pretrain_lm.models import MODELS, ModelConfig
from pretrain_lm.models import config as model_config_lib

# pretrain_lm.training.optimizer.OPTIMIZERS' keys (tests/switches_test.py
# checks they agree); importing optax here would slow down every early
# error.
OPTIMIZER_NAMES = ('adafactor', 'adamw', 'lamb')


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


# Numbers that mean something only in a range: (field, low, high, ends),
# ends '[)' etc. saying which bounds are allowed. An objective's check_config
# adds what depends on the objective; these hold whichever is chosen.
_RANGES = (
  ('model.dropout_rate', 0, 1, '[)'),
  ('model.attention_dropout_rate', 0, 1, '[)'),
  ('model.initializer_range', 0, math.inf, '()'),
  ('model.layer_norm_eps', 0, math.inf, '()'),
  ('model.rotary_base', 0, math.inf, '()'),
  ('objective.mask_rate', 0, 1, '()'),
  ('objective.mask_token_rate', 0, 1, '[]'),
  ('objective.random_token_rate', 0, 1, '[]'),
  ('objective.span_p', 0, 1, '(]'),
  ('objective.noise_density', 0, 1, '()'),
  ('objective.mean_span_length', 0, math.inf, '()'),
  ('objective.infill_rate', 0, 1, '[]'),
  ('objective.poisson_lambda', 0, math.inf, '[)'),
  ('objective.infill_random_rate', 0, 1, '[]'),
  ('objective.permute_sentences', 0, 1, '[]'),
  ('objective.rotate_rate', 0, 1, '[]'),
  ('objective.delete_rate', 0, 1, '[]'),
  ('objective.token_mask_rate', 0, 1, '[]'),
  ('model.logits_chunk', 0, math.inf, '[)'),
  ('optimizer.final_learning_rate', 0, math.inf, '[)'),
  ('optimizer.adafactor_decay_rate', 0, 1, '(]'),
  ('optimizer.adafactor_momentum', 0, 1, '[)'),
  ('data.shuffle_buffer', 1, math.inf, '[)'),
  ('data.tokenizer_max_docs', 1, math.inf, '[)'),
  ('data.max_doc_bytes', 1, math.inf, '[)'),
)
# The ranges of configlib.run_config's numbers: fine-tuning's too.
RUN_RANGES = (
  ('optimizer.learning_rate', 0, math.inf, '[)'),
  ('optimizer.b1', 0, 1, '[)'),
  ('optimizer.b2', 0, 1, '[)'),
  ('optimizer.eps', 0, math.inf, '[)'),
  ('optimizer.weight_decay', 0, math.inf, '[)'),
  ('optimizer.grad_clip_norm', 0, math.inf, '[)'),
)


def _check_ranges(config: ml_collections.ConfigDict, ranges) -> None:
  """Each (field, low, high, ends) of `ranges` the config has is in range."""
  for name, low, high, ends in ranges:
    section, field = name.split('.')
    if field not in config.get(section, {}):
      continue
    value = config[section][field]
    above = value > low if ends[0] == '(' else value >= low
    below = value < high if ends[1] == ')' else value <= high
    high_text = 'inf' if math.isinf(high) else f'{high:g}'
    _require(
      above and below,
      f'{name}={value} must be in {ends[0]}{low:g}, {high_text}{ends[1]}.',
    )


def _leaves(config: Any, prefix: str = '') -> Iterator[tuple[str, Any]]:
  """(dotted name, value) of every field below `config`."""
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}', value


def _did_you_mean(name: str, names) -> str:
  """' Did you mean 'x.y'?' for the known name closest to `name`, or ''."""
  close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
  return f' Did you mean {close[0]!r}?' if close else ''


def _type_error(name: str, value: Any, default: Any) -> str | None:
  """Why `value` cannot stand where base_config has `default`, or None."""
  if isinstance(default, bool):
    ok, kind = isinstance(value, bool), 'a bool'
  elif isinstance(default, int):
    ok = isinstance(value, int) and not isinstance(value, bool)
    kind = 'an int'
  elif isinstance(default, float):
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    kind = 'a number'
  elif isinstance(default, str):
    ok, kind = isinstance(value, str), 'a string'
  else:
    return None
  if ok:
    return None
  return f'{name}={value!r} ({type(value).__name__}) must be {kind}.'


def check_fields(config: ml_collections.ConfigDict) -> None:
  """The checks that read no file and touch no device: milliseconds.

  Unknown fields (with the nearest known one), wrong types, numbers out of
  range, the fields fine-tuning shares (check_run), a mesh or batch that
  cannot be split, heads that do not divide the width.
  """
  known = dict(_leaves(configlib.base_config()))
  given = dict(_leaves(config))
  sections = {name.rsplit('.', 1)[0] for name in known}
  for name, value in given.items():
    if name not in known:
      section = name.rsplit('.', 1)[0] if '.' in name else 'the config'
      fields = sorted(
        k[len(section) + 1 :] for k in known if k.startswith(f'{section}.')
      )
      where = (
        f'Valid fields of {section}: {fields}.'
        if section in sections
        else f'Valid sections: {sorted(sections)}.'
      )
      raise ValueError(
        f'Unknown config field {name!r}.{_did_you_mean(name, known)} {where}'
      )
    message = _type_error(name, value, known[name])
    _require(message is None, message)
  _check_ranges(config, _RANGES)
  check_run(config)
  _check_mesh(config)
  _check_heads(config.model)


def _check_heads(m: ml_collections.ConfigDict) -> None:
  """model.num_heads must divide model.emb_dim but in the papers' presets.

  The attention width is num_heads x head_dim, so the model runs either
  way; but a head count that does not divide the width is nearly always an
  override that left head_dim behind. T5 v1.1 small's 6 x 64 over 512 is
  such a shape on purpose, so the SIZES presets' shapes are allowed.
  """
  _require(m.num_heads > 0, f'model.num_heads={m.num_heads} must be > 0.')
  shape = (m.emb_dim, m.num_heads, m.head_dim)
  presets = {
    (p['emb_dim'], p['num_heads'], p['head_dim'])
    for table, sizes in model_config_lib.SIZES.items()
    for p in (model_config_lib.size_preset(size, table) for size in sizes)
  }
  _require(
    m.emb_dim % m.num_heads == 0 or shape in presets,
    f'model.num_heads={m.num_heads} does not divide model.emb_dim='
    f'{m.emb_dim}; pick a divisor and set model.head_dim = emb_dim / '
    f'num_heads (now {m.head_dim}).',
  )


def check_mesh(mesh: ml_collections.ConfigDict) -> None:
  """The mesh section's axis sizes, before any device is counted."""
  sizes = [mesh[a] for a in sharding.MESH_AXES]
  for axis, size in zip(sharding.MESH_AXES, sizes, strict=True):
    _require(
      size == -1 or size >= 1,
      f'mesh.{axis}={size} must be >= 1, or -1 for the devices the other '
      'axes leave.',
    )
  _require(
    sizes.count(-1) <= 1,
    f'mesh (data, fsdp, tensor) = {tuple(sizes)}: at most one axis may be -1.',
  )
  slices = sharding.num_slices(mesh)
  _require(
    slices >= 1,
    f'mesh.dcn_data={slices} must be >= 1 (the slices the data axis spans).',
  )


def _mesh_sizes(config: ml_collections.ConfigDict, num_devices: int | None):
  """The mesh's (data, fsdp, tensor) sizes, the data axis over every slice
  (mesh.data x mesh.dcn_data); -1 resolved, or left without a count."""
  check_mesh(config.mesh)
  sizes = [config.mesh[a] for a in sharding.MESH_AXES]
  slices = sharding.num_slices(config.mesh)
  if num_devices is None:
    return [sizes[0] * slices if sizes[0] != -1 else -1, *sizes[1:]]
  return list(sharding.mesh_shape(config.mesh, num_devices))


def _check_mesh(
  config: ml_collections.ConfigDict, num_devices: int | None = None
) -> None:
  """The mesh fits the devices, and the batch splits over its data axes."""
  data, fsdp, _ = _mesh_sizes(config, num_devices)
  if data == -1 or fsdp == -1:
    return  # the data-parallel size is known once the devices are
  batch, shards = config.data.batch_size, data * fsdp
  slices = sharding.num_slices(config.mesh)
  names, sizes = 'mesh.data x mesh.fsdp', f'{data} x {fsdp}'
  if slices > 1:
    names = 'mesh.data x mesh.dcn_data x mesh.fsdp'
    sizes = f'{data // slices} x {slices} x {fsdp}'
  _require(
    batch % shards == 0,
    f'data.batch_size={batch} is not divisible by the data-parallel size '
    f'{names} = {sizes} = {shards}.',
  )
  check_grad_accum(config.train.grad_accum_steps, batch, data=data, fsdp=fsdp)


def check_grad_accum(
  accum: int,
  batch: int,
  data: int = 1,
  fsdp: int = 1,
) -> None:
  """train.grad_accum_steps divides the global batch (data.batch_size,
  `batch`) into microbatches that split evenly over the mesh's
  batch-parallel axes, sized `data` x `fsdp`."""
  _require(
    accum >= 1 and batch % accum == 0,
    f'train.grad_accum_steps={accum} must be >= 1 and divide '
    f'data.batch_size={batch}.',
  )
  shards = data * fsdp
  _require(
    (batch // accum) % shards == 0,
    f'data.batch_size={batch} / train.grad_accum_steps={accum} = '
    f'{batch // accum} rows per microbatch, not divisible by the '
    f'data-parallel size mesh.data x mesh.fsdp = {data} x {fsdp} = {shards}.',
  )


def check_devices(
  config: ml_collections.ConfigDict, num_devices: int | None = None
) -> None:
  """The mesh checks against `num_devices` (default: all, after init)."""
  if num_devices is None:
    num_devices = jax.device_count()
  _check_mesh(config, num_devices)


def check_cache_dir(path: str) -> None:
  """train.compilation_cache_dir: empty, or a directory (created if absent)."""
  import tensorflow as tf

  local = path if '://' in path else os.path.expanduser(path)
  _require(
    not path or not tf.io.gfile.exists(local) or tf.io.gfile.isdir(local),
    f'train.compilation_cache_dir={path!r} is a file; give a directory '
    "(created if absent) or '' to leave the cache off.",
  )


def check_monitoring(t: ml_collections.ConfigDict) -> None:
  """The train section's profile and input-bound fields (pretraining's and
  fine-tuning's)."""
  profiling.parse_steps(t.profile_steps)
  _require(
    t.profile_hosts in profiling.HOSTS,
    f'train.profile_hosts={t.profile_hosts!r} is not one of {profiling.HOSTS}.',
  )
  _require(
    0 <= t.input_bound_share <= 1,
    f'train.input_bound_share={t.input_bound_share} must be in [0, 1] (0: '
    'never report).',
  )


def check_run(config: ml_collections.ConfigDict) -> None:
  """The fields of configlib.run_config, pretraining's and fine-tuning's.

  Both schemas' check_config call it, so a shared field fails with one
  message whichever run it is in. Milliseconds: reads no file.
  """
  _check_ranges(config, RUN_RANGES)
  batch = config.data.batch_size
  _require(batch > 0, f'data.batch_size={batch} must be > 0.')
  check_train(config.train, batch)
  check_mesh(config.mesh)
  check_checkpoint(config.checkpoint)


def check_train(t: ml_collections.ConfigDict, batch_size: int) -> None:
  """configlib.run_train's fields: the training loop's."""
  _require(t.log_every > 0, f'train.log_every={t.log_every} must be > 0.')
  _require(
    t.exit_interval >= 0, f'train.exit_interval={t.exit_interval} must be >= 0.'
  )
  _require(
    t.max_consecutive_skips >= 0,
    f'train.max_consecutive_skips={t.max_consecutive_skips} must be >= 0.',
  )
  _require(
    t.prng_impl in configlib.PRNG_IMPLS,
    f'train.prng_impl={t.prng_impl!r}; expected one of {configlib.PRNG_IMPLS}.',
  )
  check_monitoring(t)
  check_grad_accum(t.grad_accum_steps, batch_size)


def check_checkpoint(c: ml_collections.ConfigDict) -> None:
  """configlib.run_checkpoint's fields: retention and restore."""
  _require(c.keep >= 0, f'checkpoint.keep={c.keep} must be >= 0.')
  _require(
    c.on_corrupt in configlib.ON_CORRUPT,
    f'checkpoint.on_corrupt={c.on_corrupt!r}; expected one of '
    f'{configlib.ON_CORRUPT}.',
  )


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError/FileNotFoundError naming the first bad field."""
  check_fields(config)  # milliseconds: before anything that reads files
  _require(
    config.objective.cross_entropy in configlib.CROSS_ENTROPY,
    f'objective.cross_entropy={config.objective.cross_entropy!r}; expected '
    f'one of {configlib.CROSS_ENTROPY}.',
  )
  _require(
    not (
      config.objective.cross_entropy == 'fused' and config.model.logits_chunk
    ),
    f'objective.cross_entropy=fused has no effect with model.logits_chunk='
    f'{config.model.logits_chunk}: the chunked head computes its own '
    'cross-entropy. Set one of them.',
  )
  objective = _check_model_and_objective(config)
  _check_schedule(config)
  check_cache_dir(config.train.compilation_cache_dir)
  _check_retention(config.checkpoint)
  # The objective's own fields (its rates, the packing it needs).
  if hasattr(objective, 'check_config'):
    objective.check_config(config)
  # ModelConfig's own checks, before tokenizer training.
  ModelConfig.from_config(config.model)
  _check_files(config)


def _check_model_and_objective(config: ml_collections.ConfigDict):
  """The family and objective exist and go together; returns the objective's
  module."""
  # The objective modules load TensorFlow (seconds): only once the fields
  # are known to be sound.
  from pretrain_lm.objectives import OBJECTIVES

  m, d, o = config.model, config.data, config.objective
  _require(
    m.family in MODELS, f'model.family={m.family!r}; valid: {sorted(MODELS)}.'
  )
  _require(
    o.name in OBJECTIVES,
    f'objective.name={o.name!r}; valid: {sorted(OBJECTIVES)}.',
  )
  objective = OBJECTIVES[o.name]
  _require(
    m.family in objective.FAMILIES,
    f'objective.name={o.name!r} trains the '
    f'{list(objective.FAMILIES)} family, not model.family={m.family!r}.',
  )
  _require(
    m.position != 'learned' or d.seq_len <= m.max_len,
    f'data.seq_len={d.seq_len} exceeds model.max_len={m.max_len}, the '
    'size of the learned position table.',
  )
  _require(
    o.mask_token_rate + o.random_token_rate <= 1,
    'objective.mask_token_rate + objective.random_token_rate must be '
    '<= 1 (the rest is kept unchanged).',
  )
  return objective


def _check_schedule(config: ml_collections.ConfigDict) -> None:
  """Pretraining's rows, steps, evaluation and optimizer (check_run has the
  fields fine-tuning shares)."""
  from pretrain_lm.data import pipeline
  from pretrain_lm.data import tokenizer as tokenizer_lib

  d, t, opt = config.data, config.train, config.optimizer
  _require(d.seq_len > 0, f'data.seq_len={d.seq_len} must be > 0.')
  _require(
    d.tokenizer_type in tokenizer_lib.MODEL_TYPES,
    f'data.tokenizer_type={d.tokenizer_type!r}; expected one of '
    f'{tokenizer_lib.MODEL_TYPES}.',
  )
  _require(t.num_steps > 0, f'train.num_steps={t.num_steps} must be > 0.')
  _require(t.eval_every > 0, f'train.eval_every={t.eval_every} must be > 0.')
  pipeline.seq_len_stages(config)  # raises naming data.seq_len_schedule
  _require(
    opt.name in OPTIMIZER_NAMES,
    f'optimizer.name={opt.name!r}; valid: {list(OPTIMIZER_NAMES)}.',
  )
  _require(opt.warmup_steps >= 0, 'optimizer.warmup_steps must be >= 0.')


def _check_retention(c: ml_collections.ConfigDict) -> None:
  """Pretraining's checkpoint fields beyond run_checkpoint's."""
  _require(c.every > 0, f'checkpoint.every={c.every} must be > 0.')
  for name in ('keep_best', 'keep_every'):
    _require(c[name] >= 0, f'checkpoint.{name}={c[name]} must be >= 0.')
  _require(
    c.best_mode in configlib.BEST_MODES,
    f'checkpoint.best_mode={c.best_mode!r}; expected one of '
    f'{configlib.BEST_MODES}.',
  )
  _require(
    not c.keep_best or c.best_metric.startswith('eval_'),
    f'checkpoint.best_metric={c.best_metric!r} must name an eval metric '
    "(they start with 'eval_', e.g. 'eval_loss').",
  )


def _check_files(config: ml_collections.ConfigDict) -> None:
  """What the run reads: prepared manifests, local text, the tokenizer and
  checkpoint.init_from."""
  import tensorflow as tf

  from pretrain_lm.data import pipeline, prepared, sources
  from pretrain_lm.objectives import row_transform

  d = config.data
  if prepared.is_prepared(d.source):
    # Manifests and shard sizes, the row length, packing and tokenizer.
    pipeline.prepared_stream(config, row_transform(config).row_length)
  evaluated = sources.eval_source(d)
  if prepared.is_prepared(evaluated or d.source):
    row_length = row_transform(config).row_length
    pipeline.prepared_stream(config, row_length, 'eval')
  if not prepared.is_prepared(d.source) or (
    evaluated and not prepared.is_prepared(evaluated)
  ):
    # Scans local files once (the pipeline reuses the scan): data.bad_input.
    # This host's files only (sources.host_files).
    sources.check_sources(d, jax.process_index(), jax.process_count())
  if d.tokenizer and not tf.io.gfile.exists(d.tokenizer):
    raise FileNotFoundError(
      f'data.tokenizer: no tokenizer file at {d.tokenizer!r}.'
    )
  init_from = config.checkpoint.init_from
  if init_from and not tf.io.gfile.exists(init_from):
    raise FileNotFoundError(
      f'checkpoint.init_from: {init_from!r} does not exist.'
    )


def _parse_error(text: str, default: Any) -> str | None:
  """Why the command-line `text` cannot set a field holding `default`."""
  if isinstance(default, bool):
    # absl's boolean parser accepts exactly these.
    ok = text.lower() in ('true', 't', '1', 'false', 'f', '0')
    return None if ok else 'is a bool: true or false'
  for kind, parse, what in ((int, int, 'an int'), (float, float, 'a number')):
    if isinstance(default, kind):
      try:
        parse(text)
      except ValueError:
        return f'is {what}'
      return None
  return None


def unknown_override(argv: list[str]) -> str | None:
  """Explains the first `--config.a.b=...` in argv that names no field.

  Or that gives a field a value of the wrong type. absl's own messages are
  an AttributeError deep in a traceback, or name no field; this one names
  the field, the nearest known one and the valid ones.
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
  except ValueError as e:  # the config file's arg (parse_arg) or values
    return f'--config={config_arg}: {e}'
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
        hint = _did_you_mean(name, dict(_leaves(config)))
        return (
          f'Unknown config field {name!r} in {a!r}: {where} has no '
          f'field {part!r}.{hint} Valid fields of {where}: {valid}.'
        )
      node = node[part]
      walked.append(part)
    _, has_value, text = a.partition('=')
    why = _parse_error(text, node) if has_value else None
    if why:
      return (
        f'{a!r}: config field {name} {why} (it is {node!r}); {text!r} is not.'
      )
  return None
