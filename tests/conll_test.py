"""Tests for pretrain_lm.finetune.conll: reading, rows, conlleval scores."""

import os

import ml_collections
import numpy as np
import pytest

from pretrain_lm import configlib
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.finetune import conll

DATA = os.path.join(os.path.dirname(__file__), 'data', 'conll')
WIKITEXT = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')
CHUNK_TAGS = ('O', 'B-NP', 'I-NP', 'B-VP', 'I-VP', 'B-PP', 'B-SBAR', 'B-ADVP')


def _config(**fields):
  defaults = dict(name='conll', data_dir=DATA, label_column=-1, tag_scheme='')
  defaults.update(fields)
  return ml_collections.ConfigDict(defaults)


@pytest.fixture(scope='module')
def sentences():
  return {split: conll.read(_config(), split) for split in ('train', 'dev')}


@pytest.fixture(scope='module')
def tokenizer(sentences, tmp_path_factory):
  with open(WIKITEXT, encoding='utf-8') as f:
    texts = [line for line in f if line.strip()][:500]
  texts += [
    ' '.join(s['tokens']) for s in sentences['train'] + sentences['dev']
  ]
  path = str(tmp_path_factory.mktemp('tok') / 'tokenizer.model')
  return tokenizer_lib.train_tokenizer(texts, path, vocab_size=512)


def test_reads_sentences_and_skips_docstart(sentences):
  train = sentences['train']
  assert [len(s['tokens']) for s in train] == [8, 2, 21, 8, 15]
  assert [s['guid'] for s in train] == [f'train-{i}' for i in range(5)]
  assert train[1] == {
    'tokens': ['ZURICH', '1996-08-22'],
    'labels': ['I-LOC', 'O'],
    'guid': 'train-1',
  }
  # CoNLL-2003's own files are IOB1: B- only between two adjacent chunks.
  assert train[2]['labels'][12:14] == ['I-MISC', 'B-MISC']
  assert len(sentences['dev']) == 2
  assert conll.num_labels(_config()) == 9
  assert conll.head(_config()) == 'token'
  assert conll.metric_name(_config()) == 'f1'


def test_other_columns_and_eng_file_names(tmp_path):
  with open(os.path.join(DATA, 'train.txt'), encoding='utf-8') as f:
    (tmp_path / 'eng.train').write_text(f.read())
  config = _config(data_dir=str(tmp_path), label_column=2, labels=CHUNK_TAGS)
  train = conll.read(config, 'train')
  assert train[0]['labels'][:4] == ['B-NP', 'I-NP', 'I-NP', 'B-VP']
  assert conll.num_labels(config) == len(CHUNK_TAGS)


def test_bad_files_and_tags_raise(tmp_path):
  with pytest.raises(FileNotFoundError, match='No valid.txt or dev.txt'):
    conll.read(_config(data_dir=str(tmp_path)), 'dev')
  with pytest.raises(
    ValueError, match=r"tags \['B-NP', 'B-PP', 'B-VP', 'I-NP'\] outside"
  ):
    conll.read(_config(label_column=2), 'train')
  (tmp_path / 'valid.txt').write_text('EU NNP\nrejects VBZ O\n')
  with pytest.raises(ValueError, match='valid.txt:1: 2 columns'):
    conll.read(_config(data_dir=str(tmp_path), label_column=3), 'dev')
  with pytest.raises(ValueError, match="tag_scheme='bio'"):
    conll.read(_config(tag_scheme='bio'), 'dev')


def test_tag_schemes_convert_both_ways(sentences):
  iob1 = ['I-PER', 'I-PER', 'B-PER', 'O', 'I-LOC', 'I-ORG', 'B-ORG', 'I-ORG']
  iob2 = ['B-PER', 'I-PER', 'B-PER', 'O', 'B-LOC', 'B-ORG', 'B-ORG', 'I-ORG']
  assert conll.iob1_to_iob2(iob1) == iob2
  assert conll.iob2_to_iob1(iob2) == iob1
  assert conll.iob1_to_iob2(iob2) == iob2  # IOB2 input is left as it is
  converted = conll.read(_config(tag_scheme='iob2'), 'train')
  assert converted[2]['labels'][:2] == ['B-PER', 'I-PER']
  assert converted[2]['labels'][12:14] == ['B-MISC', 'B-MISC']
  # Both schemes name the same chunks: conlleval scores one against the
  # other as perfect.
  gold = [s['labels'] for s in sentences['train']]
  scores = conll.conlleval(gold, [s['labels'] for s in converted])
  assert scores['f1'] == 100.0 and scores['found_correct'] == 13.0
  assert scores['accuracy'] < 100.0  # the tags themselves differ


