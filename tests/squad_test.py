"""Tests for pretrain_lm.finetune.squad: reading, windows, labels, scoring."""

import collections
import json
import os
import re
import shutil
import string

import ml_collections
import numpy as np
import pytest

from pretrain_lm import configlib
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.finetune import squad

DATA = os.path.join(os.path.dirname(__file__), 'data', 'squad')
WIKITEXT = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')


def _config(version_2=False, **fields):
  defaults = dict(
    name='squad',
    data_dir=DATA,
    version_2=version_2,
    max_query_len=16,
    doc_stride=24,
    n_best=20,
    max_answer_len=30,
    null_score_diff_threshold=0.0,
  )
  defaults.update(fields)
  return ml_collections.ConfigDict(defaults)


@pytest.fixture(scope='module')
def examples():
  return {
    'v1': squad.read(_config(), 'dev'),
    'v2': squad.read(_config(version_2=True), 'dev'),
  }


@pytest.fixture(scope='module')
def tokenizers(examples, tmp_path_factory):
  """A SentencePiece and a char tokenizer, trained on the corpus + fixtures."""
  folder = tmp_path_factory.mktemp('tok')
  with open(WIKITEXT, encoding='utf-8') as f:
    texts = [line for line in f if line.strip()][:1000]
  for example in examples['v1'] + examples['v2']:
    texts += [example['context'], example['question']]
  return {
    'sentencepiece': tokenizer_lib.train_tokenizer(
      texts, str(folder / 'sp.model'), vocab_size=512
    ),
    'char': tokenizer_lib.train_tokenizer(
      texts, str(folder / 'char.model'), vocab_size=1000, model_type='char'
    ),
    'uncased_words': UncasedWordTokenizer(),
  }


class UncasedWordTokenizer:
  """Lower-cased words and punctuation marks, as BERT's basic tokenizer.

  Its decode joins tokens with spaces, so 'Switzerland,' does not decode
  back to itself: squad must fall back to whole-word offsets.
  """

  pad_id, unk_id, cls_id, sep_id = 0, 1, 2, 3

  def __init__(self):
    self.vocab = {}

  def encode(self, text):
    pieces = re.findall(r'\w+|[^\w\s]', text.lower())
    return [self.vocab.setdefault(p, len(self.vocab) + 5) for p in pieces]

  def decode(self, ids):
    pieces = {i: p for p, i in self.vocab.items()}
    return ' '.join(pieces[i] for i in ids if i >= 5)


def test_reads_v1_and_v2_layouts(examples):
  v1, v2 = examples['v1'], examples['v2']
  assert len(v1) == 11 and len(v2) == 8
  first = v1[0]
  assert first['id'] == 'rf1' and first['title'] == 'Rhine_Falls'
  assert first['question'] == 'In which country are the Rhine Falls?'
  assert [a['text'] for a in first['answers']] == [
    'Switzerland',
    'northern Switzerland',
    'Switzerland',
  ]
  for example in v1 + v2:
    for answer in example['answers']:
      start = answer['answer_start']
      text = example['context'][start : start + len(answer['text'])]
      assert text == answer['text']
  assert not any(e['is_impossible'] for e in v1)
  impossible = [e['id'] for e in v2 if e['is_impossible']]
  assert impossible == ['gp3', 'gp4', 'rf9']
  assert all(not e['answers'] for e in v2 if e['is_impossible'])


def test_train_split_drops_answers_not_at_their_start(tmp_path):
  with open(os.path.join(DATA, 'dev-v1.1.json'), encoding='utf-8') as f:
    data = json.load(f)
  data['data'][1]['paragraphs'][0]['qas'][0]['answers'][0]['answer_start'] += 3
  (tmp_path / 'train-v1.1.json').write_text(json.dumps(data))
  config = _config(data_dir=str(tmp_path))
  ids = [e['id'] for e in squad.read(config, 'train')]
  assert len(ids) == 10 and 'mc1' not in ids
  # Dev keeps every question: its golds are scored, not trained on.
  shutil.copy(tmp_path / 'train-v1.1.json', tmp_path / 'dev-v1.1.json')
  assert len(squad.read(config, 'dev')) == 11


