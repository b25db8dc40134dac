"""Tests for pretrain_lm.finetune.glue: GLUE TSV reading, rows, metrics."""

import os

import ml_collections
import numpy as np
import pytest
import scipy.stats
from sklearn import metrics as sk

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.finetune import glue

SHARED_SST2 = os.path.join(
  os.path.dirname(__file__), '..', '..', 'shared', 'data', 'sst2'
)


def _config(task, data_dir='', **fields):
  return ml_collections.ConfigDict(
    dict(name='glue', glue_task=task, data_dir=data_dir, **fields)
  )


@pytest.fixture(scope='module')
def sst2():
  config = _config('sst2')
  return {split: glue.read(config, split) for split in ('train', 'dev')}


@pytest.fixture(scope='module')
def tokenizer(sst2, tmp_path_factory):
  path = str(tmp_path_factory.mktemp('tok') / 'tokenizer.model')
  texts = [e['text_a'] for e in sst2['train'] + sst2['dev']]
  return tokenizer_lib.train_tokenizer(texts, path, vocab_size=512)


def _tsv_rows(path):
  """The file's tab-split lines, header included: the independent reading."""
  with open(path, encoding='utf-8') as f:
    return [line.rstrip('\n').split('\t') for line in f]


def test_reads_the_bundled_sst2_by_header_name(sst2):
  # train.tsv is 'label<TAB>sentence', dev.tsv 'label<TAB>content': GLUE's
  # column order reversed, read by name.
  for split, file in (('train', 'train.tsv'), ('dev', 'dev.tsv')):
    rows = _tsv_rows(os.path.join(glue.BUNDLED_SST2, file))
    assert rows[0][1] in ('sentence', 'content')
    got = sst2[split]
    assert len(got) == len(rows) - 1
    assert [e['text_a'] for e in got] == [r[1] for r in rows[1:]]
    assert [e['label'] for e in got] == [int(r[0]) for r in rows[1:]]
    assert {e['text_b'] for e in got} == {None}
  assert sst2['train'][0]['text_a'] == (
    'hide new secretions from the parental units'
  )
  assert len(sst2['dev']) == 872


@pytest.mark.skipif(
  not os.path.isdir(SHARED_SST2), reason='no ../shared/data/sst2'
)
def test_reads_the_shared_sst2_directly():
  config = _config('sst2', SHARED_SST2)
  train = glue.read(config, 'train')
  assert len(train) == 67349
  assert {e['label'] for e in train} == {0, 1}
  dev = glue.read(config, 'dev')
  assert dev == glue.read(_config('sst2'), 'dev')


