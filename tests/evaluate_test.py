"""pretrain_lm.evaluate against direct computations with the models."""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from absl import flags
from conftest import COMPILE_FLAGS
from flax import linen as nn

from pretrain_lm import evaluate, pretrained
from pretrain_lm.evaluate import __main__ as evaluate_main
from pretrain_lm.models import MODELS, ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ['First Citizen:', 'Before we proceed any further, hear me speak.']


@pytest.fixture(scope='module')
def gpt(tiny_workdir):
  """The tiny char-level GPT workdir and its loaded model."""
  workdir = tiny_workdir('gpt')
  return workdir, pretrained.load(workdir)


def log_softmax_at(logits_LV, targets_L) -> np.ndarray:
  """log p(targets) per position, in float64."""
  logits_LV = np.asarray(logits_LV, np.float64)
  log_probs = logits_LV - np.log(np.exp(logits_LV).sum(-1, keepdims=True))
  return log_probs[np.arange(len(targets_L)), np.asarray(targets_L)]


_JITTED = {}
# Direct computations pad their rows to this width, so that each model
# compiles once: right padding is invisible to the real tokens (causal
# stacks; [PAD] keys are masked in bidirectional ones).
WIDTH = 64


def apply(m: pretrained.Pretrained, batch) -> dict[str, np.ndarray]:
  """The model's outputs on `batch`, its rows padded to WIDTH, jitted."""
  if id(m.model) not in _JITTED:
    _JITTED[id(m.model)] = jax.jit(
      functools.partial(m.model.apply, deterministic=True)
    )
  padded = {}
  for key, value in batch.items():
    value = np.asarray(value)
    if key.endswith('input_ids') or key == 'perm_rank':
      fill = -1 if key == 'perm_rank' else 0
      pad = [(0, 0), (0, WIDTH - value.shape[1])]
      value = np.pad(value, pad, constant_values=fill)
    padded[key] = value
  return _JITTED[id(m.model)]({'params': m.params}, padded)


def random_model(
  template: pretrained.Pretrained, family: str, objective: str, packing: str
) -> pretrained.Pretrained:
  """A randomly initialised tiny model of `family` on the template's tokens.

  Parameters ~ N(0, 0.5) spread the predictions, so that a log-prob at the
  wrong position or of the wrong token cannot pass for the right one.
  """
  cfg = ModelConfig(
    family=family,
    vocab_size=template.tokenizer.vocab_size,
    num_layers=2,
    emb_dim=32,
    num_heads=2,
    head_dim=16,
    mlp_dim=64,
    max_len=64,
    position='relative' if family == 'encoder_decoder' else 'learned',
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
  )
  model = MODELS[family](cfg)
  ids = np.ones((1, 8), np.int32)
  batch = {'input_ids': ids}
  if family == 'encoder_decoder':
    batch = {'encoder_input_ids': ids, 'decoder_input_ids': ids}
  if family in ('encoder', 'plm', 'electra'):  # MLM head params too
    batch['masked_positions'] = np.ones((1, 1), np.int32)
  if family == 'electra':
    batch.update(masked_ids=ids[:, :1], masked_weights=np.ones((1, 1)))
  shapes = jax.eval_shape(
    functools.partial(model.init, deterministic=True), jax.random.key(0), batch
  )
  # Random normal values (compiling the real initialisers takes longer).
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype),
    nn.meta.unbox(shapes['params']),
  )
  config = ml_collections.ConfigDict(template.config.to_dict())
  config.objective.name = objective
  config.data.packing = packing
  config.data.seq_len = 32
  return dataclasses.replace(
    template, config=config, model=model, params=params
  )


def test_decoder_loss_matches_direct_computation(gpt):
  _, m = gpt
  tok = m.tokenizer
  result = evaluate.evaluate_texts(m, TEXTS, batch_size=2)
  direct = []
  for text in TEXTS:
    # 'concat' packing: doc [SEP], every token after the first predicted.
    ids = tok.encode(text) + [tok.sep_id]
    logits = apply(m, {'input_ids': np.asarray([ids[:-1]])})['logits'][0]
    direct.append(log_softmax_at(logits, ids[1:]))
  direct = np.concatenate(direct)
  assert np.std(direct) > 0.02  # the comparison below is not vacuous
  assert result['num_tokens'] == direct.size == sum(len(t) for t in TEXTS)
  np.testing.assert_allclose(result['total_nll'], -direct.sum(), rtol=1e-5)
  np.testing.assert_allclose(result['loss'], -direct.mean(), rtol=1e-5)
  assert result['perplexity'] == pytest.approx(math.exp(-direct.mean()))
  words = sum(len(t.split()) for t in TEXTS)
  assert result['num_words'] == words == 10
  assert result['word_perplexity'] == pytest.approx(
    math.exp(-direct.sum() / words), rel=1e-5
  )


