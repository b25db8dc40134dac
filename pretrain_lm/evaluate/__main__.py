r"""Held-out loss and perplexity of a trained workdir on text.

  python -m pretrain_lm.evaluate --workdir=workdirs/gpt_tiny \
      --data='pretrain_lm/data/corpora/tinyshakespeare/input.txt[90%:]'

--data takes local (or gs://) files, globs and percent slices, the syntax
of config.data.source; the text is split into documents by the workdir's
data.doc_format (or --doc_format) and tokenized with the workdir's
tokenizer. Prints a table and the result as one JSON line (also written to
--output). What is scored for each model family, and what is reported:
pretrain_lm/evaluate/perplexity.py.
"""

import json
from typing import Any

from absl import app, flags, logging

from pretrain_lm import workdir as workdir_lib
from pretrain_lm.evaluate.workdirs import evaluate_workdir, format_table


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """The command line's flags, defined only when it runs (so that
  importing this module next to another CLI defines no duplicate)."""
  fv = {'flag_values': flag_values}
  flags.DEFINE_string('workdir', None, 'A training workdir.', **fv)
  flags.DEFINE_string(
    'data', None, 'Text files, globs or slices, as config.data.source.', **fv
  )
  flags.DEFINE_integer('step', None, 'Checkpoint step (default latest).', **fv)
  flags.DEFINE_integer(
    'max_docs', 0, 'Score only the first N documents (0: all).', **fv
  )
  flags.DEFINE_integer('batch_size', 16, 'Rows per model call.', **fv)
  flags.DEFINE_integer(
    'seq_len', 0, 'Context / row length (default: the run data.seq_len).', **fv
  )
  flags.DEFINE_integer(
    'stride', 0, 'Decoder window stride (default seq_len // 2).', **fv
  )
  flags.DEFINE_string(
    'doc_format',
    '',
    "'line', 'blank_line' or 'file' (default: the run's).",
    **fv,
  )
  flags.DEFINE_string('output', '', 'Also write the JSON here.', **fv)
  flags.mark_flags_as_required(['workdir', 'data'], **fv)


def run(flag_values: flags.FlagValues) -> dict[str, Any]:
  """The command line on parsed flags: prints the table and a JSON line.

  Args:
    flag_values: flags defined by define_flags and parsed.

  Returns:
    evaluate_workdir's dict (also written to --output if given).
  """
  f = flag_values
  try:
    result = evaluate_workdir(
      f.workdir,
      f.data,
      step=f.step,
      max_docs=f.max_docs,
      batch_size=f.batch_size,
      seq_len=f.seq_len,
      stride=f.stride,
      doc_format=f.doc_format,
    )
  except (ValueError, FileNotFoundError, IsADirectoryError) as e:
    raise SystemExit(f'error: {e}') from None
  print(format_table(result))
  if f.output:
    workdir_lib.write_json(f.output, result)
  print(json.dumps(result, sort_keys=True))
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    # Orbax logs each restore at INFO; the table is the output.
    logging.set_verbosity(logging.WARNING)
  run(flags.FLAGS)


if __name__ == '__main__':
  define_flags()
  app.run(main)
