"""Generative text-to-text fine-tuning: rows, loss, decoding, metrics, runs.

decoding_test proves `decoding.beam_search` equal to an exhaustive search
over all sequences for several length penalties; here the task's own path
(Pretrained.generate_ids with num_beams and length_penalty, a real model
with its KV cache) is held to the same exhaustive search.
"""

import itertools
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import load_config, one_device, read_metrics
from flax import linen as nn

from pretrain_lm import pretrained
from pretrain_lm.finetune import config as config_lib
from pretrain_lm.finetune import losses, text2text, trainer
from pretrain_lm.models import MODELS, ModelConfig, decoding


class WordTokenizer:
  """Whitespace words -> ids from a fixed word list (ids 0-4 special)."""

  pad_id, sep_id, cls_id, unk_id, mask_id = 0, 1, 2, 3, 4

  def __init__(self, words=(), vocab_size=None):
    self.words = ['[PAD]', '[SEP]', '[CLS]', '[UNK]', '[MASK]', *words]
    self.vocab_size = vocab_size or len(self.words)

  def encode(self, text):
    return [
      self.words.index(w) if w in self.words else self.unk_id
      for w in text.split()
    ]

  def decode(self, ids):
    return ' '.join(self.words[i] for i in ids if i != self.pad_id)


def task_config() -> ml_collections.ConfigDict:
  """The config file's task section, unlocked."""
  return load_config(
    'finetune/text2text', ''
  ).task.copy_and_resolve_references()


# --- Metrics.


def test_scores_equal_rouge_score_and_sacrebleu_on_fixed_strings():
  import sacrebleu
  from rouge_score import rouge_scorer

  predictions = [
    'the cat sat on the mat',
    'Early life',
    'a quick brown dogs jumped',
    '',
  ]
  references = [
    'the cat was sitting on the mat',
    'Early life',
    'the quick brown dog jumps over',
    'History',
  ]
  got = text2text.scores(predictions, references)
  scorer = rouge_scorer.RougeScorer(
    ['rouge1', 'rouge2', 'rougeL'], use_stemmer=True
  )
  for key in ('rouge1', 'rouge2', 'rougeL'):
    want = np.mean(
      [
        scorer.score(r, p)[key].fmeasure
        for p, r in zip(predictions, references, strict=True)
      ]
    )
    assert got[key] == pytest.approx(100 * want)
  bleu = sacrebleu.corpus_bleu(predictions, [references]).score
  assert got['bleu'] == pytest.approx(bleu) and 0 < bleu < 100
  # SQuAD's normalisation: case, punctuation and articles do not count.
  assert text2text.scores(['The Cat.'], ['cat'])['exact_match'] == 100.0
  # 'a big dog' vs 'big cat': 'big' of 2 words each, P = R = F1 = 1/2.
  two = text2text.scores(['a big dog', 'x'], ['big cat', 'x'])
  assert two['exact_match'] == 50.0
  assert two['f1'] == pytest.approx(100 * (0.5 + 1.0) / 2)


# --- Data and rows.


def test_reads_tsv_jsonl_and_the_bundled_headings(tmp_path):
  (tmp_path / 'train.tsv').write_text('input\ttarget\nsome text\tits title\n')
  (tmp_path / 'dev.jsonl').write_text(
    json.dumps({'input': 'a\tb', 'target': 'c'}) + '\n\n'
  )
  tc = task_config()
  tc.data_dir = str(tmp_path)
  assert text2text.read(tc, 'train') == [
    {'input': 'some text', 'target': 'its title'}
  ]
  assert text2text.read(tc, 'dev') == [{'input': 'a\tb', 'target': 'c'}]
  (tmp_path / 'dev.tsv').write_text('x\ty\n')
  with pytest.raises(FileNotFoundError, match='both of dev.tsv and dev.jsonl'):
    text2text.read(tc, 'dev')

  wiki = tmp_path / 'wiki.txt'
  wiki.write_text(
    ' \n = Article = \n \n Lead . \n \n = = Life = = \n \n First . \n'
    ' Second . \n \n = = Works = = \n = = = Books = = = \n \n Novels . \n'
    ' = = Empty = = \n \n = Next = \n'
  )
  # 'Works' has no paragraph before its subsection; article leads are not
  # sections.
  assert text2text.heading_examples(str(wiki)) == [
    {'input': 'First .', 'target': 'Life'},
    {'input': 'Novels .', 'target': 'Books'},
  ]
  tc.data_dir = ''
  train, dev = text2text.read(tc, 'train'), text2text.read(tc, 'dev')
  assert len(train) > 300 and len(dev) > 300
  assert not any('<unk>' in e['target'] for e in train + dev)
  assert train[0]['target'] == 'Description'
  assert train[0]['input'].startswith('Homarus gammarus is a large')