def test_strided_windows_match_brute_force(gpt):
  _, m = gpt
  tok, cfg = m.tokenizer, m.model.cfg
  text = ' '.join(TEXTS) * 2
  sequence = tok.encode(text)[:60]
  window, stride = 16, 5
  windows = evaluate.strided_windows(len(sequence), window, stride)
  # Every token but the first is predicted once, with enough context.
  predicted = [t for _, split, end in windows for t in range(split, end)]
  assert predicted == list(range(1, len(sequence)))
  for start, split, end in windows:
    assert end - 1 - start <= window
    assert split - start >= min(split, window - stride + 1)

  (scores,) = evaluate.causal_log_likelihoods(
    m.model, m.params, cfg, [sequence], window=window, stride=stride
  )
  brute = []
  for start, split, end in windows:
    # A causal model: one call on the window gives each token's log p with
    # exactly the context [start, t).
    inputs = np.asarray([sequence[start : end - 1]])
    logits = apply(m, {'input_ids': inputs})['logits'][0]
    brute.append(
      log_softmax_at(logits, sequence[start + 1 : end])[split - start - 1 :]
    )
  np.testing.assert_allclose(scores, np.concatenate(brute), atol=1e-5)

  # A document that fits one window scores the same whatever the stride.
  short = sequence[:20]
  one, strided = (
    evaluate.causal_log_likelihoods(
      m.model, m.params, cfg, [short], window=32, stride=s
    )[0]
    for s in (32, 3)
  )
  np.testing.assert_allclose(one, strided, atol=1e-6)


@pytest.mark.parametrize('family', ['encoder', 'electra'])
def test_pseudo_perplexity_matches_brute_force(gpt, family):
  _, template = gpt
  m = random_model(template, family, 'mlm', 'doc_sentences')
  tok = m.tokenizer
  texts = ['the cat sat.', 'a dog ran off']
  result = evaluate.evaluate_texts(m, texts, batch_size=3)
  masked, positions, targets = [], [], []
  for text in texts:
    row = [tok.cls_id, *tok.encode(text), tok.sep_id]
    # One row per text token, that token masked.
    for p in range(1, len(row) - 1):
      masked.append(row[:p] + [tok.mask_id] + row[p + 1 :])
      positions.append([p])
      targets.append(row[p])
  width = max(map(len, masked))
  masked = [r + [tok.pad_id] * (width - len(r)) for r in masked]
  batch = {'input_ids': masked, 'masked_positions': positions}
  if family == 'electra':  # its generator predicts; the rest is unused
    batch.update(
      masked_ids=np.asarray(targets)[:, None],
      masked_weights=np.ones((len(targets), 1)),
    )
  logits = apply(m, batch)
  direct = log_softmax_at(logits['mlm_logits'][:, 0], targets)
  assert np.std(direct) > 0.1
  assert result['kind'] == 'pseudo'
  assert result['num_tokens'] == direct.size
  np.testing.assert_allclose(result['total_nll'], -direct.sum(), rtol=1e-5)
  assert result['perplexity'] == pytest.approx(math.exp(-direct.mean()))


def test_plm_pseudo_likelihood_sees_all_other_tokens(gpt):
  _, template = gpt
  m = random_model(template, 'plm', 'plm', 'full_sentences')
  tok = m.tokenizer
  doc = tok.encode('to be or not')
  (scores,) = evaluate.pseudo_log_likelihoods(
    m.model, m.params, 'plm', tok, [doc], max_len=32
  )
  row = np.asarray([tok.cls_id, *doc, tok.sep_id])
  # One row per text token p, which is the only target of its order (rank
  # 0, the rest -1). The true token stays in the input: the order hides it
  # from the prediction, which sees every other token.
  positions = np.arange(1, len(row) - 1)
  rank = np.full((len(positions), len(row)), -1)
  rank[np.arange(len(positions)), positions] = 0
  logits = apply(
    m,
    {
      'input_ids': np.tile(row, (len(positions), 1)),
      'perm_rank': rank,
      'masked_positions': positions[:, None],
    },
  )['mlm_logits'][:, 0]
  brute = log_softmax_at(logits, row[positions])
  np.testing.assert_allclose(scores, brute, atol=1e-5)


