r"""Zero- and few-shot multiple choice for decoders (GPT-2 / GPT-3 style).

  python -m pretrain_lm.finetune.fewshot --workdir=workdirs/gpt_tiny \
      --data=tests/data/fewshot.jsonl --k=2 --seed=0

--data is a JSONL file of {"prompt": str, "choices": [str, ...], "answer":
int or str}; a string answer names the choice. Each example's context is
k demonstrations, `prompt + choices[answer]` of other examples, then its
own prompt, joined by --separator (GPT-3's format: the choices carry any
leading space, e.g. "Q: ... A:" and " Paris"). The demonstrations come
from --demos if given, else from --data without the example itself; they
are drawn without replacement by a generator seeded with (--seed, example
index), so a run is reproducible and examples do not share one draw.

Every choice is scored by the log-likelihood of its tokens after the
context (context and choice tokenized separately; the context loses
tokens on the left when both do not fit the model's context,
data.seq_len by default). Two accuracies are reported: `accuracy_sum`
picks the choice with the largest total log-likelihood, `accuracy_mean`
the largest per-token mean (GPT-3's default for most tasks, which does
not favour short choices).

From Python (a decoder workdir, e.g. from
`python -m pretrain_lm.main --config=configs/gpt.py:size=tiny
--workdir=workdirs/gpt_tiny`):

  from pretrain_lm.finetune import fewshot
  fewshot.evaluate_file('workdirs/gpt_tiny', 'tests/data/fewshot.jsonl', k=2)
"""

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from absl import app, flags, logging

from pretrain_lm import evaluate, pretrained
from pretrain_lm import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Example:
  """One multiple-choice question: choices[answer] is right."""

  prompt: str
  choices: tuple[str, ...]
  answer: int


def _parse(record: Any, where: str) -> Example:
  """An Example from one decoded JSON line; ValueError names `where`."""
  if not isinstance(record, dict):
    raise ValueError(f'{where}: expected a JSON object, got {record!r}.')
  missing = {'prompt', 'choices', 'answer'} - set(record)
  if missing:
    raise ValueError(f'{where}: missing {sorted(missing)}.')
  prompt, choices, answer = (
    record['prompt'],
    record['choices'],
    record['answer'],
  )
  if not isinstance(prompt, str):
    raise ValueError(f'{where}: "prompt" must be a string.')
  if (
    not isinstance(choices, list)
    or len(choices) < 2
    or not all(isinstance(c, str) for c in choices)
  ):
    raise ValueError(f'{where}: "choices" must be a list of >= 2 strings.')
  if isinstance(answer, str):
    if answer not in choices:
      raise ValueError(f'{where}: answer {answer!r} is not one of the choices.')
    answer = choices.index(answer)
  elif not (isinstance(answer, int) and 0 <= answer < len(choices)):
    raise ValueError(
      f'{where}: "answer" must be a choice string or an index in '
      f'[0, {len(choices)}), got {answer!r}.'
    )
  return Example(prompt, tuple(choices), answer)