def test_conlleval_by_hand():
  # Gold chunks PER(0-1), LOC(3), ORG(5-6); guessed PER(0-1), LOC(3) (an
  # I- after O starts a chunk), ORG(5), ORG(6) (B- after B- starts one).
  gold = [['B-PER', 'I-PER', 'O', 'B-LOC', 'O', 'B-ORG', 'I-ORG']]
  guess = [['B-PER', 'I-PER', 'O', 'I-LOC', 'O', 'B-ORG', 'B-ORG']]
  got = conll.conlleval(gold, guess)
  f1 = 2 * 50 * (200 / 3) / (50 + 200 / 3)
  assert got == pytest.approx(
    {
      'precision': 50.0,
      'recall': 200 / 3,
      'f1': f1,
      'accuracy': 500 / 7,
      'correct_chunks': 2.0,
      'found_guessed': 4.0,
      'found_correct': 3.0,
      'LOC_precision': 100.0,
      'LOC_recall': 100.0,
      'LOC_f1': 100.0,
      'ORG_precision': 0.0,
      'ORG_recall': 0.0,
      'ORG_f1': 0.0,
      'PER_precision': 100.0,
      'PER_recall': 100.0,
      'PER_f1': 100.0,
    }
  )


@pytest.mark.parametrize(
  'gold, guess, counts',
  [
    # A type change inside an I- run starts a new chunk.
    ([['I-PER', 'I-LOC']], [['I-PER', 'I-LOC']], (2, 2, 2)),
    ([['I-PER', 'I-PER']], [['I-PER', 'I-LOC']], (0, 2, 1)),
    # IOB1's B- between two chunks of one type.
    ([['I-PER', 'I-PER']], [['I-PER', 'B-PER']], (0, 2, 1)),
    ([['I-PER', 'B-PER']], [['B-PER', 'B-PER']], (2, 2, 2)),
    # A sentence boundary ends a chunk: two chunks, not one.
    ([['I-PER'], ['I-PER']], [['I-PER'], ['I-PER']], (2, 2, 2)),
    # Chunks that end at different tokens are wrong.
    ([['B-PER', 'I-PER', 'O']], [['B-PER', 'O', 'O']], (0, 1, 1)),
    ([['B-PER', 'O']], [['B-PER', 'I-PER']], (0, 1, 1)),
    # An I- of another type right after a chunk starts a new one.
    ([['B-LOC', 'I-ORG']], [['B-LOC', 'B-ORG']], (2, 2, 2)),
    # Types may hold hyphens (conlleval's 2004-01-26 change).
    ([['B-GEO-LOC', 'I-GEO-LOC']], [['B-GEO-LOC', 'I-GEO-LOC']], (1, 1, 1)),
    # No chunks at all: scores are 0, not an error.
    ([['O', 'O']], [['O', 'O']], (0, 0, 0)),
  ],
)
def test_conlleval_documented_cases(gold, guess, counts):
  got = conll.conlleval(gold, guess)
  assert (
    got['correct_chunks'],
    got['found_guessed'],
    got['found_correct'],
  ) == counts


def _chunks(sentences):
  """(sentence, first, last, type) of each chunk of B/I/O tag sequences.

  Written from the definition, not from conlleval's streaming rules: a
  chunk begins at B-, or at I- unless it continues a chunk of its type; it
  ends before O, before a beginning, and at the sentence end.
  """
  out = set()
  for s, tags in enumerate(sentences):
    start, kind = None, None
    for i, tag in enumerate([*tags, 'O']):
      prefix, _, tag_type = tag.partition('-')
      begins = prefix == 'B' or (
        prefix == 'I' and (start is None or tag_type != kind)
      )
      if start is not None and (prefix == 'O' or begins):
        out.add((s, start, i - 1, kind))
        start = None
      if begins:
        start, kind = i, tag_type
  return out


@pytest.mark.parametrize('seed', range(20))
def test_conlleval_matches_chunk_sets_on_random_tags(seed):
  rng = np.random.default_rng(seed)
  tags = ['O', 'O', 'B-PER', 'I-PER', 'B-LOC', 'I-LOC', 'I-MISC']
  gold, guess = [], []
  for _ in range(rng.integers(1, 8)):
    n = int(rng.integers(1, 10))
    gold.append(list(rng.choice(tags, n)))
    # Guesses agree with gold most of the time, as a tagger's would.
    noise = list(rng.choice(tags, n))
    guess.append(
      [
        g if rng.random() < 0.7 else x
        for g, x in zip(gold[-1], noise, strict=True)
      ]
    )
  want_gold, want_guess = _chunks(gold), _chunks(guess)
  correct = len(want_gold & want_guess)
  got = conll.conlleval(gold, guess)
  assert (
    got['correct_chunks'],
    got['found_guessed'],
    got['found_correct'],
  ) == (
    correct,
    len(want_guess),
    len(want_gold),
  )
  precision = 100 * correct / len(want_guess) if want_guess else 0.0
  recall = 100 * correct / len(want_gold) if want_gold else 0.0
  assert got['precision'] == pytest.approx(precision)
  assert got['recall'] == pytest.approx(recall)
  pairs = [
    (a, b)
    for g, p in zip(gold, guess, strict=True)
    for a, b in zip(g, p, strict=True)
  ]
  assert got['accuracy'] == pytest.approx(
    100 * np.mean([a == b for a, b in pairs])
  )