def rows(family, seq_len=12, target_len=4):
  tok = WordTokenizer(['a', 'b', 'c', 'd', 'e', 'f', 'x', 'y', 'z'])
  tc = task_config()
  tc.target_len = target_len
  examples = [
    {'input': 'a b c', 'target': 'x y'},
    {'input': 'a b c d e f a b c d e f', 'target': 'x y z x y z'},
  ]
  return tok, text2text.featurize(
    examples, tok, tc, seq_len=seq_len, family=family
  )


def test_decoder_and_encoder_decoder_rows():
  tok, f = rows('decoder')
  # input [SEP] target [SEP]; position t predicts t + 1.
  np.testing.assert_array_equal(
    f['input_ids'][0], [5, 6, 7, 1, 11, 12, 1, 0, 0, 0, 0, 0]
  )
  np.testing.assert_array_equal(
    f['target_mask'][0], [0, 0, 0, 1, 1, 1] + [0] * 6
  )
  np.testing.assert_array_equal(f['target_ids'][0, 3:6], [11, 12, 1])
  # The long row: the target is cut to 3 tokens + [SEP], the input to fit.
  np.testing.assert_array_equal(
    f['input_ids'][1], [5, 6, 7, 8, 9, 10, 5, 1, 11, 12, 13, 1]
  )
  assert list(f['prompt_length']) == [4, 8]
  for i in range(2):
    m = f['target_mask'][i] > 0
    np.testing.assert_array_equal(
      f['target_ids'][i][m], f['input_ids'][i][1:][m[:-1]]
    )

  _, f = rows('encoder_decoder')
  np.testing.assert_array_equal(f['input_ids'][0, :4], [5, 6, 7, 1])
  np.testing.assert_array_equal(f['decoder_input_ids'][0], [2, 11, 12, 0])
  np.testing.assert_array_equal(f['target_ids'][0], [11, 12, 1, 0])
  np.testing.assert_array_equal(f['target_mask'][0], [1, 1, 1, 0])
  np.testing.assert_array_equal(f['decoder_input_ids'][1], [2, 11, 12, 13])
  np.testing.assert_array_equal(f['target_ids'][1], [11, 12, 13, 1])
  assert list(f['prompt_length']) == [4, 12]


def test_target_only_loss_is_the_hand_computation():
  _, f = rows('decoder')
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(*f['input_ids'].shape, 16)).astype(np.float32)
  batch = {k: jnp.asarray(f[k]) for k in ('target_ids', 'target_mask')}
  loss, metrics = losses.loss_fn('lm')({'logits': jnp.asarray(logits)}, batch)

  # By hand: -log softmax at each target position, averaged over them.
  terms = []
  for i, t in zip(*np.nonzero(f['target_mask']), strict=True):
    z = logits[i, t].astype(np.float64)
    logp = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    terms.append(-logp[f['target_ids'][i, t]])
  assert float(loss) == pytest.approx(np.mean(terms), rel=1e-5)
  assert metrics['num_predictions'] == len(terms) == 3 + 4

  # The input and padding positions have no gradient.
  grad = jax.grad(lambda x: losses.loss_fn('lm')({'logits': x}, batch)[0])(
    jnp.asarray(logits)
  )
  per_position = np.abs(np.asarray(grad)).sum(-1)
  assert (per_position[f['target_mask'] == 0] == 0).all()
  assert (per_position[f['target_mask'] == 1] > 0).all()

  # The dev loss from per-row sums is the same token average.
  sums = losses.target_nll(jnp.asarray(logits), *batch.values())
  sums = jax.tree.map(np.asarray, sums)
  assert losses.eval_loss('lm', sums, f) == pytest.approx(float(loss), 1e-5)


# --- Decoding through the task's path.


def exhaustive(model, params, prompt, eos, allowed, steps, alpha):
  """The best sequence by log-prob / length_penalty over every sequence of
  allowed ids that ends at eos or runs `steps` tokens."""
  best = (-math.inf, None)
  for n in range(1, steps + 1):
    seqs = [
      list(s)
      for s in itertools.product(allowed, repeat=n)
      if eos not in s[:-1] and (n == steps or s[-1] == eos)
    ]
    ids = jnp.asarray([prompt + s for s in seqs])
    logits = model.apply(
      {'params': params}, {'input_ids': ids}, deterministic=True
    )
    logp = np.asarray(jax.nn.log_softmax(logits['logits'], -1), np.float64)
    P = len(prompt)
    for row, s in enumerate(seqs):
      lp = sum(logp[row, P - 1 + k, t] for k, t in enumerate(s))
      best = max(best, (lp / float(decoding.length_penalty(n, alpha)), s))
  return best[1]


