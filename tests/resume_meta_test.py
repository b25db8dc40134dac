"""The data stream and tokenizer a checkpoint stores, checked on resume."""

import hashlib
import os
import shutil

import jax
import ml_collections
import numpy as np
import pytest
from sentencepiece import sentencepiece_model_pb2

import pretrain_lm
from pretrain_lm import checkpoint, configlib, objectives, train
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import fingerprint, pipeline
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.finetune import trainer as finetune_trainer

STEPS = 4  # tiny_workdir's run length


@pytest.fixture(scope='module')
def trained(tiny_workdir):
  return tiny_workdir('bert')


def copy_of(workdir: str, tmp_path) -> str:
  """A copy to resume in (the fixture's workdir is shared, read-only)."""
  dst = str(tmp_path / 'run')
  shutil.copytree(workdir, dst)
  return dst


def config_of(workdir: str, **overrides) -> ml_collections.ConfigDict:
  """A run's config as first saved, with steps left to train, changed."""
  c = ml_collections.ConfigDict(
    workdir_lib.read_json(os.path.join(workdir, 'config.json'))
  )
  c.train.num_steps = 2 * STEPS
  for key, value in overrides.items():
    section, field = key.split('.')
    c[section][field] = value
  return c


def meta_of(workdir: str, step: int) -> dict:
  return checkpoint.read_meta(os.path.join(workdir, 'checkpoints'), step)


def trainer_batch(trainer: train.Trainer, step: int) -> dict:
  """The batch the training loop reads at `step`."""
  return next(trainer._stage_data(step)[0])


def stream_batch(config, tokenizer, index: int) -> dict:
  """Batch `index` of the config's stream, opened at its start."""
  ds = pipeline.train_dataset(
    config, tokenizer, objectives.row_transform(config), start_batch=index
  )
  return next(ds.as_numpy_iterator())


def assert_same_batch(a: dict, b: dict) -> None:
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_checkpoint_meta_records_tokenizer_stream_and_run(trained):
  meta = meta_of(trained, STEPS)
  with open(os.path.join(trained, 'tokenizer.model'), 'rb') as f:
    sha = hashlib.sha256(f.read()).hexdigest()
  assert meta['tokenizer']['sha256'] == sha
  assert meta['tokenizer']['vocab_size'] == 640
  data = meta['data']
  assert data['start_step'] == 0 and meta['batches_consumed'] == STEPS
  fields = data['fields']
  assert fields['data.seq_len'] == 64 and fields['data.batch_size'] == 8
  assert fields['tokenizer.sha256'] == sha
  assert fields['objective.mask_rate'] == 0.15
  assert fields['data.source'].startswith('1 file(s), ')
  # Eval-only and loss-only fields do not decide the training batches.
  assert 'data.eval_batches' not in fields
  assert 'objective.disc_weight' not in fields
  assert 'objective.cross_entropy' not in fields
  run = meta['run']
  assert run['config'] == workdir_lib.read_json(f'{trained}/config.json')
  assert run['versions']['jax'] == jax.__version__
  assert run['git_commit'] == workdir_lib.git_commit()
  assert run['mesh'] == {'data': 8, 'fsdp': 1, 'tensor': 1}
  assert run['process_count'] == 1 and run['device_count'] == 8
  assert run['device_kind'] and run['saved'].endswith('Z')