def read_examples(path: str, flag: str = '--data') -> list[Example]:
  """The examples of a JSONL file (blank lines skipped).

  Args:
    path: a JSONL file of {"prompt", "choices", "answer"} objects.
    flag: names the file in error messages.

  Returns:
    The Examples, in file order; ValueError names the bad line.

  Example:
    examples = fewshot.read_examples('tests/data/fewshot.jsonl')
    examples[0].prompt, examples[0].choices, examples[0].answer
  """
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f'{flag}: no file {path!r}.')
  examples = []
  with tf.io.gfile.GFile(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f'{path}:{number}'
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{where}: not JSON ({e}).') from None
      examples.append(_parse(record, where))
  if not examples:
    raise ValueError(f'{flag}: {path!r} holds no examples.')
  return examples


def demonstration_indices(
  index: int, k: int, pool_size: int, *, seed: int, exclude_self: bool
) -> list[int]:
  """k distinct pool indices for example `index`, in prompt order.

  Drawn from (seed, index) alone, so each example's draw is reproducible
  and independent of the others; with `exclude_self` (demonstrations from
  the evaluated file) `index` itself is never drawn.

  Args:
    index: the evaluated example's index.
    k: how many demonstrations.
    pool_size: how many examples to draw from.
    seed: the run's seed.
    exclude_self: never draw `index` (the pool is the evaluated file).

  Returns:
    k distinct indices into the pool.
  """
  candidates = [
    j for j in range(pool_size) if not (exclude_self and j == index)
  ]
  if k > len(candidates):
    raise ValueError(
      f'--k={k} demonstrations, but only {len(candidates)} examples are '
      'available to draw them from.'
    )
  rng = np.random.default_rng([seed, index])
  return [candidates[j] for j in rng.choice(len(candidates), k, replace=False)]


def build_context(
  example: Example, demonstrations: Sequence[Example], separator: str
) -> str:
  """The demonstrations (prompt + right answer), then the example's prompt.

  Args:
    example: the evaluated example.
    demonstrations: solved examples to show first.
    separator: joins the demonstrations and the prompt.

  Returns:
    The context text the choices are scored after.
  """
  shots = [d.prompt + d.choices[d.answer] for d in demonstrations]
  return separator.join([*shots, example.prompt])


def build_contexts(
  examples: Sequence[Example],
  *,
  k: int,
  seed: int,
  separator: str,
  demos: Sequence[Example] | None = None,
) -> list[str]:
  """Each example's context: k demonstrations from `demos` or `examples`.

  Args:
    examples: the evaluated examples.
    k: demonstrations per context.
    seed: seeds the draws (see demonstration_indices).
    separator: joins the demonstrations and the prompt.
    demos: the pool of demonstrations; None for `examples` themselves
      (each example then never shows itself).

  Returns:
    One context per example.

  Example:
    examples = fewshot.read_examples('tests/data/fewshot.jsonl')
    contexts = fewshot.build_contexts(
      examples, k=2, seed=0, separator='\\n\\n'
    )
  """
  pool = examples if demos is None else demos
  return [
    build_context(
      example,
      [
        pool[j]
        for j in demonstration_indices(
          i, k, len(pool), seed=seed, exclude_self=demos is None
        )
      ],
      separator,
    )
    for i, example in enumerate(examples)
  ]


def choice_log_likelihoods(
  loaded: pretrained.Pretrained,
  contexts: Sequence[str],
  examples: Sequence[Example],
  *,
  max_len: int,
  batch_size: int = 16,
) -> list[list[Any]]:
  """Per example, per choice: float64 log p of each choice token.

  Args:
    loaded: a decoder, as `pretrain_lm.load` gives.
    contexts: one context per example (build_contexts).
    examples: the examples whose choices are scored.
    max_len: the most inputs a scored sequence may have (context_length).
    batch_size: rows per model call.

  Returns:
    Per example, per choice, float64[choice tokens] log-probabilities.

  Example:
    m = pretrain_lm.load('workdirs/gpt_tiny')
    scores = fewshot.choice_log_likelihoods(
      m, contexts, examples, max_len=m.config.data.seq_len
    )
    fewshot.accuracies(scores, examples)
  """
  tok = loaded.tokenizer
  start = evaluate.start_ids(loaded.config, tok)
  context_ids, choice_ids, owners = [], [], []
  for i, (context, example) in enumerate(zip(contexts, examples, strict=True)):
    ids = start + tok.encode(context)
    if not ids:
      raise ValueError(f'Example {i} has an empty context (prompt and k=0).')
    for choice in example.choices:
      choice_tokens = tok.encode(choice)
      if not choice_tokens:
        raise ValueError(
          f'Example {i} has a choice with no tokens: {choice!r}.'
        )
      context_ids.append(ids)
      choice_ids.append(choice_tokens)
      owners.append(i)
  # All candidates in one call: packed rows, one compilation.
  scores = evaluate.score_continuations(
    loaded.model,
    loaded.params,
    loaded.model.cfg,
    context_ids,
    choice_ids,
    max_len=max_len,
    batch_size=batch_size,
  )
  per_example = [[] for _ in examples]
  for i, score in zip(owners, scores, strict=True):
    per_example[i].append(score)
  return per_example


def accuracies(
  log_likelihoods: Sequence[Sequence[Any]], examples: Sequence[Example]
) -> dict[str, float]:
  """accuracy_sum and accuracy_mean of the per-choice token log-probs.

  Args:
    log_likelihoods: choice_log_likelihoods' result.
    examples: the same examples (their answers).

  Returns:
    {'accuracy_sum': float, 'accuracy_mean': float}, fractions right.
  """
  right = {'sum': 0, 'mean': 0}
  for scores, example in zip(log_likelihoods, examples, strict=True):
    totals = [float(np.sum(s)) for s in scores]
    means = [float(np.mean(s)) for s in scores]
    right['sum'] += int(np.argmax(totals) == example.answer)
    right['mean'] += int(np.argmax(means) == example.answer)
  n = len(examples)
  return {f'accuracy_{name}': count / n for name, count in right.items()}


def _check_family(family: str) -> None:
  if family != 'decoder':
    raise ValueError(
      f'Few-shot scoring needs a decoder (model.family=decoder), not '
      f'model.family={family!r}.'
    )


def evaluate_examples(
  loaded: pretrained.Pretrained,
  examples: Sequence[Example],
  *,
  k: int = 0,
  seed: int = 0,
  separator: str = '\n\n',
  demos: Sequence[Example] | None = None,
  max_len: int = 0,
  batch_size: int = 16,
) -> dict[str, Any]:
  """Multiple-choice accuracies of a loaded decoder (see the module doc).

  Args:
    loaded: a decoder, as `pretrain_lm.load` gives.
    examples: the evaluated examples (read_examples).
    k: demonstrations before each prompt (0: zero-shot).
    seed: seeds the demonstration draws.
    separator: joins the demonstrations and the prompt.
    demos: the pool of demonstrations; None to draw from `examples`.
    max_len: the context length; 0 for the run's data.seq_len.
    batch_size: rows per model call.

  Returns:
    A JSON-serialisable dict: num_examples, k, seed, max_len, chance,
    accuracy_sum and accuracy_mean.

  Example:
    import pretrain_lm
    from pretrain_lm.finetune import fewshot
    m = pretrain_lm.load('workdirs/gpt_tiny')
    examples = fewshot.read_examples('tests/data/fewshot.jsonl')
    fewshot.evaluate_examples(m, examples, k=2, seed=0)
  """
  _check_family(loaded.model.cfg.family)
  max_len = evaluate.context_length(loaded, max_len)
  contexts = build_contexts(
    examples, k=k, seed=seed, separator=separator, demos=demos
  )
  scores = choice_log_likelihoods(
    loaded, contexts, examples, max_len=max_len, batch_size=batch_size
  )
  return {
    'num_examples': len(examples),
    'k': k,
    'seed': seed,
    'max_len': max_len,
    'chance': float(np.mean([1 / len(e.choices) for e in examples])),
    **accuracies(scores, examples),
  }


def evaluate_file(
  workdir: str,
  data: str,
  *,
  step: int | None = None,
  demos: str = '',
  max_examples: int = 0,
  **kwargs,
) -> dict[str, Any]:
  """Loads a workdir and evaluates it on a JSONL file.

  Args:
    workdir: a decoder training workdir.
    data: the JSONL file of examples (read_examples).
    step: the checkpoint step; None for the latest.
    demos: a JSONL file to draw demonstrations from; '' for `data`.
    max_examples: evaluate only the first max_examples (0: all).
    **kwargs: evaluate_examples' options (k, seed, separator, max_len,
      batch_size).

  Returns:
    evaluate_examples' dict, with workdir, step and data added.

  Example:
    from pretrain_lm.finetune import fewshot
    fewshot.evaluate_file(
      'workdirs/gpt_tiny', 'tests/data/fewshot.jsonl', k=2, seed=0
    )
  """
  evaluate.check_workdir(workdir)
  # Bad input fails before the checkpoint is restored.
  config = workdir_lib.read_json(os.path.join(workdir, 'config.json'))
  _check_family(config['model']['family'])
  examples = read_examples(data)
  if max_examples > 0:
    examples = examples[:max_examples]
  demo_examples = read_examples(demos, '--demos') if demos else None
  loaded = pretrained.load(workdir, step=step)
  result = evaluate_examples(loaded, examples, demos=demo_examples, **kwargs)
  return {'workdir': workdir, 'step': loaded.step, 'data': data, **result}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """The command line's flags, defined only when it runs (so that
  importing this module next to another CLI defines no duplicate)."""
  fv = {'flag_values': flag_values}
  flags.DEFINE_string('workdir', None, 'A decoder training workdir.', **fv)
  flags.DEFINE_string(
    'data', None, 'JSONL of {"prompt", "choices", "answer"}.', **fv
  )
  flags.DEFINE_integer('k', 0, 'Demonstrations before each prompt.', **fv)
  flags.DEFINE_integer('seed', 0, 'Seeds the demonstration draws.', **fv)
  flags.DEFINE_string(
    'separator',
    '\n\n',
    r'Joins demonstrations and prompt; "\n" and "\t" are unescaped.',
    **fv,
  )
  flags.DEFINE_string(
    'demos', '', 'JSONL to draw demonstrations from (default: --data).', **fv
  )
  flags.DEFINE_integer('step', None, 'Checkpoint step (default latest).', **fv)
  flags.DEFINE_integer(
    'max_len', 0, 'Context length (default: the run data.seq_len).', **fv
  )
  flags.DEFINE_integer(
    'max_examples', 0, 'Evaluate only the first N examples (0: all).', **fv
  )
  flags.DEFINE_integer('batch_size', 16, 'Rows per model call.', **fv)
  flags.DEFINE_string('output', '', 'Also write the JSON here.', **fv)
  flags.mark_flags_as_required(['workdir', 'data'], **fv)


def run(flag_values: flags.FlagValues) -> dict[str, Any]:
  """The command line on parsed flags: prints a summary and a JSON line.

  Args:
    flag_values: flags defined by define_flags and parsed.

  Returns:
    evaluate_file's dict (also written to --output if given).
  """
  f = flag_values
  # A shell passes --separator="\n\n" as backslashes.
  separator = f.separator.replace('\\n', '\n').replace('\\t', '\t')
  try:
    result = evaluate_file(
      f.workdir,
      f.data,
      step=f.step,
      demos=f.demos,
      max_examples=f.max_examples,
      k=f.k,
      seed=f.seed,
      separator=separator,
      max_len=f.max_len,
      batch_size=f.batch_size,
    )
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None
  print(
    f'{result["workdir"]} (step {result["step"]}) on {result["data"]}, '
    f'k={result["k"]}, seed={result["seed"]}\n'
    f'  examples       {result["num_examples"]}\n'
    f'  accuracy/mean  {result["accuracy_mean"]:.4f}  (per-token mean)\n'
    f'  accuracy/sum   {result["accuracy_sum"]:.4f}  (total log-likelihood)\n'
    f'  chance         {result["chance"]:.4f}'
  )
  if f.output:
    workdir_lib.write_json(f.output, result)
  print(json.dumps(result, sort_keys=True))
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  run(flags.FLAGS)


if __name__ == '__main__':
  define_flags()
  app.run(main)