@pytest.mark.parametrize('family', ['encoder', 'decoder'])
def test_rows_label_the_first_sub_token(sentences, tokenizer, family):
  examples = sentences['train'] + sentences['dev']
  config = _config()
  rows = conll.featurize(
    examples, tokenizer, config, seq_len=128, family=family
  )
  n = len(examples)
  for key in ('input_ids', 'input_mask', 'token_labels', 'word_index'):
    assert rows[key].shape == (n, 128) and rows[key].dtype == np.int32
  assert not rows['token_type_ids'].any()
  has_cls = family != 'decoder'
  names = conll.labels(config)
  split_words = 0
  for i, example in enumerate(examples):
    ids = list(rows['input_ids'][i])
    length = int(rows['input_mask'][i].sum())
    assert (ids[0] == tokenizer.cls_id) == has_cls
    assert ids[length - 1] == tokenizer.sep_id
    firsts = np.nonzero(rows['word_index'][i] >= 0)[0]
    np.testing.assert_array_equal(
      rows['word_index'][i, firsts], np.arange(len(example['tokens']))
    )
    np.testing.assert_array_equal(
      firsts, np.nonzero(rows['token_labels'][i] >= 0)[0]
    )
    assert [names[t] for t in rows['token_labels'][i, firsts]] == example[
      'labels'
    ]
    # Each word's pieces run from its first sub-token to the next word's.
    bounds = [*firsts, length - 1]
    for w, word in enumerate(example['tokens']):
      pieces = ids[bounds[w] : bounds[w + 1]]
      assert tokenizer.decode(pieces).strip() == word
      split_words += len(pieces) > 1
    assert tokenizer.decode(ids[has_cls : length - 1]) == ' '.join(
      example['tokens']
    )
  assert split_words > 10  # the test covers non-first sub-tokens


def _perfect_logits(rows, num_labels):
  logits = np.zeros((*rows['token_labels'].shape, num_labels), np.float32)
  rows_, positions = np.nonzero(rows['token_labels'] >= 0)
  logits[rows_, positions, rows['token_labels'][rows_, positions]] = 5.0
  return {'token_logits': logits}


def test_evaluate_from_token_logits(sentences, tokenizer):
  config = _config()
  examples = sentences['train']
  rows = conll.featurize(
    examples, tokenizer, config, seq_len=128, family='encoder'
  )
  logits = _perfect_logits(rows, conll.num_labels(config))
  got = conll.evaluate(examples, rows, logits, config)
  assert (got['f1'], got['accuracy'], got['found_correct']) == (100, 100, 13)
  # Guess 'Keller' as B-ORG and 'German' as I-MISC (merging it into
  # 'Dutch'); the scores are conlleval's on those tags.
  names = list(conll.labels(config))
  guess = [list(e['labels']) for e in examples]
  for word, tag in ((1, 'B-ORG'), (13, 'I-MISC')):
    row, position = 2, np.nonzero(rows['word_index'][2] == word)[0][0]
    logits['token_logits'][row, position, names.index(tag)] = 9.0
    guess[2][word] = tag
  want = conll.conlleval([e['labels'] for e in examples], guess)
  assert want['f1'] < 100
  assert conll.evaluate(examples, rows, logits, config) == want


def test_words_past_seq_len_are_predicted_o(sentences, tokenizer):
  config = _config()
  examples = sentences['train']
  rows = conll.featurize(
    examples, tokenizer, config, seq_len=12, family='encoder'
  )
  logits = _perfect_logits(rows, conll.num_labels(config))
  tags = conll.predicted_tags(examples, rows, logits, config)
  for example, row_tags, words in zip(
    examples, tags, rows['word_index'], strict=True
  ):
    kept = int((words >= 0).sum())
    assert kept < len(example['tokens']) or len(example['tokens']) <= 10
    assert row_tags[:kept] == example['labels'][:kept]
    assert row_tags[kept:] == ['O'] * (len(example['tokens']) - kept)


def test_check_config_fails_fast():
  conll.check_config(_config())
  with pytest.raises(ValueError, match="tag_scheme='bio'"):
    conll.check_config(_config(tag_scheme='bio'))
  with pytest.raises(ValueError, match='duplicates'):
    conll.check_config(_config(labels=('O', 'B-X', 'O')))
  with pytest.raises(ValueError, match='Set task.data_dir'):
    conll.check_config(_config(data_dir=''))