# One small file per task in the layout GLUE's download script writes,
# with lines taken from (or shaped like) the real files.
MNLI_HEADER = (
  'index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t'
  'sentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\t'
  'sentence2\tlabel1\tgold_label'
)
MNLI_DEV_HEADER = MNLI_HEADER.replace(
  'label1\tgold_label', 'label1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label'
)
LAYOUTS = {
  'cola': {
    'train.tsv': (
      "gj04\t1\t\tOur friends won't buy this analysis, let alone the next "
      'one we propose.\n'
      'gj04\t0\t*\tThey drank the pub.\n'
    ),
    'test.tsv': 'index\tsentence\n0\tBill whistled past the house.\n',
  },
  'sst2': {
    'train.tsv': "sentence\tlabel\nit 's a charming journey . \t1\n"
    'contains no wit , only labored gags \t0\n',
  },
  'mrpc': {
    'train.tsv': (
      '\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n'
      '1\t702876\t702977\tAmrozi accused his brother , whom he called " the '
      'witness " , of deliberately distorting his evidence .\tReferring to '
      'him as only " the witness " , Amrozi accused his brother of '
      'deliberately distorting his evidence .\n'
      "0\t2108705\t2108831\tYucaipa owned Dominick 's before selling the "
      'chain to Safeway in 1998 for $ 2.5 billion .\tYucaipa bought Dominick '
      "'s in 1995 for $ 693 million and sold it to Safeway for $ 1.8 "
      'billion in 1998 .\n'
    ),
    'test.tsv': (
      'index\t#1 ID\t#2 ID\t#1 String\t#2 String\n'
      "0\t1089874\t1089925\tPCCW 's chief operating officer , Mike "
      'Butcher , and Alex Arena , the chief financial officer , will report '
      'directly to Mr So .\tCurrent Chief Operating Officer Mike Butcher and '
      'Group Chief Financial Officer Alex Arena will report to So .\n'
    ),
  },
  'stsb': {
    'train.tsv': (
      'index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1'
      '\tsentence2\tscore\n'
      '0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is '
      'taking off.\tAn air plane is taking off.\t5.000\n'
      '1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man is '
      'playing a large flute.\tA man is playing a flute.\t3.800\n'
    ),
  },
  'qqp': {
    'train.tsv': (
      'id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n'
      '133273\t213221\t213222\tHow is the life of a math student? Could you '
      'describe your own experiences?\tWhich level of prepration is enough '
      'for the exam jlpt5?\t0\n'
      # A line with missing fields, as a few of QQP's are: skipped.
      '105780\t174363\t174364\tHow can I develop android app?\n'
      '402555\t536040\t536041\tHow do I control my horny emotions?\tHow do '
      'you control your horniness?\t1\n'
    ),
  },
  'mnli': {
    'train.tsv': (
      f'{MNLI_HEADER}\n'
      '0\t31193\t31193n\tgovernment\t( ( Conceptually ( cream skimming ) ) '
      '...\t( ( ( Product and ) geography ) ...\t(ROOT (S ...\t(ROOT (S ...'
      '\tConceptually cream skimming has two basic dimensions - product and '
      'geography.\tProduct and geography are what make cream skimming work. '
      '\tneutral\tneutral\n'
      '1\t101457\t101457e\ttelephone\t( you ...\t( You ...\t(ROOT ...\t(ROOT '
      '...\tyou know during the season and i guess at at your level uh you '
      'lose them to the next level if if they decide to recall the the '
      'parent team the Braves decide to call to recall a guy from triple A '
      'then a double A guy goes up to replace him and a single A guy goes up '
      'to replace him\tYou lose the things to the following level if the '
      'people recall.\tentailment\tentailment\n'
    ),
    'dev_matched.tsv': (
      f'{MNLI_DEV_HEADER}\n'
      '0\t63735\t63735n\tslate\t( ...\t( ...\t(ROOT ...\t(ROOT ...\tThe new '
      'rights are nice enough\tEveryone really likes the newest benefits '
      '\tneutral\tentailment\tneutral\tneutral\tneutral\tneutral\n'
    ),
    'dev_mismatched.tsv': (
      f'{MNLI_DEV_HEADER}\n'
      '0\t75290\t75290c\tletters\t( ...\t( ...\t(ROOT ...\t(ROOT ...\tYour '
      'contribution helped make it possible for us to provide our students '
      'with a quality education.\tYour contributions were of no help with '
      "our students' education.\tcontradiction\tcontradiction\t"
      'contradiction\tcontradiction\tcontradiction\tcontradiction\n'
    ),
  },
  'qnli': {
    'train.tsv': (
      'index\tquestion\tsentence\tlabel\n'
      '0\tWhen did the third Digimon series begin?\tUnlike the two seasons '
      'before it and most of the seasons that followed, Digimon Tamers takes '
      'a darker and more realistic approach to its story.\tnot_entailment\n'
    ),
  },
  'rte': {
    'train.tsv': (
      'index\tsentence1\tsentence2\tlabel\n'
      '0\tNo Weapons of Mass Destruction Found in Iraq Yet.\tWeapons of Mass '
      'Destruction Found in Iraq.\tnot_entailment\n'
      '1\tA place of sorrow, after Pope John Paul II died, became a place of '
      'celebration.\tPope Benedict XVI is the new leader of the Roman '
      'Catholic Church.\tentailment\n'
    ),
  },
}
EXPECTED = {
  ('cola', 'train'): [
    (
      "Our friends won't buy this analysis, let alone the next one we propose.",
      None,
      1,
    ),
    ('They drank the pub.', None, 0),
  ],
  ('cola', 'test'): [('Bill whistled past the house.', None, None)],
  ('sst2', 'train'): [
    ("it 's a charming journey . ", None, 1),
    ('contains no wit , only labored gags ', None, 0),
  ],
  ('mrpc', 'train'): [
    (
      'Amrozi accused his brother , whom he called " the witness " , of '
      'deliberately distorting his evidence .',
      'Referring to him as only " the witness " , Amrozi accused his '
      'brother of deliberately distorting his evidence .',
      1,
    ),
    (
      "Yucaipa owned Dominick 's before selling the chain to Safeway in "
      '1998 for $ 2.5 billion .',
      "Yucaipa bought Dominick 's in 1995 for $ 693 million and sold it to "
      'Safeway for $ 1.8 billion in 1998 .',
      0,
    ),
  ],
  ('mrpc', 'test'): [
    (
      "PCCW 's chief operating officer , Mike Butcher , and Alex Arena , the "
      'chief financial officer , will report directly to Mr So .',
      'Current Chief Operating Officer Mike Butcher and Group Chief '
      'Financial Officer Alex Arena will report to So .',
      None,
    )
  ],
  ('stsb', 'train'): [
    ('A plane is taking off.', 'An air plane is taking off.', 5.0),
    ('A man is playing a large flute.', 'A man is playing a flute.', 3.8),
  ],
  ('qqp', 'train'): [
    (
      'How is the life of a math student? Could you describe your own '
      'experiences?',
      'Which level of prepration is enough for the exam jlpt5?',
      0,
    ),
    (
      'How do I control my horny emotions?',
      'How do you control your horniness?',
      1,
    ),
  ],
  ('mnli', 'train'): [
    (
      'Conceptually cream skimming has two basic dimensions - product and '
      'geography.',
      'Product and geography are what make cream skimming work. ',
      2,
    ),
    (
      'you know during the season and i guess at at your level uh you lose '
      'them to the next level if if they decide to recall the the parent '
      'team the Braves decide to call to recall a guy from triple A then a '
      'double A guy goes up to replace him and a single A guy goes up to '
      'replace him',
      'You lose the things to the following level if the people recall.',
      1,
    ),
  ],
  ('mnli', 'dev'): [
    (
      'The new rights are nice enough',
      'Everyone really likes the newest benefits ',
      2,
    )
  ],
  ('mnli', 'dev_mismatched'): [
    (
      'Your contribution helped make it possible for us to provide our '
      'students with a quality education.',
      "Your contributions were of no help with our students' education.",
      0,
    )
  ],
  ('qnli', 'train'): [
    (
      'When did the third Digimon series begin?',
      'Unlike the two seasons before it and most of the seasons that '
      'followed, Digimon Tamers takes a darker and more realistic approach '
      'to its story.',
      1,
    )
  ],
  ('rte', 'train'): [
    (
      'No Weapons of Mass Destruction Found in Iraq Yet.',
      'Weapons of Mass Destruction Found in Iraq.',
      1,
    ),
    (
      'A place of sorrow, after Pope John Paul II died, became a place of '
      'celebration.',
      'Pope Benedict XVI is the new leader of the Roman Catholic Church.',
      0,
    ),
  ],
}