def test_fingerprint_follows_the_stream_not_paths_or_eval(trained, tmp_path):
  tok = tokenizer_lib.load_tokenizer(f'{trained}/tokenizer.model')
  c = config_of(trained)

  def stream(**overrides):
    config = c.copy_and_resolve_references()
    for key, value in overrides.items():
      section, field = key.split('.')
      config[section][field] = value
    return fingerprint.data_stream(config, tok, process_count=1)

  base = stream()
  # The corpus copied elsewhere is the same stream; so are eval-only
  # fields, a longer run and a loss-only weight.
  moved = tmp_path / 'elsewhere' / os.path.basename(c.data.source)
  moved.parent.mkdir()
  shutil.copy(c.data.source, moved)
  # With another source the bundled eval file stands for a hold-out of it
  # (sources.eval_source): the copy keeps an eval file of its own.
  moved_eval = moved.parent / 'test.txt'
  shutil.copy(c.data.eval_source, moved_eval)
  for same in (
    {'data.source': str(moved), 'data.eval_source': str(moved_eval)},
    {'data.eval_batches': 3, 'train.num_steps': 1000},
    {'objective.disc_weight': 1.0, 'objective.cross_entropy': 'fused'},
  ):
    assert stream(**same) == dict(base, source=stream(**same)['source'])
  # A truncated copy, or stages that move with num_steps, are not.
  moved.write_text(moved.read_text()[:-1])
  assert (
    stream(**{'data.source': str(moved)})['fingerprint']
    != (base['fingerprint'])
  )
  schedule = {'data.seq_len_schedule': '0.5:32'}
  a = stream(**schedule)['fields']['data.seq_len_schedule']
  b = stream(**schedule, **{'train.num_steps': 4 * STEPS})
  # [first step, row length, first batch]: the second stage reads on from
  # the first's tokens.
  assert a == [[0, 32, 0], [STEPS, 64, STEPS // 2]]
  assert b['fields']['data.seq_len_schedule'] == [
    [0, 32, 0],
    [2 * STEPS, 64, STEPS],
  ]


WIKI_TEST = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'test.txt')
WIKI_VALID = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')


@pytest.mark.parametrize(
  'change, expected',
  [
    ({'data.seq_len': 32}, 'data.seq_len: 64 -> 32'),
    ({'data.seed': 1}, 'data.seed: 0 -> 1'),
    # Another source with the bundled eval file: that file stands for a
    # hold-out of the new source (sources.eval_source).
    (
      {'data.source': WIKI_TEST, 'data.eval_source': WIKI_VALID},
      "(data.source was '",
    ),
  ],
)
def test_resume_with_a_changed_stream_fails_naming_it(
  trained, tmp_path, change, expected
):
  work = copy_of(trained, tmp_path)
  trainer = train.Trainer(config_of(trained, **change), work)
  with pytest.raises(ValueError) as e:
    trainer.initial_state()
  message = str(e.value)
  field = next(iter(change))
  assert f'{field}: ' in message and expected in message, message
  assert '--config.data.allow_changed=True' in message
  # Nothing else is reported as changed.
  assert message.count(' -> ') == 1, message


def test_allow_changed_starts_new_stream_and_resumes_exactly(trained, tmp_path):
  work = copy_of(trained, tmp_path)
  changed = config_of(trained, **{'data.seed': 1, 'data.allow_changed': True})
  trainer = train.Trainer(changed, work)
  state = trainer.initial_state()
  assert int(state.step) == STEPS and trainer.data_start_step == STEPS
  tok = trainer.tokenizer
  # The step after the resume reads the new stream's first batch.
  assert_same_batch(
    trainer_batch(trainer, STEPS), stream_batch(changed, tok, 0)
  )

  # A checkpoint of the changed run says where its stream began...
  later = state.replace(step=state.step + 2)
  trainer.checkpointer.save(STEPS + 2, later, trainer.checkpoint_meta(later))
  trainer.checkpointer.wait()
  trainer.checkpointer.close()
  meta = meta_of(work, STEPS + 2)
  assert meta['data']['start_step'] == STEPS
  assert meta['batches_consumed'] == 2

  # ...so resuming it (no flag needed now) continues that stream exactly.
  again = train.Trainer(config_of(trained, **{'data.seed': 1}), work)
  assert int(again.initial_state().step) == STEPS + 2
  assert again.data_start_step == STEPS
  assert_same_batch(
    trainer_batch(again, STEPS + 2), stream_batch(changed, tok, 2)
  )
  # And going back to the first stream is a change again (config.json now
  # holds the changed run's config).
  with pytest.raises(ValueError, match='data.seed: 1 -> 0'):
    train.Trainer(config_of(trained), work).initial_state()


def test_tokenizer_hash_is_checked_on_resume_load_and_finetune(
  trained, tmp_path
):
  work = copy_of(trained, tmp_path)
  path = os.path.join(work, 'tokenizer.model')
  # Another tokenizer of the same size and special ids: one piece's score
  # changed (its segmentations can differ, so the ids would mean other text).
  proto = sentencepiece_model_pb2.ModelProto()
  with open(path, 'rb') as f:
    proto.ParseFromString(f.read())
  proto.pieces[100].score += 1.0
  with open(path, 'wb') as f:
    f.write(proto.SerializeToString())
  other = tokenizer_lib.load_tokenizer(path)
  assert other.vocab_size == 640

  trainer = train.Trainer(config_of(trained), work)
  with pytest.raises(ValueError, match='another tokenizer.*sha256'):
    trainer.initial_state()
  with pytest.raises(ValueError, match='another tokenizer.*sha256'):
    pretrain_lm.load(work)
  with pytest.raises(ValueError, match='another tokenizer.*sha256'):
    finetune_trainer.restore_backbone(
      work, None, {}, 'encoder', tokenizer=other
    )

  # A checkpoint from before the hash was stored still loads.
  meta_path = os.path.join(work, 'checkpoints', str(STEPS), 'meta', 'metadata')
  meta = workdir_lib.read_json(meta_path)
  del meta['tokenizer']['sha256']
  workdir_lib.write_json(meta_path, meta)
  assert pretrain_lm.load(work).step == STEPS
