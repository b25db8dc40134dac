"""Tests for pretrain_lm.validate: bad configs fail before any slow work."""

import glob
import importlib.util
import os
import subprocess
import sys

import ml_collections
import pytest

from pretrain_lm import configlib, validate
from pretrain_lm.models import config as model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(name):
  path = os.path.join(REPO, 'configs', f'{name}.py')
  spec = importlib.util.spec_from_file_location(f'{name}_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _presets():
  """(file, arg) for every config file, size and config-file option."""
  sizes = sorted({s for table in model_config.SIZES.values() for s in table})
  options = {
    'bert': ['', ',objective=nsp', ',objective=whole_word', ',objective=span'],
    'gpt': ['', ',objective=prefix_lm'],
    't5': ['', ',v1_1'],
    'ul2': ['', ',decoder'],
  }
  for path in sorted(glob.glob(os.path.join(REPO, 'configs', '*.py'))):
    name = os.path.basename(path)[:-3]
    module = _module(name)
    for size in sizes:
      for option in options.get(name, ['']):
        arg = f'size={size}{option}'
        try:
          module.get_config(arg)
        except ValueError:  # a size this family has no preset for
          continue
        yield name, arg


PRESETS = list(_presets())


def test_every_preset_at_every_size_validates():
  assert len(PRESETS) > 40 and {n for n, _ in PRESETS} == {
    os.path.basename(p)[:-3]
    for p in glob.glob(os.path.join(REPO, 'configs', '*.py'))
  }
  for name, arg in PRESETS:
    config = configlib.lock(_module(name).get_config(arg))
    validate.check_config(config)


def _config(**overrides):
  """bert tiny with dotted-name overrides, unlocked (any key, any type)."""
  c = _module('bert').get_config('size=tiny').to_dict()
  for name, value in overrides.items():
    section, field = name.split('.')
    c.setdefault(section, {})[field] = value
  return ml_collections.ConfigDict(c)


def _fails(config, *words, check=validate.check_config):
  with pytest.raises(ValueError) as e:
    check(config)
  for word in words:
    assert word in str(e.value), (word, str(e.value))


def test_unknown_field_names_the_nearest_one():
  _fails(
    _config(**{'data.batchsize': 8}),
    "Unknown config field 'data.batchsize'",
    "Did you mean 'data.batch_size'?",
    'Valid fields of data:',
  )
  _fails(
    _config(**{'trian.num_steps': 8}),
    "'trian.num_steps'",
    "Did you mean 'train.num_steps'?",
    'Valid sections:',
  )


@pytest.mark.parametrize(
  'field, value, kind',
  [
    ('data.batch_size', 2.5, 'an int'),
    ('data.batch_size', 'abc', 'an int'),
    ('train.num_steps', True, 'an int'),
    ('optimizer.learning_rate', '1e-3', 'a number'),
    ('train.progress_bar', 1, 'a bool'),
    ('data.source', 3, 'a string'),
  ],
)
def test_wrong_type_names_field_and_type(field, value, kind):
  _fails(_config(**{field: value}), f'{field}={value!r}', f'must be {kind}')


@pytest.mark.parametrize(
  'field, value',
  [
    ('optimizer.learning_rate', -1e-4),
    ('optimizer.weight_decay', -0.01),
    ('optimizer.b2', 1.0),
    ('objective.mask_rate', 1.5),
    ('objective.noise_density', 0.0),
    ('objective.delete_rate', -0.1),
    ('model.dropout_rate', 1.0),
    ('model.attention_dropout_rate', -0.1),
    ('data.shuffle_buffer', 0),
    ('data.max_doc_bytes', 0),
  ],
)
def test_out_of_range_names_the_field(field, value):
  _fails(_config(**{field: value}), f'{field}={value}')


@pytest.mark.parametrize(
  'field, value, choices',
  [
    ('checkpoint.best_mode', 'highest', "('min', 'max')"),
    ('checkpoint.on_corrupt', 'skip', "('fail', 'previous')"),
    ('train.prng_impl', 'philox', "('threefry', 'rbg', 'unsafe_rbg')"),
    ('objective.cross_entropy', 'chunked', "('optax', 'fused')"),
  ],
)
def test_bad_choice_names_the_field_and_the_choices(field, value, choices):
  _fails(_config(**{field: value}), f'{field}={value!r}', choices)


def test_gpu_levers_take_valid_values_and_exclude_what_they_cannot_join():
  _fails(_config(**{'model.vocab_multiple': 0}), 'model.vocab_multiple=0')
  _fails(
    _config(**{'objective.cross_entropy': 'fused', 'model.logits_chunk': 64}),
    'objective.cross_entropy=fused has no effect with model.logits_chunk=64',
  )
  c = _config(**{'objective.cross_entropy': 'fused', 'model.vocab_multiple': 8})
  validate.check_fields(c)
  assert model_config.ModelConfig.from_config(c.model).padded_vocab == (
    -(-c.model.vocab_size // 8) * 8
  )


def test_field_checks_come_before_any_file_is_read(tmp_path):
  # The source does not exist, so a check that read it would fail
  # differently: the field checks ran first.
  missing = str(tmp_path / 'missing.txt')
  config = _config(**{'optimizer.learning_rate': -1.0, 'data.source': missing})
  _fails(config, 'optimizer.learning_rate=-1.0')
  config.optimizer.learning_rate = 1e-3
  with pytest.raises(FileNotFoundError, match='missing.txt'):
    validate.check_config(config)


def test_compilation_cache_dir_must_be_a_directory(tmp_path):
  a_file = tmp_path / 'cache'
  a_file.write_text('')
  field = 'train.compilation_cache_dir'
  _fails(_config(**{field: str(a_file)}), f'{field}={str(a_file)!r}', 'file')
  validate.check_config(_config(**{field: str(tmp_path / 'new')}))


def test_grad_accum_names_the_batch_field_and_the_mesh():
  # Pretraining's and fine-tuning's batch: data.batch_size.
  validate.check_grad_accum(4, 32, data=2, fsdp=4)
  with pytest.raises(ValueError, match='=0 must be >= 1 and divide data.batch'):
    validate.check_grad_accum(0, 32)
  with pytest.raises(ValueError, match='=3 must be >= 1 and divide data.batch'):
    validate.check_grad_accum(3, 32)
  with pytest.raises(
    ValueError,
    match=r'data.batch_size=32 / train.grad_accum_steps=8 = 4 rows per '
    r'microbatch, .* mesh.data x mesh.fsdp = 2 x 4 = 8\.',
  ):
    validate.check_grad_accum(8, 32, data=2, fsdp=4)


def test_mesh_and_batch_split():
  _fails(_config(**{'mesh.fsdp': 0}), 'mesh.fsdp=0')
  _fails(_config(**{'mesh.data': -1, 'mesh.tensor': -1}), 'at most one axis')
  # Both data-parallel axes known: checked without devices.
  _fails(
    _config(**{'mesh.data': 4, 'mesh.fsdp': 2, 'data.batch_size': 12}),
    'data.batch_size=12',
    'mesh.data x mesh.fsdp = 4 x 2 = 8',
  )
  _fails(
    _config(
      **{'mesh.data': 2, 'data.batch_size': 8, 'train.grad_accum_steps': 8}
    ),
    '1 rows per microbatch',
    'mesh.data x mesh.fsdp = 2',
  )
  # mesh.data=-1: known only with the devices.
  config = _config(**{'mesh.fsdp': 2, 'data.batch_size': 12})
  validate.check_config(config)
  validate.check_devices(config, 4)  # 2 x 2
  _fails(config, 'mesh.data x mesh.fsdp = 4 x 2 = 8', check=_on(8))
  config.data.batch_size = 16
  validate.check_devices(config, 8)
  config.mesh.update({'data': 3, 'fsdp': 1})
  _fails(config, '(3, 1, 1) does not divide the 8', check=_on(8))
  config.mesh.data = 4
  _fails(config, '(4, 1, 1) uses 4 devices', 'set one axis to -1', check=_on(8))


def _on(num_devices):
  return lambda c: validate.check_devices(c, num_devices)


def test_heads_must_divide_the_width():
  _fails(
    _config(**{'model.num_heads': 3}),
    'model.num_heads=3 does not divide model.emb_dim=128',
  )
  # T5 v1.1 small's 6 heads of 64 over a width of 512 are the paper's.
  validate.check_config(_module('t5').get_config('size=small,v1_1'))
  # ModelConfig's own checks run here too, before any tokenizer.
  _fails(
    _config(**{'model.position': 'rotary', 'model.head_dim': 63}),
    'model.head_dim',
  )


def test_override_did_you_mean_and_types():
  argv = ['main', '--config=configs/bert.py:size=tiny']
  cwd = os.getcwd()
  os.chdir(REPO)
  try:
    message = validate.unknown_override([*argv, '--config.train.num_step=5'])
    assert "Did you mean 'train.num_steps'?" in message
    message = validate.unknown_override([*argv, '--config.trian.num_steps=5'])
    assert "Did you mean 'train.num_steps'?" in message
    for flag, words in [
      (
        '--config.data.batch_size=abc',
        'config field data.batch_size is an int',
      ),
      ('--config.data.batch_size=2.5', "is an int (it is 32); '2.5' is not"),
      ('--config.optimizer.learning_rate=x', 'learning_rate is a number'),
      ('--config.train.progress_bar=maybe', 'progress_bar is a bool'),
    ]:
      assert words in validate.unknown_override([*argv, flag]), flag
    assert (
      validate.unknown_override([*argv, '--config.data.seq_len=64']) is None
    )
    # absl puts a traceback in its message; this is the config file's own.
    message = validate.unknown_override(['main', '--config=configs/t5.py:v11'])
    assert message.startswith('--config=configs/t5.py:v11: Unknown config arg')
    assert "Did you mean 'v1_1'?" in message
  finally:
    os.chdir(cwd)


def test_config_file_arg_did_you_mean():
  with pytest.raises(ValueError, match="'szie'.*Did you mean 'size'"):
    configlib.parse_arg('szie=tiny', size='base', objective='mlm')
  with pytest.raises(ValueError, match="v1_1='maybe' is not a boolean"):
    configlib.parse_arg('v1_1=maybe', v1_1=False)
  with pytest.raises(ValueError, match="n='x' is not int"):
    configlib.parse_arg('n=x', n=3)


def test_cli_typo_fails_before_any_work(tmp_path):
  workdir = tmp_path / 'run'
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'pretrain_lm.main',
      '--config=configs/bert.py:size=tiny',
      '--config.train.num_step=5',
      f'--workdir={workdir}',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode != 0
  assert "Did you mean 'train.num_steps'?" in proc.stderr, proc.stderr
  assert 'Traceback' not in proc.stderr
  # No tokenizer, checkpoint or config was written.
  assert not workdir.exists() or not any(workdir.iterdir())


def test_field_errors_come_before_tensorflow_is_imported():
  # Importing TensorFlow takes seconds; the field checks must not wait for
  # it, so that a bad value fails the command in about a second.
  code = '\n'.join(
    [
      'import sys',
      'from pretrain_lm import configlib, main, validate',
      "c = configlib.load_file('configs/bert.py:size=tiny')",
      'c.objective.mask_rate = 1.5',
      'try:',
      '  validate.check_config(c)',
      'except ValueError as e:',
      '  print(e)',
      "print('tensorflow' in sys.modules)",
    ]
  )
  out = subprocess.run(
    [sys.executable, '-c', code],
    cwd=REPO,
    capture_output=True,
    text=True,
    check=True,
    timeout=120,
  ).stdout.splitlines()
  assert out == ['objective.mask_rate=1.5 must be in (0, 1).', 'False'], out


def _flat(config, prefix=''):
  """{'section.field': default} of a config."""
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update(_flat(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


# Fine-tuning's fields in the run sections beyond configlib.run_config's:
# its own, and those whose meaning or valid values differ from
# pretraining's (finetune/config.py says how, beside each).
FINETUNE_OWN = {
  'optimizer.name',
  'optimizer.decay',
  'optimizer.warmup_fraction',
  'optimizer.cut_frac',
  'optimizer.ratio',
  'optimizer.layer_lr_decay',
  'optimizer.gradual_unfreezing',
  'train.num_epochs',
  'train.num_steps',
  'train.eval_every',
  'train.eval_batch_size',
  'checkpoint.every',
  'checkpoint.keep_best',
}


def test_finetune_schema_extends_the_run_sections():
  from pretrain_lm.finetune import config as finetune_config

  shared = _flat(configlib.run_config())
  pretraining = _flat(configlib.base_config())
  finetuning = _flat(finetune_config.base_config())
  for name, default in shared.items():
    assert type(pretraining[name]) is type(default), name
    assert type(finetuning[name]) is type(default), name
  sections = {name.split('.')[0] for name in shared}
  in_run_sections = {n for n in finetuning if n.split('.')[0] in sections}
  assert in_run_sections == set(shared) | FINETUNE_OWN
  assert not set(shared) & FINETUNE_OWN


@pytest.mark.parametrize(
  'field, value, words',
  [
    ('train.log_every', 0, 'train.log_every=0 must be > 0.'),
    ('train.exit_interval', -1, 'train.exit_interval=-1 must be >= 0.'),
    ('train.max_consecutive_skips', -1, 'max_consecutive_skips=-1 must be'),
    ('train.grad_accum_steps', 3, 'train.grad_accum_steps=3 must be >= 1'),
    ('train.profile_hosts', 'one', "train.profile_hosts='one' is not one"),
    ('train.input_bound_share', 2.0, 'train.input_bound_share=2.0 must be'),
    ('data.batch_size', 0, 'data.batch_size=0 must be > 0.'),
    ('mesh.fsdp', 0, 'mesh.fsdp=0 must be >= 1'),
    ('mesh.dcn_data', 0, 'mesh.dcn_data=0 must be >= 1'),
    ('optimizer.b2', 1.0, 'optimizer.b2=1.0 must be in [0, 1).'),
    ('optimizer.learning_rate', -1.0, 'optimizer.learning_rate=-1.0 must'),
    ('checkpoint.keep', -1, 'checkpoint.keep=-1 must be >= 0.'),
    ('checkpoint.on_corrupt', 'skip', "checkpoint.on_corrupt='skip'; expected"),
    ('train.prng_impl', 'philox', "train.prng_impl='philox'; expected"),
  ],
)
def test_shared_fields_fail_alike_in_both_schemas(
  field, value, words, tmp_path
):
  # One check (validate.check_run) for the fields fine-tuning shares.
  from pretrain_lm.finetune import config as finetune_config

  _fails(_config(**{field: value}), words)
  c = finetune_config.base_config()
  section, name = field.split('.')
  c[section][name] = value
  _fails(c, words, check=lambda c: finetune_config.check_config(c, ''))
