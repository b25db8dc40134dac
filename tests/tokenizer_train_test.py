"""Tests for training WordPiece and byte-level BPE tokenizers.

pretrain_lm.data.tokenizer trains them with the Hugging Face tokenizers
library; each is checked against transformers' tokenizers loaded from the
files it exports, on held-out WikiText lines and edge cases.
"""

import os

import numpy as np
import pytest
import tensorflow as tf
import transformers

from pretrain_lm import configlib, objectives, validate
from pretrain_lm.convert import tokenizer as hf_tokenizer
from pretrain_lm.data import pipeline
from pretrain_lm.data import tokenizer as tokenizer_lib

CORPUS = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')
VOCAB = 1000
# Special ids every tokenizer this project trains has.
FIXED_IDS = {'pad': 0, 'unk': 1, 'cls': 2, 'sep': 3, 'mask': 4}
# Agreed on by this module and transformers (no Greek capital sigma:
# Hugging Face's lower-casing ignores final sigma).
WORDPIECE_CASES = [
  'Héllo Wörld! Ça va? naïve café, résumé; ÅNGSTRÖM.',
  '北京欢迎你 and 東京タワー',
  "don't stop-believing... (really) $5.00 #hash 50% a/b",
  'zero\u200bwidth, tab\tnew\nline\r end, no\u00a0break',
  'x' * 101 + ' ok',
  'The capital of France is [MASK].',
  'emoji 😀 and symbols ½ ² ™ ©',
  '  leading and   trailing  ',
  '',
]
BPE_CASES = [
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


def _lines(start, stop):
  with open(CORPUS, encoding='utf-8') as f:
    lines = [line.strip() for line in f if line.strip()]
  return lines[start:stop]


@pytest.fixture(scope='module')
def train_texts():
  return _lines(0, 600)


@pytest.fixture(scope='module')
def held_out():
  # Hugging Face matches every special token's text in the input, this
  # module only the mask token's: keep wikitext's '<unk>' out of the way.
  return [t.replace('<unk>', 'unk') for t in _lines(600, 800)]


def _train(texts, path, kind, vocab_size=VOCAB):
  return tokenizer_lib.train_tokenizer(
    texts, str(path), vocab_size=vocab_size, model_type=kind
  )


@pytest.fixture(scope='module')
def trained(train_texts, tmp_path_factory):
  """The WordPiece and byte-level BPE tokenizers of the training lines."""
  directory = tmp_path_factory.mktemp('trained')
  return {
    kind: _train(train_texts, directory / f'{kind}.model', kind)
    for kind in ('wordpiece', 'byte_bpe')
  }


# transformers' pure-Python BERT tokenizer: BertTokenizer itself before
# version 5, which made it the tokenizers-backed one.
PYTHON_BERT = getattr(
  transformers, 'BertTokenizerLegacy', transformers.BertTokenizer
)


def _ids(reference, texts):
  return [reference(t, add_special_tokens=False)['input_ids'] for t in texts]


def _export_and_import(tok, tmp_path):
  """(the exported directory, the tokenizer imported back from it)."""
  out = tmp_path / 'hf'
  hf_tokenizer.export_hf_tokenizer(tok, str(out))
  back = hf_tokenizer.import_hf_tokenizer(str(out), str(tmp_path / 'back'))
  # Exporting the imported tokenizer writes the same files.
  hf_tokenizer.export_hf_tokenizer(back, str(tmp_path / 'hf2'))
  for name in os.listdir(out):
    assert (out / name).read_bytes() == (tmp_path / 'hf2' / name).read_bytes()
  return out, back


def test_wordpiece_matches_transformers(trained, held_out, tmp_path):
  tok = trained['wordpiece']
  assert isinstance(tok, tokenizer_lib.WordPieceTokenizer)
  assert tok.vocab_size == VOCAB
  assert tok.special_ids == FIXED_IDS
  assert tok.vocab[:5] == ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
  assert tok.do_lower_case and tok.strip_accents
  assert any(t.startswith('##') and len(t) > 3 for t in tok.vocab)
  out, back = _export_and_import(tok, tmp_path)
  assert isinstance(back, tokenizer_lib.WordPieceTokenizer)
  assert back.vocab == tok.vocab and back.special_ids == tok.special_ids
  texts = held_out + WORDPIECE_CASES
  want = [tok.encode(t) for t in texts]
  assert [back.encode(t) for t in texts] == want
  assert tok.tf_tokenizer().tokenize(tf.constant(texts)).to_list() == want
  fast = transformers.AutoTokenizer.from_pretrained(str(out))
  assert isinstance(fast, transformers.BertTokenizerFast)
  slow = PYTHON_BERT.from_pretrained(str(out))
  for reference in (fast, slow):
    got = _ids(reference, texts)
    for text, g, w in zip(texts, got, want, strict=True):
      assert g == w, text
    # [CLS] text [SEP], and the mask at its fixed id.
    assert reference('a b')['input_ids'] == [2, *tok.encode('a b'), 3]
    assert reference.mask_token_id == tok.mask_id == 4
    assert reference.pad_token_id == tok.pad_id == 0


def test_byte_bpe_matches_transformers(trained, held_out, tmp_path):
  tok = trained['byte_bpe']
  assert isinstance(tok, tokenizer_lib.ByteBpeTokenizer)
  assert tok.vocab_size == VOCAB
  assert tok.special_ids == FIXED_IDS
  assert tok.vocab[:5] == ['<pad>', '<unk>', '<s>', '</s>', '<mask>']
  assert tok.first_normal_id == 5
  # Every byte is a token, so no text needs <unk>.
  assert set(tokenizer_lib.bytes_to_unicode().values()) <= set(tok.vocab)
  out, back = _export_and_import(tok, tmp_path)
  assert isinstance(back, tokenizer_lib.ByteBpeTokenizer)
  assert back.vocab == tok.vocab and back.merges == tok.merges
  assert back.special_ids == tok.special_ids
  texts = held_out + BPE_CASES
  want = [tok.encode(t) for t in texts]
  assert [back.encode(t) for t in texts] == want
  assert tok.tf_tokenizer().tokenize(tf.constant(texts)).to_list() == want
  roberta = transformers.AutoTokenizer.from_pretrained(str(out))
  assert isinstance(roberta, transformers.RobertaTokenizerFast)
  gpt2 = transformers.GPT2TokenizerFast.from_pretrained(str(out))
  for reference in (roberta, gpt2):
    got = _ids(reference, texts)
    for text, g, w in zip(texts, got, want, strict=True):
      assert g == w, (type(reference).__name__, text)
  # <s> text </s>, and the mask taking the space before it (lstrip).
  assert roberta('a b')['input_ids'] == [2, *tok.encode('a b'), 3]
  masked = 'The capital of France is <mask>. Or <mask>'
  assert tok.encode(masked) == _ids(roberta, [masked])[0]
  assert tok.encode(masked).count(tok.mask_id) == 2
  assert roberta.pad_token_id == tok.pad_id == 0


def test_byte_bpe_round_trips_any_text(trained):
  tok = trained['byte_bpe']
  rng = np.random.default_rng(0)
  # Code points from every plane in use, surrogates (not text) left out.
  points = np.concatenate(
    [
      np.arange(0, 0xD800),
      np.arange(0xE000, 0x30000),
      np.arange(0xE0000, 0xE0080),
    ]
  )
  random_texts = [
    ''.join(map(chr, rng.choice(points, rng.integers(1, 40))))
    for _ in range(200)
  ]
  texts = [
    *BPE_CASES,
    '<s> and </s> and <pad> and <unk> are text here',
    'family 👨‍👩‍👧‍👦, skin 👍🏽, combining e\u0301 and a\u0308',
    'RTL עברית العربية mixed with LTR',
    'controls \x00\x01\x1f\x7f and \r\n line ends \u2028 \ufeff',
    'private use \ue000 \U000f0000 and tags \U000e0041',
    *random_texts,
  ]
  for text in texts:
    ids = tok.encode(text)
    assert tok.decode(ids) == text, repr(text)
    assert tok.pad_id not in ids and tok.unk_id not in ids


@pytest.mark.parametrize('kind', ['wordpiece', 'byte_bpe'])
@pytest.mark.parametrize('vocab_size', [400, 700])
def test_vocab_size_is_what_was_asked(kind, vocab_size, train_texts, tmp_path):
  tok = _train(train_texts, tmp_path / 'tok.model', kind, vocab_size)
  assert tok.vocab_size == vocab_size


@pytest.mark.parametrize('kind', ['wordpiece', 'byte_bpe'])
def test_vocab_too_small_fails_before_writing(kind, train_texts, tmp_path):
  path = tmp_path / 'tok.model'
  # Byte-level BPE starts with 5 specials + 256 bytes; WordPiece with the
  # specials and this text's characters and '##' continuations.
  with pytest.raises(ValueError, match=r'vocab_size=100.*model\.vocab_size'):
    _train(train_texts, path, kind, vocab_size=100)
  assert not path.exists()


@pytest.mark.parametrize('kind', ['wordpiece', 'byte_bpe'])
def test_training_is_deterministic(kind, trained, train_texts, tmp_path):
  # The tokenizers library's own WordPiece trainer learns a different
  # vocabulary on most runs (huggingface/tokenizers#1794); ours must not.
  for i in range(3):
    again = _train(train_texts, tmp_path / f'{i}.model', kind)
    assert again.model_bytes() == trained[kind].model_bytes()


def test_cased_wordpiece(train_texts, tmp_path):
  tok = tokenizer_lib.train_tokenizer(
    train_texts,
    str(tmp_path / 'cased.model'),
    vocab_size=VOCAB,
    model_type='wordpiece',
    lowercase=False,
  )
  assert not tok.do_lower_case and not tok.strip_accents
  assert 'The' in tok.vocab
  out, _ = _export_and_import(tok, tmp_path)
  reference = transformers.AutoTokenizer.from_pretrained(str(out))
  texts = _lines(600, 700) + WORDPIECE_CASES
  assert _ids(reference, texts) == [tok.encode(t) for t in texts]


def _is_within(part, whole):
  """Whether the list `part` occurs in `whole` as a contiguous run."""
  n = len(part)
  return any(whole[i : i + n] == part for i in range(len(whole) - n + 1))


def test_bert_preset_trains_wordpiece_into_workdir_for_the_pipeline(
  train_texts, tmp_path
):
  source = tmp_path / 'train.txt'
  docs = train_texts[:100]
  source.write_text('\n'.join(docs) + '\n', encoding='utf-8')
  config = configlib.load_file('configs/bert.py:size=tiny')
  config.data.tokenizer_type = 'wordpiece'
  config.data.source = config.data.eval_source = str(source)
  config.model.vocab_size = 800
  config.data.update(seq_len=32, batch_size=4, eval_batches=2)
  validate.check_config(config)
  workdir = tmp_path / 'run'
  tok = tokenizer_lib.setup_tokenizer(
    config.data, vocab_size=config.model.vocab_size, workdir=str(workdir)
  )
  assert tok.path == str(workdir / tokenizer_lib.WORKDIR_FILENAME)
  assert isinstance(tokenizer_lib.load_tokenizer(tok.path), type(tok))
  # data.eval_source is set, so every document trains the tokenizer.
  want = _train(docs, tmp_path / 'want.model', 'wordpiece', 800)
  assert tok.model_bytes() == want.model_bytes()
  # The tf.data pipeline tokenizes with it: unmasked, a row is [CLS] then
  # runs of documents' WordPiece ids, each ended by [SEP], then padding.
  encoded = [tok.encode(d) for d in docs]
  runs = 0
  for batch in pipeline.eval_batches(
    config, tok, objectives.row_transform(config)
  ):
    ids = batch['input_ids'].copy()
    assert (ids == tok.mask_id).any()
    for b in range(len(ids)):
      real = batch['masked_weights'][b] > 0
      ids[b, batch['masked_positions'][b, real]] = batch['masked_ids'][b, real]
    for row in ids.tolist():
      body = [i for i in row if i != tok.pad_id]
      assert body[0] == tok.cls_id and body[-1] == tok.sep_id
      run = []
      for i in body[1:]:
        if i != tok.sep_id:
          run.append(i)
          continue
        assert any(_is_within(run, e) for e in encoded), run
        runs += 1
        run = []
  assert runs >= 8


def test_bad_tokenizer_type_names_the_field_and_the_choices():
  config = configlib.load_file('configs/roberta.py:size=tiny')
  config.data.tokenizer_type = 'bytebpe'
  with pytest.raises(ValueError, match='data.tokenizer_type=.bytebpe.') as e:
    validate.check_config(config)
  assert "'wordpiece', 'byte_bpe'" in str(e.value)
  with pytest.raises(ValueError, match="data.tokenizer_type='bytebpe'"):
    tokenizer_lib.train_tokenizer(
      ['text'], 'unused.model', vocab_size=VOCAB, model_type='bytebpe'
    )