def test_generate_ids_beam_search_is_the_exhaustive_best():
  # 6 emittable ids of 8 ([PAD] and [MASK] never are), 3 steps: 16 beams
  # (32 candidates a step) keep every live prefix, so beam search must
  # find the exhaustive search's best.
  tok = WordTokenizer(['x', 'y', 'z'])
  cfg = ModelConfig(
    family='decoder',
    vocab_size=8,
    num_layers=1,
    emb_dim=16,
    num_heads=2,
    head_dim=8,
    mlp_dim=32,
    max_len=16,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
  )
  model = MODELS['decoder'](cfg)
  prompts = [[5, 6, 1], [7, 1]]
  params = model.init(
    jax.random.key(5),
    {'input_ids': jnp.asarray(prompts[:1])},
    deterministic=True,
  )['params']
  # Sharper logits than an init's: at this seed and scale the length
  # penalty changes the best sequence (checked below).
  params = jax.tree.map(lambda x: 3 * x, nn.meta.unbox(params))
  m = pretrained.Pretrained(
    ml_collections.ConfigDict(), model, params, tok, step=0
  )
  allowed = [int(i) for i in np.nonzero(m._output_ids())[0]]
  assert allowed == [1, 2, 3, 5, 6, 7]
  best = {}
  for alpha in (0.0, 2.0):
    out = m.generate_ids(
      prompts, 3, num_beams=16, length_penalty=alpha, batch_size=4
    )
    for prompt, ids in zip(prompts, out, strict=True):
      want = exhaustive(model, params, prompt, tok.sep_id, allowed, 3, alpha)
      assert [int(i) for i in ids][: len(want)] == want, (alpha, ids, want)
      best[alpha, tuple(prompt)] = want
  assert best[0.0, (7, 1)] != best[2.0, (7, 1)]


# --- Fine-tuning runs from pretraining workdirs.


def run_config(init, **task):
  c = load_config('finetune/text2text', '')
  c.init.workdir = init
  c.task.seq_len = 48
  c.task.target_len = 8
  c.task.max_new_tokens = 8
  c.task.max_train_examples = 16
  c.task.max_eval_examples = 6
  c.task.update(task)
  c.data.batch_size = 8
  c.train.eval_batch_size = 4
  c.train.num_steps = 16
  c.train.log_every = 4
  c.train.eval_every = 8
  c.train.progress_bar = False
  c.optimizer.learning_rate = 2e-3
  c.checkpoint.async_save = False
  c.checkpoint.every = 8
  c.mesh.data = 1
  return c


def check_run(workdir, results, metric, steps=(8, 16)):
  assert results['metric'] == metric
  assert [e['step'] for e in results['evals']] == list(steps)
  final = results['final']
  for key in text2text.METRICS:
    assert 0.0 <= final['eval_' + key] <= 100.0
  assert math.isfinite(final['eval_loss'])
  for step in steps:
    with open(os.path.join(workdir, f'predictions_{step}.jsonl')) as f:
      records = [json.loads(line) for line in f]
    assert len(records) == 6
    assert all(set(r) == {'input', 'target', 'prediction'} for r in records)
  logged = [r['loss'] for r in read_metrics(workdir) if 'loss' in r]
  assert len(logged) == 4 and all(math.isfinite(x) for x in logged)
  assert logged[-1] < logged[0] - 0.3, logged


def test_t5_fine_tunes_with_beam_search(tiny_workdir, tmp_path):
  init = tiny_workdir('t5')
  c = run_config(init, num_beams=2, length_penalty=0.6, metric='bleu')
  workdir = str(tmp_path / 'run')
  run = trainer.Trainer(c, workdir, one_device())
  # The head is the body's own LM head, restored, not fresh.
  state = run.initial_state()
  assert set(state.params) == {'backbone'}
  restored = pretrained.load(init).params
  np.testing.assert_array_equal(
    state.params['backbone']['token_embed']['embedding'],
    restored['token_embed']['embedding'],
  )
  results = run.run()
  check_run(workdir, results, 'bleu')


def test_gpt_fine_tunes_greedy_and_resumes(tiny_workdir, tmp_path):
  c = run_config(tiny_workdir('gpt'), metric='rouge')
  c.train.exit_interval = 8
  workdir = str(tmp_path / 'run')
  config_lib.check_config(c, workdir)
  first = trainer.finetune(c, workdir, one_device())
  assert [e['step'] for e in first['evals']] == [8] and first['final'] is None
  results = trainer.finetune(c, workdir, one_device())  # resumes at step 8
  check_run(workdir, results, 'rougeL')


def test_bad_options_are_clear_errors(tiny_workdir, tmp_path):
  c = run_config(tiny_workdir('gpt'))
  c.head.freeze_backbone = True
  with pytest.raises(ValueError, match='head.freeze_backbone: task text2text'):
    config_lib.check_config(c, str(tmp_path))
  c.head.freeze_backbone = False
  c.task.metric = 'meteor'
  with pytest.raises(ValueError, match="task.metric='meteor'"):
    config_lib.check_config(c, str(tmp_path))
  c.task.metric = 'rouge'
  c.task.max_new_tokens = 200
  with pytest.raises(ValueError, match='more than the model.max_len=128'):
    trainer.Trainer(c, str(tmp_path / 'run'), one_device())
  c.task.max_new_tokens = 8
  c.init.workdir = tiny_workdir('bert')
  with pytest.raises(ValueError, match="not 'encoder'"):
    trainer.Trainer(c, str(tmp_path / 'run2'), one_device())