def test_missing_file_explains_the_layout(tmp_path):
  with pytest.raises(FileNotFoundError, match=r'dev-v2.0.json not found.*qas'):
    squad.read(_config(version_2=True, data_dir=str(tmp_path)), 'dev')
  with pytest.raises(ValueError, match='train-v1.1.json and dev-v1.1.json'):
    squad.read(_config(data_dir=''), 'dev')
  with pytest.raises(ValueError, match="not 'test'"):
    squad.read(_config(), 'test')


def _reference_is_max_context(doc_spans, cur_span_index, position):
  """run_squad's _check_is_max_context, verbatim but for the span type."""
  best_score = None
  best_span_index = None
  for span_index, doc_span in enumerate(doc_spans):
    start, length = doc_span
    end = start + length - 1
    if position < start:
      continue
    if position > end:
      continue
    num_left_context = position - start
    num_right_context = end - position
    score = min(num_left_context, num_right_context) + 0.01 * length
    if best_score is None or score > best_score:
      best_score = score
      best_span_index = span_index
  return cur_span_index == best_span_index


def _reference_doc_spans(num_tokens, max_tokens_for_doc, doc_stride):
  """run_squad's doc span loop, verbatim."""
  doc_spans = []
  start_offset = 0
  while start_offset < num_tokens:
    length = num_tokens - start_offset
    if length > max_tokens_for_doc:
      length = max_tokens_for_doc
    doc_spans.append((start_offset, length))
    if start_offset + length == num_tokens:
      break
    start_offset += min(length, doc_stride)
  return doc_spans


@pytest.mark.parametrize(
  'num_tokens, max_tokens, stride',
  [
    (1, 5, 2),
    (10, 10, 3),
    (11, 10, 3),
    (100, 17, 5),
    (57, 20, 20),
    (40, 9, 12),
  ],
)
def test_windows_and_max_context_match_run_squad(
  num_tokens, max_tokens, stride
):
  spans = squad.windows(num_tokens, max_tokens, stride)
  reference = _reference_doc_spans(num_tokens, max_tokens, stride)
  assert [(s.start, len(s)) for s in spans] == reference
  best = squad.max_context_windows(spans, num_tokens)
  for w, (start, length) in enumerate(reference):
    for p in range(start, start + length):
      assert (best[p] == w) == _reference_is_max_context(reference, w, p)


def _doc_rows(rows, row):
  """The positions of a row's context tokens."""
  return np.nonzero(rows['token_char_start'][row] >= 0)[0]


def _seq_len(name):
  # Windows wide enough that each answer's first token has its most
  # context in a window holding the whole answer: with narrower ones even
  # perfect logits can miss a long answer (BERT's max-context rule), which
  # depends on how the tokenizer cuts it.
  return {'char': 256, 'sentencepiece': 96}.get(name, 64)