def test_bilm_backward_matches_direct_computation(gpt):
  _, template = gpt
  m = random_model(template, 'bilm', 'bilm', 'concat')
  tok = m.tokenizer
  ids = tok.encode('speak, speak.') + [tok.sep_id]
  result = evaluate.evaluate_texts(m, ['speak, speak.'])
  outputs = apply(m, {'input_ids': np.asarray([ids])})
  # Forward: each token after the first; backward: each token before the
  # [SEP], from the ones after it (backward_logits[i] predicts ids[i - 1]).
  forward = log_softmax_at(outputs['logits'][0, :-1], ids[1:])
  backward = log_softmax_at(outputs['backward_logits'][0, 1:], ids[:-1])
  assert np.std(backward) > 0.1
  assert result['forward_loss'] == pytest.approx(-forward.mean(), rel=1e-5)
  assert result['backward_loss'] == pytest.approx(-backward.mean(), rel=1e-5)
  assert result['loss'] == pytest.approx(
    (result['forward_loss'] + result['backward_loss']) / 2
  )


def test_reconstruction_loss_matches_direct_computation(gpt):
  _, template = gpt
  m = random_model(template, 'encoder_decoder', 'denoising', 'full_sentences')
  tok = m.tokenizer
  texts = ['O Romeo, Romeo!', 'wherefore art thou']
  result = evaluate.evaluate_texts(m, texts, batch_size=1)
  direct = []
  for text in texts:
    ids = tok.encode(text)
    # BART's rows: the encoder reads [CLS] doc [SEP]; the decoder, fed
    # [CLS] doc, predicts doc [SEP].
    logits = apply(
      m,
      {
        'encoder_input_ids': np.asarray([[tok.cls_id, *ids, tok.sep_id]]),
        'decoder_input_ids': np.asarray([[tok.cls_id, *ids]]),
      },
    )['logits'][0]
    direct.append(log_softmax_at(logits, [*ids, tok.sep_id]))
  direct = np.concatenate(direct)
  assert np.std(direct) > 0.1
  assert result['kind'] == 'reconstruction'
  assert result['num_tokens'] == direct.size
  np.testing.assert_allclose(result['total_nll'], -direct.sum(), rtol=1e-5)


def test_cli_prints_and_writes_json(gpt, tmp_path):
  workdir, m = gpt
  data = tmp_path / 'held_out.txt'
  data.write_text('\n'.join(TEXTS) + '\n')
  output = tmp_path / 'result.json'
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=COMPILE_FLAGS)
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'pretrain_lm.evaluate',
      f'--workdir={workdir}',
      f'--data={data}',
      '--doc_format=line',
      f'--output={output}',
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=env,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  assert 'perplexity / word' in proc.stdout
  printed = json.loads(lines[-1])
  assert json.loads(output.read_text()) == printed
  assert printed['num_docs'] == 2 and printed['step'] == m.step
  expected = evaluate.evaluate_texts(m, TEXTS)
  assert printed['loss'] == pytest.approx(expected['loss'], rel=1e-5)


def run_cli(**flag_values):
  """The program's run on these flags, parsed as the command line would be."""
  fv = flags.FlagValues()
  evaluate_main.define_flags(fv)
  fv(['evaluate'] + [f'--{k}={v}' for k, v in flag_values.items()])
  return evaluate_main.run(fv)


def test_missing_workdir_or_data_is_a_clear_error(gpt, tmp_path):
  workdir, _ = gpt
  data = tmp_path / 'text.txt'
  data.write_text('some text\n')
  with pytest.raises(SystemExit, match=r'^error: .*no config\.json') as e:
    run_cli(workdir=tmp_path / 'nowhere', data=data)
  assert e.value.__suppress_context__  # no chained traceback
  missing = tmp_path / 'missing.txt'
  with pytest.raises(SystemExit, match=r'^error: --data: no file matches'):
    run_cli(workdir=workdir, data=missing)
