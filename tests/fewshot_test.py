"""Few-shot multiple choice (pretrain_lm.finetune.fewshot) vs brute force.

tests/data/fewshot.jsonl quotes the public-domain Tiny Shakespeare corpus.
"""

import functools
import json
import os

import jax
import numpy as np
import pytest
from absl import flags

from pretrain_lm import pretrained
from pretrain_lm.finetune import fewshot

DATA = os.path.join(os.path.dirname(__file__), 'data', 'fewshot.jsonl')


@pytest.fixture(scope='module')
def gpt(tiny_workdir):
  """The tiny char-level GPT workdir (context 64) and its loaded model."""
  workdir = tiny_workdir('gpt')
  return workdir, pretrained.load(workdir)


def brute_force_log_likelihoods(m, contexts, examples, max_len):
  """Per example and choice, log p of the choice tokens, one row each."""
  tok = m.tokenizer
  apply = jax.jit(functools.partial(m.model.apply, deterministic=True))
  out = []
  for context, example in zip(contexts, examples, strict=True):
    per_choice = []
    for choice in example.choices:
      choice_ids = tok.encode(choice)
      # GPT's 'concat' rows have no [CLS]; the model reads at most max_len
      # tokens, so the context keeps its last ones.
      ids = (tok.encode(context) + choice_ids)[-(max_len + 1) :]
      # Right padding to max_len: one compilation, invisible causally.
      inputs = np.zeros((1, max_len), np.int32)
      inputs[0, : len(ids) - 1] = ids[:-1]
      logits = apply({'params': m.params}, {'input_ids': inputs})['logits']
      logits = np.asarray(logits[0], np.float64)
      log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
      n = len(choice_ids)
      positions = np.arange(len(ids) - 1 - n, len(ids) - 1)
      per_choice.append(log_probs[positions, np.asarray(ids[-n:])])
    out.append(per_choice)
  return out


def test_read_examples_accepts_index_or_choice_string(tmp_path):
  examples = fewshot.read_examples(DATA)
  assert len(examples) == 6
  assert examples[1].answer == 0 and examples[4].answer == 0
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"prompt": "a", "choices": ["b", "c"], "answer": "d"}\n')
  with pytest.raises(ValueError, match=r'bad\.jsonl:1: answer .d. is not'):
    fewshot.read_examples(str(bad))


def test_contexts_are_seeded_and_never_include_the_example():
  examples = [fewshot.Example(f'q{i}:', (f' a{i}', ' x'), 0) for i in range(6)]
  for i in range(len(examples)):
    drawn = fewshot.demonstration_indices(
      i, 3, len(examples), seed=7, exclude_self=True
    )
    assert len(set(drawn)) == 3 and i not in drawn
  contexts = fewshot.build_contexts(examples, k=3, seed=7, separator='\n\n')
  assert contexts == fewshot.build_contexts(
    examples, k=3, seed=7, separator='\n\n'
  )
  assert contexts != fewshot.build_contexts(
    examples, k=3, seed=8, separator='\n\n'
  )
  for i, context in enumerate(contexts):
    shots = context.split('\n\n')
    assert len(shots) == 4 and shots[-1] == f'q{i}:'
    # Demonstrations are other examples' prompt + right answer.
    assert f'q{i}: a{i}' not in shots
    assert all(s in {f'q{j}: a{j}' for j in range(6)} for s in shots[:-1])
  # k = 0 is the prompt alone; a separate pool may include any example.
  assert fewshot.build_contexts(examples, k=0, seed=0, separator='|') == [
    e.prompt for e in examples
  ]
  pool = [fewshot.Example('d:', (' y', ' n'), 1)]
  assert fewshot.build_contexts(
    examples[:2], k=1, seed=0, separator='|', demos=pool
  ) == ['d: n|q0:', 'd: n|q1:']
  with pytest.raises(ValueError, match='only 5 examples'):
    fewshot.build_contexts(examples, k=6, seed=0, separator='|')


def test_scores_and_accuracy_match_brute_force(gpt):
  _, m = gpt
  examples = fewshot.read_examples(DATA)
  # k = 2 makes contexts longer than the 64-token window: left-truncated.
  contexts = fewshot.build_contexts(examples, k=2, seed=0, separator='\n')
  assert max(map(len, contexts)) > 64
  scores = fewshot.choice_log_likelihoods(m, contexts, examples, max_len=64)
  brute = brute_force_log_likelihoods(m, contexts, examples, 64)
  for got, want in zip(scores, brute, strict=True):
    for g, w in zip(got, want, strict=True):
      np.testing.assert_allclose(g, w, atol=1e-5)

  # Answers set from the scores: the best choice for the first three
  # examples, the worst for the rest, so each accuracy must be exactly 1/2.
  for rule in (np.sum, np.mean):
    relabelled = []
    for i, (example, per_choice) in enumerate(
      zip(examples, brute, strict=True)
    ):
      values = [rule(s) for s in per_choice]
      assert len(set(values)) == len(values)  # no ties
      answer = int(np.argmax(values) if i < 3 else np.argmin(values))
      relabelled.append(
        fewshot.Example(example.prompt, example.choices, answer)
      )
    result = fewshot.evaluate_examples(
      m, relabelled, k=2, seed=0, separator='\n', max_len=64
    )
    assert result[f'accuracy_{rule.__name__}'] == 0.5
    assert result['num_examples'] == 6


def run_cli(**flag_values):
  """fewshot.run on these flags, parsed as the command line would be."""
  fv = flags.FlagValues()
  fewshot.define_flags(fv)
  fv(['fewshot'] + [f'--{k}={v}' for k, v in flag_values.items()])
  return fewshot.run(fv)


def test_cli_runs_on_the_fixture(gpt, tmp_path):
  workdir, m = gpt
  output = tmp_path / 'fewshot.json'
  run_cli(
    workdir=workdir,
    data=DATA,
    k=1,
    seed=3,
    separator=r'\n',
    output=output,
  )
  result = json.loads(output.read_text())
  assert result['k'] == 1 and result['num_examples'] == 6
  assert result['chance'] == pytest.approx((3 * 1 / 2 + 2 * 1 / 3 + 1 / 2) / 6)
  examples = fewshot.read_examples(DATA)
  expected = fewshot.evaluate_examples(m, examples, k=1, seed=3, separator='\n')
  for key in ('accuracy_sum', 'accuracy_mean'):
    assert result[key] == expected[key]
  with pytest.raises(SystemExit, match=r'^error: --data: no file'):
    run_cli(workdir=workdir, data='/no/such.jsonl')