@pytest.mark.parametrize('name', ['sentencepiece', 'char', 'uncased_words'])
@pytest.mark.parametrize('version', ['v1', 'v2'])
def test_rows_windows_and_labels(examples, tokenizers, name, version):
  tokenizer = tokenizers[name]
  seq_len = _seq_len(name)
  config = _config(version_2=version == 'v2', doc_stride=seq_len // 3)
  exs = examples[version]
  rows = squad.featurize(
    exs, tokenizer, config, seq_len=seq_len, family='encoder'
  )
  # The reference: every context in one window.
  whole = squad.featurize(
    exs, tokenizer, config, seq_len=4096, family='encoder'
  )
  np.testing.assert_array_equal(whole['example_index'], np.arange(len(exs)))
  n = len(rows['example_index'])
  for key in ('input_ids', 'input_mask', 'token_type_ids', 'token_char_start'):
    assert rows[key].shape == (n, seq_len) and rows[key].dtype == np.int32
  np.testing.assert_array_equal(
    np.unique(rows['example_index']), np.arange(len(exs))
  )
  assert n > len(exs) + 10  # the long paragraph takes many windows
  labelled = collections.Counter()
  for index, example in enumerate(exs):
    context = example['context']
    query = tokenizer.encode(example['question'])[: config.max_query_len]
    offset = len(query) + 2
    full = _doc_rows(whole, index)
    full_ids = whole['input_ids'][index, full]
    full_begins = whole['token_char_start'][index, full]
    full_ends = whole['token_char_end'][index, full]
    assert (np.diff(full_begins) >= 0).all() and (
      full_ends >= full_begins
    ).all()
    if name != 'uncased_words':
      # The tokens decode to the context (whitespace aside).
      assert tokenizer.decode(full_ids).strip() == ' '.join(context.split())
    first = last = None
    if not example['is_impossible']:
      # The labels are exactly the tokens covering the answer's characters.
      answer = example['answers'][0]
      a_begin = answer['answer_start']
      a_end = a_begin + len(answer['text'])
      covering = np.nonzero(
        (full_ends > a_begin)
        & (full_begins < a_end)
        & (full_ends > full_begins)
      )[0]
      first, last = covering[0], covering[-1]
      assert whole['start_position'][index] == first + offset
      assert whole['end_position'][index] == last + offset
      got = context[full_begins[first] : full_ends[last]]
      if name == 'uncased_words':
        # Whole-word offsets: 'Switzerland,' for 'Switzerland'.
        assert squad.normalize_answer(got) == squad.normalize_answer(
          answer['text']
        )
      else:
        assert got == answer['text']
    windows = squad.windows(len(full), seq_len - offset - 1, config.doc_stride)
    window_rows = np.nonzero(rows['example_index'] == index)[0]
    assert len(window_rows) == len(windows)
    for row, window in zip(window_rows, windows, strict=True):
      length = offset + len(window) + 1
      ids = rows['input_ids'][row]
      assert list(ids[:offset]) == (
        [tokenizer.cls_id] + query + [tokenizer.sep_id]
      )
      assert ids[length - 1] == tokenizer.sep_id
      np.testing.assert_array_equal(ids[offset : length - 1], full_ids[window])
      np.testing.assert_array_equal(
        rows['token_type_ids'][row, :length], np.arange(length) >= offset
      )
      np.testing.assert_array_equal(
        rows['input_mask'][row], np.arange(seq_len) < length
      )
      for key in ('token_char_start', 'token_char_end'):
        np.testing.assert_array_equal(
          rows[key][row, offset : length - 1],
          whole[key][index, full[window]],
        )
      labels = rows['start_position'][row], rows['end_position'][row]
      if first is not None and first in window and last in window:
        assert labels == (
          first - window.start + offset,
          last - window.start + offset,
        )
        labelled[example['id']] += 1
      else:
        assert labels == (0, 0)
  answerable = {e['id'] for e in exs if not e['is_impossible']}
  assert set(labelled) == answerable


def _perfect_logits(rows):
  n, length = rows['input_ids'].shape
  start = np.zeros((n, length), np.float32)
  end = np.zeros((n, length), np.float32)
  start[np.arange(n), rows['start_position']] = 10.0
  end[np.arange(n), rows['end_position']] = 10.0
  return {'start_logits': start, 'end_logits': end}


@pytest.mark.parametrize('name', ['sentencepiece', 'char', 'uncased_words'])
def test_perfect_logits_score_100(examples, tokenizers, name):
  tokenizer = tokenizers[name]
  seq_len = _seq_len(name)
  for version in ('v1', 'v2'):
    config = _config(
      version_2=version == 'v2',
      doc_stride=seq_len // 3,
      # Characters: 'a youth hostel and a restaurant' is 31 tokens.
      max_answer_len=100 if name == 'char' else 30,
    )
    exs = examples[version]
    rows = squad.featurize(
      exs, tokenizer, config, seq_len=seq_len, family='encoder'
    )
    logits = _perfect_logits(rows)
    answers = squad.predict(exs, rows, logits, config)
    for example in exs:
      if example['is_impossible']:
        assert answers[example['id']] == ''
      else:
        first = example['answers'][0]['text']
        assert squad.exact_match_score(answers[example['id']], first)
    got = squad.evaluate(exs, rows, logits, config)
    if version == 'v1':
      assert got == {'exact_match': 100.0, 'f1': 100.0}
    else:
      assert got == {
        'exact': 100.0,
        'f1': 100.0,
        'total': 8.0,
        'HasAns_exact': 100.0,
        'HasAns_f1': 100.0,
        'HasAns_total': 5.0,
        'NoAns_exact': 100.0,
        'NoAns_f1': 100.0,
        'NoAns_total': 3.0,
      }
      # A threshold above every null-score margin answers every question
      # that has a candidate span; give every context token one.
      in_context = (rows['token_char_start'] >= 0).astype(np.float32)
      for key in logits:
        logits[key] += in_context
      assert squad.evaluate(exs, rows, logits, config) == got
      config.null_score_diff_threshold = 1e9
      lenient = squad.predict(exs, rows, logits, config)
      assert all(lenient.values())
      got = squad.score(exs, lenient, version_2=True)
      assert got['HasAns_exact'] == 100.0
      # Each no-answer question now gets the context's first token: 'The'
      # (or 'T' for characters). The official script normalizes 'The' to
      # '', a correct no-answer.
      guesses = {lenient[e['id']] for e in exs if e['is_impossible']}
      assert guesses == {'T' if name == 'char' else 'The'}
      assert got['NoAns_exact'] == (0.0 if name == 'char' else 100.0)


def test_search_respects_length_order_and_max_context(examples, tokenizers):
  tokenizer = tokenizers['sentencepiece']
  example = examples['v1'][1]  # 'How wide are the falls?' in the long text
  config = _config(doc_stride=8, max_answer_len=3, n_best=5)
  rows = squad.featurize(
    [example], tokenizer, config, seq_len=48, family='encoder'
  )
  n, length = rows['input_ids'].shape
  assert n > 3
  # Window 1: a start that is max context there and one that is not.
  row = 1
  doc = _doc_rows(rows, row)
  max_context = rows['token_is_max_context'][row].astype(bool)
  good, bad = doc[max_context[doc]][0], doc[~max_context[doc]][-1]
  start = np.full((n, length), -5.0)
  end = np.full((n, length), -5.0)

  def answer():
    logits = {'start_logits': start, 'end_logits': end}
    return squad.predict([example], rows, logits, config)[example['id']]

  def text(s, e):
    char_start, char_end = rows['token_char_start'], rows['token_char_end']
    return example['context'][char_start[row, s] : char_end[row, e]]

  start[row, bad], end[row, bad] = 9.0, 9.0  # not max context: never
  start[row, good] = 4.0
  end[row, good + 5] = 8.0  # too long: 6 > max_answer_len tokens
  end[row, good - 1] = 7.0  # ends before it starts
  end[row, good + 2] = 1.0  # the best valid end
  assert answer() == text(good, good + 2)
  start[row, 0], end[row, 0] = 20.0, 20.0  # [CLS]: not a v1.1 answer
  assert answer() == text(good, good + 2)
  config.max_answer_len = 6
  assert answer() == text(good, good + 5)


# The official SQuAD v1.1 script's functions (evaluate-v1.1.py), verbatim,
# as the reference for squad's.
def _official_normalize_answer(s):
  def remove_articles(text):
    return re.sub(r'\b(a|an|the)\b', ' ', text)

  def white_space_fix(text):
    return ' '.join(text.split())

  def remove_punc(text):
    exclude = set(string.punctuation)
    return ''.join(ch for ch in text if ch not in exclude)

  def lower(text):
    return text.lower()

  return white_space_fix(remove_articles(remove_punc(lower(s))))


def _official_f1_score(prediction, ground_truth):
  prediction_tokens = _official_normalize_answer(prediction).split()
  ground_truth_tokens = _official_normalize_answer(ground_truth).split()
  common = collections.Counter(prediction_tokens) & collections.Counter(
    ground_truth_tokens
  )
  num_same = sum(common.values())
  if num_same == 0:
    return 0
  precision = 1.0 * num_same / len(prediction_tokens)
  recall = 1.0 * num_same / len(ground_truth_tokens)
  f1 = (2 * precision * recall) / (precision + recall)
  return f1


def test_official_exact_match_and_f1_by_hand():
  em, f1 = squad.exact_match_score, squad.f1_score
  assert em('the Cat.', 'cat')
  assert em('An apple', 'apple') and em('U.S.', 'US')
  assert em("Denver Broncos'", 'denver broncos') and em('1,000', '1000')
  assert em('  the   Rhine  Falls ', 'Rhine Falls')
  assert not em('anthem', 'them') and not em('well known', 'well-known')
  assert f1('the cat sat', 'a cat sat down') == pytest.approx(0.8)
  assert f1('cat cat cat', 'cat') == pytest.approx(0.5)
  assert f1('in 1965', '1965') == pytest.approx(2 / 3)
  assert f1('dog', 'cat') == 0.0
  # No-answer scoring differs: v2.0 counts '' against '' as right.
  assert f1('', '') == 0.0 and f1('', '', version_2=True) == 1.0
  assert f1('the', '', version_2=True) == 1.0
  assert f1('cat', '', version_2=True) == 0.0


def test_f1_matches_the_official_script_on_random_strings():
  rng = np.random.default_rng(0)
  words = ['the', 'a', 'an', 'Cat', 'cat.', 'sat', "dog's", 'mat', ',', '-']
  for _ in range(500):
    pred = ' '.join(rng.choice(words, rng.integers(0, 6)))
    gold = ' '.join(rng.choice(words, rng.integers(1, 6)))
    assert squad.normalize_answer(pred) == _official_normalize_answer(pred)
    assert squad.f1_score(pred, gold) == pytest.approx(
      _official_f1_score(pred, gold)
    )


def test_score_takes_the_best_gold_and_splits_v2(examples):
  v1 = examples['v1'][:3]
  answers = {'rf1': 'northern Switzerland', 'rf2': '150', 'rf3': 'in 1921'}
  got = squad.score(v1, answers, version_2=False)
  # rf1 matches its second gold; rf2 '150' vs '150 metres': F1 2/3;
  # rf3 'in 1921' vs 'in 1965': F1 1/2.
  assert got['exact_match'] == pytest.approx(100 / 3)
  assert got['f1'] == pytest.approx(100 * (1 + 2 / 3 + 1 / 2) / 3)
  v2 = examples['v2'][:4]  # gp1, gp2 answerable; gp3, gp4 not
  answers = {'gp1': 'North Pacific Ocean', 'gp2': '', 'gp3': '', 'gp4': 'x'}
  got = squad.score(v2, answers, version_2=True)
  assert got['exact'] == pytest.approx(50.0)
  assert got['HasAns_exact'] == got['NoAns_exact'] == pytest.approx(50.0)
  assert (got['HasAns_total'], got['NoAns_total']) == (2.0, 2.0)


def test_check_config_fails_fast():
  squad.check_config(_config(seq_len=384))
  with pytest.raises(ValueError, match='task.doc_stride=0 must be >= 1'):
    squad.check_config(_config(doc_stride=0))
  with pytest.raises(ValueError, match='task.seq_len=19 leaves no room'):
    squad.check_config(_config(seq_len=19))
  with pytest.raises(ValueError, match='Set task.data_dir'):
    squad.check_config(_config(data_dir=''))