def _write_layout(task, root):
  folder = root / task
  folder.mkdir()
  for name, content in LAYOUTS[task].items():
    (folder / name).write_text(content, encoding='utf-8')
  return str(folder)


def test_every_task_has_a_layout_case():
  assert {task for task, _ in EXPECTED} == set(glue.PRESETS) == set(LAYOUTS)


@pytest.mark.parametrize('task, split', sorted(EXPECTED))
def test_reads_each_task_layout(task, split, tmp_path):
  config = _config(task, _write_layout(task, tmp_path))
  got = glue.read(config, split)
  want = EXPECTED[task, split]
  assert [(e['text_a'], e['text_b'], e['label']) for e in got] == want
  assert [e['guid'] for e in got] == [f'{split}-{i}' for i in range(len(want))]


def test_lines_with_missing_fields_are_skipped_and_counted(tmp_path):
  path = os.path.join(_write_layout('qqp', tmp_path), 'train.tsv')
  examples, skipped = glue.read_tsv(path, glue.PRESETS['qqp'], 'train')
  assert (len(examples), skipped) == (2, 1)


def test_bad_label_names_the_line(tmp_path):
  folder = tmp_path / 'rte'
  folder.mkdir()
  (folder / 'train.tsv').write_text(
    'index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\tyes\n'
  )
  with pytest.raises(ValueError, match=r'train.tsv:3: label .yes.'):
    glue.read(_config('rte', str(folder)), 'train')


def test_missing_files_and_dirs_explain_the_layout(tmp_path):
  with pytest.raises(FileNotFoundError, match=r'dev_matched.tsv not found.*'):
    glue.read(_config('mnli', str(tmp_path)), 'dev')
  with pytest.raises(FileNotFoundError, match='dev_mismatched.tsv'):
    glue.read(_config('mnli', str(tmp_path)), 'dev')
  with pytest.raises(ValueError, match='only sst2 has a bundled default'):
    glue.read(_config('rte'), 'train')
  with pytest.raises(ValueError, match="no split 'dev_mismatched'"):
    glue.read(_config('rte', str(tmp_path)), 'dev_mismatched')
  with pytest.raises(ValueError, match="glue_task='sst3'"):
    glue.read(_config('sst3'), 'train')


