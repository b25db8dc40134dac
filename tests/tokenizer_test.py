"""Tests for pretrain_lm.data.tokenizer."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf
from sentencepiece import sentencepiece_model_pb2

from pretrain_lm import configlib
from pretrain_lm.data import tokenizer as tokenizer_lib

CORPUS = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')
VOCAB = 600
SPECIALS = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']


@pytest.fixture(scope='module')
def texts():
  with open(CORPUS, encoding='utf-8') as f:
    lines = [line.strip() for line in f if line.strip()]
  return lines[:300]


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('tokenizers')


@pytest.fixture(scope='module')
def unigram(texts, model_dir):
  return tokenizer_lib.train_tokenizer(
    texts, str(model_dir / 'unigram.model'), vocab_size=VOCAB
  )


@pytest.fixture(scope='module')
def bpe(texts, model_dir):
  return tokenizer_lib.train_tokenizer(
    texts, str(model_dir / 'bpe.model'), vocab_size=VOCAB, model_type='bpe'
  )


def _model_proto(path):
  proto = sentencepiece_model_pb2.ModelProto()
  with open(path, 'rb') as f:
    proto.ParseFromString(f.read())
  return proto


@pytest.mark.parametrize('name', ['unigram', 'bpe'])
def test_special_ids_are_fixed(name, request):
  tok = request.getfixturevalue(name)
  # Read the file with plain SentencePiece, independently of Tokenizer.
  sp = spm.SentencePieceProcessor(model_file=tok.path)
  assert [sp.id_to_piece(i) for i in range(5)] == SPECIALS
  assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (
    0,
    1,
    2,
    3,
    4,
  )
  assert tok.special_ids == {'pad': 0, 'unk': 1, 'cls': 2, 'sep': 3, 'mask': 4}
  assert json.loads(json.dumps(tok.special_ids)) == tok.special_ids
  assert tok.first_normal_id == 5
  assert tok.vocab_size == sp.vocab_size() <= VOCAB


def test_mask_text_encodes_to_mask_id(unigram, bpe):
  for tok in (unigram, bpe):
    ids = tok.encode('the lobster [MASK] blue')
    assert ids.count(tok.mask_id) == 1
    tf_ids = tok.tf_tokenizer().tokenize(['the lobster [MASK] blue'])
    assert tf_ids.to_list()[0] == ids


def test_encode_decode_roundtrip(unigram, texts):
  for text in texts[:20]:
    ids = unigram.encode(text)
    assert all(0 <= i < unigram.vocab_size for i in ids)
    assert unigram.decode(ids) == text
    # [PAD] is skipped.
    assert unigram.decode([0, *ids, 0, 0]) == text


def test_tf_tokenizer_matches_python(unigram, bpe, texts):
  for tok in (unigram, bpe):
    got = tok.tf_tokenizer().tokenize(tf.constant(texts)).to_list()
    want = [tok.encode(t) for t in texts]
    if tok is bpe:
      assert got == want
    else:
      # tensorflow-text bundles an older SentencePiece that breaks exact
      # Viterbi ties differently ('000' -> '00' '0' rather than '0' '00'),
      # so unigram segmentations may differ, but only between equals.
      assert [tok.decode(ids) for ids in got] == texts
      assert [len(ids) for ids in got] == [len(ids) for ids in want]
      assert sum(g == w for g, w in zip(got, want, strict=True)) >= 0.9 * len(
        texts
      )


def test_model_types(unigram, bpe):
  types = sentencepiece_model_pb2.TrainerSpec.ModelType
  assert _model_proto(unigram.path).trainer_spec.model_type == types.UNIGRAM
  assert _model_proto(bpe.path).trainer_spec.model_type == types.BPE


def test_unknown_model_type(texts, tmp_path):
  with pytest.raises(ValueError, match='data.tokenizer_type'):
    tokenizer_lib.train_tokenizer(
      texts, str(tmp_path / 'x.model'), vocab_size=VOCAB, model_type='wp'
    )


def test_training_is_deterministic(texts, unigram, tmp_path):
  again = tokenizer_lib.train_tokenizer(
    texts, str(tmp_path / 'again.model'), vocab_size=VOCAB
  )
  assert again.model_bytes() == unigram.model_bytes()


def test_vocab_too_small_names_field(texts, tmp_path):
  with pytest.raises(ValueError, match='model.vocab_size=10'):
    tokenizer_lib.train_tokenizer(
      texts, str(tmp_path / 'x.model'), vocab_size=10
    )


def test_load_missing_file(tmp_path):
  path = str(tmp_path / 'nope.model')
  with pytest.raises(FileNotFoundError, match='nope.model'):
    tokenizer_lib.load_tokenizer(path)


def test_not_a_model(tmp_path):
  path = tmp_path / 'vocab.txt'
  path.write_text('[PAD]\n[UNK]\n')
  with pytest.raises(ValueError, match='vocab.txt'):
    tokenizer_lib.load_tokenizer(str(path))


def test_mismatching_special_ids(texts, tmp_path):
  # SentencePiece's defaults: <unk>=0, <s>=1, </s>=2, no [MASK].
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(texts[:100]),
    model_writer=model,
    vocab_size=200,
    minloglevel=2,
  )
  path = tmp_path / 'foreign.model'
  path.write_bytes(model.getvalue())
  with pytest.raises(ValueError, match='foreign.model'):
    tokenizer_lib.load_tokenizer(str(path))


def _data_config(source):
  config = configlib.base_config().data
  config.source = str(source)
  config.eval_source = ''
  return config


@pytest.fixture(scope='module')
def small_source(texts, model_dir):
  path = model_dir / 'source.txt'
  path.write_text('\n'.join(texts) + '\n', encoding='utf-8')
  return path


def _train_docs(texts):
  """The training split of `small_source` (every 100th line held out)."""
  return [t for i, t in enumerate(texts) if (i + 1) % 100]


def test_setup_trains_without_tokenizer(small_source, texts, tmp_path):
  config = _data_config(small_source)
  tok = tokenizer_lib.setup_tokenizer(
    config, vocab_size=VOCAB, workdir=str(tmp_path / 'run')
  )
  assert tok.path == str(tmp_path / 'run' / 'tokenizer.model')
  want = tokenizer_lib.train_tokenizer(
    _train_docs(texts), str(tmp_path / 'ref.model'), vocab_size=VOCAB
  )
  assert tok.model_bytes() == want.model_bytes()


def test_setup_respects_type_and_max_docs(small_source, texts, tmp_path):
  config = _data_config(small_source)
  config.tokenizer_type = 'bpe'
  config.tokenizer_max_docs = 50
  tok = tokenizer_lib.setup_tokenizer(
    config, vocab_size=VOCAB, workdir=str(tmp_path / 'run')
  )
  # tokenizer_max_docs training documents, sampled across the source
  # (seeded by data.seed, in stream order: sources.iter_texts).
  rng = np.random.default_rng(config.seed)
  train = _train_docs(texts)
  sample = [train[i] for i in np.sort(rng.choice(len(train), 50, False))]
  want = tokenizer_lib.train_tokenizer(
    sample, str(tmp_path / 'ref.model'), vocab_size=VOCAB, model_type='bpe'
  )
  assert tok.model_bytes() == want.model_bytes()


def test_setup_copies_explicit_tokenizer(small_source, bpe, tmp_path):
  config = _data_config(small_source)
  config.tokenizer = bpe.path
  tok = tokenizer_lib.setup_tokenizer(
    config, vocab_size=VOCAB, workdir=str(tmp_path / 'run')
  )
  assert tok.path == str(tmp_path / 'run' / 'tokenizer.model')
  assert tok.model_bytes() == bpe.model_bytes()


def test_setup_prefers_workdir_tokenizer(small_source, unigram, bpe, tmp_path):
  tf.io.gfile.copy(unigram.path, str(tmp_path / 'tokenizer.model'))
  config = _data_config(small_source)
  config.tokenizer = bpe.path
  for is_chief in (True, False):
    tok = tokenizer_lib.setup_tokenizer(
      config, vocab_size=VOCAB, workdir=str(tmp_path), is_chief=is_chief
    )
    assert tok.model_bytes() == unigram.model_bytes()


def test_setup_non_chief_only_loads(small_source, tmp_path):
  config = _data_config(small_source)
  with pytest.raises(FileNotFoundError, match='tokenizer.model'):
    tokenizer_lib.setup_tokenizer(
      config, vocab_size=VOCAB, workdir=str(tmp_path), is_chief=False
    )
  assert not os.listdir(tmp_path)


def test_setup_tokenizer_larger_than_model(small_source, bpe, tmp_path):
  config = _data_config(small_source)
  config.tokenizer = bpe.path
  with pytest.raises(
    ValueError,
    match=r'model\.vocab_size=100.*bpe\.model|'
    r'bpe\.model.*model\.vocab_size=100',
  ):
    tokenizer_lib.setup_tokenizer(config, vocab_size=100, workdir=str(tmp_path))
  # Nothing was copied into the workdir, so a fixed rerun is not stuck.
  assert not os.path.exists(tmp_path / 'tokenizer.model')


CHAR_TEXTS = [
  'To be, or not to be:\nthat is the question.',
  'Ünïcödé — 漢字\n\n',
]


@pytest.fixture(scope='module')
def char(model_dir):
  return tokenizer_lib.train_tokenizer(
    CHAR_TEXTS,
    str(model_dir / 'char.model'),
    vocab_size=VOCAB,
    model_type='char',
  )


def test_char_vocab_is_specials_then_sorted_characters(char):
  chars = sorted(set(''.join(CHAR_TEXTS)))
  assert '\n' in chars and ' ' in chars
  assert char.chars == tuple(chars)
  assert char.vocab_size == 5 + len(chars)
  assert (char.pad_id, char.unk_id, char.cls_id, char.sep_id, char.mask_id) == (
    0,
    1,
    2,
    3,
    4,
  )
  assert char.first_normal_id == 5
  # Id i + 5 is the i-th character by code point.
  assert char.encode(''.join(chars)) == list(range(5, 5 + len(chars)))
  assert char.encode('be\n') == [5 + chars.index(c) for c in 'be\n']
  # A small JSON file, told apart from a SentencePiece proto by its content.
  with open(char.path, encoding='utf-8') as f:
    assert json.load(f) == {'type': 'char', 'chars': chars}
  for loaded in (
    tokenizer_lib.load_tokenizer(char.path),
    tokenizer_lib.Tokenizer(char.path),
  ):
    assert isinstance(loaded, tokenizer_lib.CharTokenizer)
    assert loaded.chars == char.chars
    assert loaded.model_bytes() == char.model_bytes()
  assert 'vocab_size=' in repr(char)


def test_char_roundtrip_tf_and_unknown(char):
  for text in CHAR_TEXTS:
    ids = char.encode(text)
    assert len(ids) == len(text)
    assert char.decode(ids) == text
    assert char.decode([0, *ids, 0]) == text
  texts = [*CHAR_TEXTS, 'toxic? #', '', 'ç\U0001f600']
  got = char.tf_tokenizer().tokenize(tf.constant(texts))
  assert got.dtype == tf.int32
  assert got.to_list() == [char.encode(t) for t in texts]
  # 'x', '?', '#', 'ç' and the emoji were not in the text.
  known = char.chars
  assert char.encode('toxic? #ç\U0001f600') == [
    5 + known.index(c) if c in known else char.unk_id
    for c in 'toxic? #ç\U0001f600'
  ]
  assert char.encode('x?#ç\U0001f600') == [char.unk_id] * 5
  assert char.decode([char.cls_id, *char.encode('to'), char.sep_id]) == (
    '[CLS]to[SEP]'
  )
  with pytest.raises(ValueError, match='outside'):
    char.decode([char.vocab_size])


def test_not_a_char_tokenizer(tmp_path):
  for content in ('{"type": "char", "chars": ["a", "a"]}', '{"chars": []}'):
    path = tmp_path / 'bad.model'
    path.write_text(content)
    with pytest.raises(ValueError, match='bad.model'):
      tokenizer_lib.load_tokenizer(str(path))


def test_unknown_type_lists_char(texts, tmp_path):
  with pytest.raises(ValueError, match="'char'"):
    tokenizer_lib.train_tokenizer(
      texts, str(tmp_path / 'x.model'), vocab_size=VOCAB, model_type='chars'
    )


def test_setup_char_tokenizer(tmp_path):
  source = tmp_path / 'source.txt'
  source.write_text(''.join(CHAR_TEXTS) + '\nzebra\n', encoding='utf-8')
  config = _data_config(f'{source}[:90%]')
  config.doc_format = 'file'
  config.tokenizer_type = 'char'
  workdir = str(tmp_path / 'run')
  tok = tokenizer_lib.setup_tokenizer(config, vocab_size=VOCAB, workdir=workdir)
  assert isinstance(tok, tokenizer_lib.CharTokenizer)
  assert tok.path == os.path.join(workdir, tokenizer_lib.WORKDIR_FILENAME)
  # Trained on the training documents only: the slice's characters.
  text = source.read_text(encoding='utf-8')
  assert tok.chars == tuple(sorted(set(text[: int(len(text) * 0.9)])))
  # Resumes from the workdir's file, even when the text has changed.
  source.write_text('other text\n')
  again = tokenizer_lib.setup_tokenizer(
    config, vocab_size=VOCAB, workdir=workdir, is_chief=False
  )
  assert again.model_bytes() == tok.model_bytes()
  # An explicit data.tokenizer is copied in.
  config.tokenizer = tok.path
  copied = tokenizer_lib.setup_tokenizer(
    config, vocab_size=VOCAB, workdir=str(tmp_path / 'run2')
  )
  assert copied.model_bytes() == tok.model_bytes()
  # The model's embedding table may be larger, not smaller.
  with pytest.raises(
    ValueError, match=f'model.vocab_size={tok.vocab_size - 1}'
  ):
    tokenizer_lib.setup_tokenizer(
      config, vocab_size=tok.vocab_size - 1, workdir=workdir
    )


def test_char_vocab_larger_than_model(tmp_path):
  source = tmp_path / 'source.txt'
  source.write_text('abcdefghij\n')
  config = _data_config(source)
  config.eval_holdout_every = 2
  config.tokenizer_type = 'char'
  with pytest.raises(ValueError, match=r'model\.vocab_size=12.*15'):
    tokenizer_lib.setup_tokenizer(config, vocab_size=12, workdir=str(tmp_path))
  # Nothing was written, so a rerun with a larger table trains afresh.
  assert not os.path.exists(tmp_path / 'tokenizer.model')
  tok = tokenizer_lib.setup_tokenizer(
    config, vocab_size=15, workdir=str(tmp_path)
  )
  assert tok.vocab_size == 15


def test_package_imports_nothing_above_data():
  """The tokenizers load without the converters, models or checkpointing.

  convert/ imports the tokenizers (for the Hugging Face files), never the
  other way round.
  """
  code = (
    'import json, sys, pretrain_lm.data.tokenizer; '
    'print(json.dumps([m for m in sys.modules if "pretrain_lm." in m]))'
  )
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=True
  )
  loaded = json.loads(out.stdout.strip().splitlines()[-1])
  above = ('convert', 'models', 'objectives', 'checkpoint', 'training')
  assert 'pretrain_lm.data.tokenizer.workdir' in loaded
  assert [m for m in loaded if m.split('.')[1] in above] == []