def test_tfds_source_without_a_prepared_dataset_says_so(tmp_path):
  config = _config('rte', f'tfds:{tmp_path}')
  with pytest.raises(FileNotFoundError, match=r"'glue/rte' is not prepared"):
    glue.read(config, 'dev')


def test_task_properties():
  heads = {t: glue.head(_config(t)) for t in glue.PRESETS}
  assert heads.pop('stsb') == 'regression'
  assert set(heads.values()) == {'classification'}
  assert glue.num_labels(_config('mnli')) == 3
  assert glue.num_labels(_config('stsb')) == 1
  assert glue.num_labels(_config('cola')) == 2
  assert glue.eval_splits(_config('mnli')) == ['dev', 'dev_mismatched']
  assert glue.eval_splits(_config('sst2')) == ['dev']
  want = {
    'cola': 'matthews_corr',
    'sst2': 'accuracy',
    'mrpc': 'accuracy_f1_mean',
    'stsb': 'pearson_spearman_mean',
    'qqp': 'accuracy_f1_mean',
    'mnli': 'accuracy',
    'qnli': 'accuracy',
    'rte': 'accuracy',
  }
  assert {t: glue.metric_name(_config(t)) for t in glue.PRESETS} == want
  assert glue.metric_name(_config('mrpc', metric='f1')) == 'f1'
  with pytest.raises(ValueError, match='not a metric of sst2'):
    glue.metric_name(_config('sst2', metric='f1'))


def _segments(row, mask, type_ids, sep_id):
  """The token ids between the [SEP]s of one row, by token type."""
  n = int(mask.sum())
  ids, types = list(row[:n]), list(type_ids[:n])
  seps = [i for i, t in enumerate(ids) if t == sep_id]
  return ids, types, seps


@pytest.mark.parametrize('family', ['encoder', 'encoder_decoder', 'decoder'])
def test_sst2_rows_decode_back_to_the_text(sst2, tokenizer, family):
  examples = sst2['dev']
  rows = glue.featurize(
    examples, tokenizer, _config('sst2'), seq_len=128, family=family
  )
  n = len(examples)
  assert rows['input_ids'].shape == rows['input_mask'].shape == (n, 128)
  assert rows['input_ids'].dtype == np.int32
  np.testing.assert_array_equal(rows['example_index'], np.arange(n))
  np.testing.assert_array_equal(rows['label'], [e['label'] for e in examples])
  assert rows['label'].dtype == np.int32
  assert not rows['token_type_ids'].any()
  first = 1 if family != 'decoder' else 0
  for example, ids, mask in zip(
    examples, rows['input_ids'], rows['input_mask'], strict=True
  ):
    n_real = int(mask.sum())
    assert mask[:n_real].all() and not mask[n_real:].any()
    assert (ids[n_real:] == tokenizer.pad_id).all()
    if first:
      assert ids[0] == tokenizer.cls_id
    assert ids[n_real - 1] == tokenizer.sep_id
    assert tokenizer.decode(ids[first : n_real - 1]) == example['text_a']


@pytest.mark.parametrize('family', ['encoder', 'decoder'])
def test_pairs_get_types_and_lose_the_longer_sentence_first(tokenizer, family):
  words = ['the', 'film', 'is', 'a', 'charming', 'and', 'often', 'affecting']
  words.append('journey')
  a = ' '.join(words * 6)
  b_short, b_long = ' '.join(words[:3]), ' '.join(words * 4)
  len_a, len_b = len(tokenizer.encode(a)), len(tokenizer.encode(b_long))
  assert len_a > 40 and len_b > 30
  seq_len = 32
  has_cls = family != 'decoder'
  budget = seq_len - 2 - has_cls
  examples = [
    {'text_a': a, 'text_b': b_short, 'label': 0.5},
    {'text_a': a, 'text_b': b_long, 'label': None},
    {'text_a': b_short, 'text_b': b_short, 'label': 1.0},
  ]
  rows = glue.featurize(
    examples, tokenizer, _config('stsb'), seq_len=seq_len, family=family
  )
  assert rows['label'].dtype == np.float32
  np.testing.assert_array_equal(rows['label'][[0, 2]], [0.5, 1.0])
  assert np.isnan(rows['label'][1])
  lengths = []
  for i, example in enumerate(examples):
    ids, types, seps = _segments(
      rows['input_ids'][i],
      rows['input_mask'][i],
      rows['token_type_ids'][i],
      tokenizer.sep_id,
    )
    assert len(seps) == 2 and seps[1] == len(ids) - 1
    assert ids[0] == tokenizer.cls_id if has_cls else ids[0] != tokenizer.cls_id
    part_a, part_b = ids[has_cls : seps[0]], ids[seps[0] + 1 : seps[1]]
    assert types == [0] * (seps[0] + 1) + [1] * (len(part_b) + 1)
    # What is kept of each sentence is its beginning.
    assert part_a == tokenizer.encode(example['text_a'])[: len(part_a)]
    assert part_b == tokenizer.encode(example['text_b'])[: len(part_b)]
    lengths.append((len(part_a), len(part_b)))
  n_short = len(tokenizer.encode(b_short))
  # BERT's _truncate_seq_pair: the short sentence stays whole; two long
  # ones shrink to equal lengths (the first keeps the odd token).
  assert lengths[0] == (budget - n_short, n_short)
  assert lengths[1] == ((budget + 1) // 2, budget // 2)
  assert lengths[2] == (n_short, n_short)


def test_too_short_seq_len_raises(tokenizer):
  examples = [{'text_a': 'a', 'text_b': 'b', 'label': 0}]
  with pytest.raises(ValueError, match='seq_len >= 5'):
    glue.featurize(
      examples, tokenizer, _config('rte'), seq_len=4, family='encoder'
    )


def _evaluate(task, labels, logits):
  rows = {'label': np.asarray(labels)}
  return glue.evaluate([], rows, {'logits': logits}, _config(task))


@pytest.mark.parametrize('seed', range(3))
def test_metrics_match_sklearn_and_scipy(seed):
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 2, 100)
  logits = rng.normal(size=(100, 2)) + 1.5 * np.eye(2)[labels]
  guesses = logits.argmax(-1)
  got = _evaluate('mrpc', labels, logits)
  accuracy = sk.accuracy_score(labels, guesses)
  f1 = sk.f1_score(labels, guesses)
  assert got == pytest.approx(
    {'accuracy': accuracy, 'f1': f1, 'accuracy_f1_mean': (accuracy + f1) / 2}
  )
  got = _evaluate('cola', labels, logits)
  assert got == pytest.approx(
    {
      'accuracy': accuracy,
      'matthews_corr': sk.matthews_corrcoef(labels, guesses),
    }
  )
  labels3 = rng.integers(0, 3, 100)
  logits3 = rng.normal(size=(100, 3)) + np.eye(3)[labels3]
  assert _evaluate('mnli', labels3, logits3) == pytest.approx(
    {'accuracy': sk.accuracy_score(labels3, logits3.argmax(-1))}
  )
  scores = np.round(rng.uniform(0, 5, 100) * 5) / 5
  predicted = (scores + rng.normal(size=100)).astype(np.float32)
  pearson = scipy.stats.pearsonr(scores, predicted)[0]
  spearman = scipy.stats.spearmanr(scores, predicted)[0]
  got = _evaluate('stsb', scores.astype(np.float32), predicted)
  assert got == pytest.approx(
    {
      'pearson': pearson,
      'spearman': spearman,
      'pearson_spearman_mean': (pearson + spearman) / 2,
    },
    abs=1e-6,
  )


def test_evaluate_needs_gold_labels():
  with pytest.raises(ValueError, match='without gold labels'):
    _evaluate('sst2', [0, -1], np.zeros((2, 2)))


def test_text_to_text_follows_t5():
  config = _config('mnli')
  example = {'text_a': 'It rains.', 'text_b': 'It is wet.', 'label': 1}
  assert glue.text_to_text(example, config) == (
    'mnli premise: It rains. hypothesis: It is wet.',
    'entailment',
  )
  assert glue.parse_text_label('entailment', config) == 1
  assert glue.parse_text_label('maybe', config) == -1
  stsb = _config('stsb')
  example = {'text_a': 'A b.', 'text_b': 'A c.', 'label': 3.75}
  assert glue.text_to_text(example, stsb) == (
    'stsb sentence1: A b. sentence2: A c.',
    '3.8',
  )
  assert glue.parse_text_label('3.8', stsb) == 3.8
  sst2 = {'text_a': 'fun .', 'text_b': None, 'label': None}
  assert glue.text_to_text(sst2, _config('sst2')) == (
    'sst2 sentence: fun .',
    '',
  )


def test_check_config_fails_fast():
  glue.check_config(_config('sst2'))
  glue.check_config(_config('rte', 'tfds:'))
  with pytest.raises(ValueError, match='only sst2 has a bundled default'):
    glue.check_config(_config('rte'))
  with pytest.raises(ValueError, match="glue_task='sst3'"):
    glue.check_config(_config('sst3'))
  with pytest.raises(ValueError, match='not a metric of cola'):
    glue.check_config(_config('cola', metric='accuracy_f1_mean'))
