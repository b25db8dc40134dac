r"""Converts checkpoints between Hugging Face's layout and workdirs.

  python -m pretrain_lm.convert import --from=hf --src=bert-dir \
      --workdir=/tmp/bert [--vocab_multiple=128]
  python -m pretrain_lm.convert export --to=hf --workdir=/tmp/bert \
      --dst=/tmp/bert-hf [--step=N] [--model_type=bert] \
      [--architecture=BertForMaskedLM]

`src` and `dst` hold config.json, model.safetensors and the tokenizer
files (vocab.txt, vocab.json + merges.txt, or a SentencePiece .model).
"""

from absl import app, flags, logging

COMMANDS = ('import', 'export')
FORMATS = ('hf',)

flags.DEFINE_enum('from', 'hf', FORMATS, 'import: the source format.')
flags.DEFINE_enum('to', 'hf', FORMATS, 'export: the target format.')
flags.DEFINE_string('src', None, 'import: the Hugging Face model directory.')
flags.DEFINE_string('workdir', None, 'The pretrain_lm workdir.')
flags.DEFINE_string('dst', None, 'export: the directory to write.')
flags.DEFINE_integer('step', None, 'export: the step (default: the latest).')
flags.DEFINE_string(
  'model_type',
  None,
  "export: the HF model_type ('bert', 'roberta', 'gpt2', 't5', 'bart'); "
  "default: the imported one, else the family's.",
)
flags.DEFINE_string(
  'architecture',
  None,
  'export: the HF class whose layout to write (e.g. BertForMaskedLM); '
  "default: the imported one, else the model type's LM class.",
)
flags.DEFINE_integer(
  'vocab_multiple',
  1,
  "import: the workdir's model.vocab_multiple (its token table padded to a "
  'multiple of this many rows; 128 on GPUs).',
)
FLAGS = flags.FLAGS


def main(argv):
  """Runs `import` or `export` (argv[1]) with the flags; see the docstring.

  Args:
    argv: the command line left after absl's flag parsing: the command.
  """
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(
      f'Usage: python -m pretrain_lm.convert {{{"|".join(COMMANDS)}}} '
      '--workdir=... (--src=... | --dst=...)'
    )
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  command = argv[1]
  needed = ('src', 'workdir') if command == 'import' else ('workdir', 'dst')
  missing = [f'--{name}' for name in needed if not FLAGS[name].value]
  if missing:
    raise app.UsageError(f'{command} needs {" and ".join(missing)}.')

  # JAX/TF import is slow: flags first.
  from pretrain_lm.convert import from_hf, to_hf

  try:
    if command == 'import':
      record = from_hf.import_hf(
        FLAGS.src, FLAGS.workdir, vocab_multiple=FLAGS.vocab_multiple
      )
      print(
        f'Imported {record["architecture"]} ({record["model_type"]}) from '
        f'{record["source"]} into {FLAGS.workdir} (step 0).'
      )
      if record['initialised']:
        print(
          f'Freshly initialised (not in the source): {record["initialised"]}'
        )
      print(
        'Load it in Python:\n  import pretrain_lm\n'
        f'  m = pretrain_lm.load({FLAGS.workdir!r})'
      )
    else:
      config = to_hf.export_hf(
        FLAGS.workdir,
        FLAGS.dst,
        step=FLAGS.step,
        model_type=FLAGS.model_type,
        architecture=FLAGS.architecture,
      )
      print(
        f'Wrote {config["architectures"][0]} ({config["model_type"]}) to '
        f'{FLAGS.dst}.'
      )
  except (ValueError, FileNotFoundError, FileExistsError) as e:
    raise SystemExit(f'error: {e}') from None


if __name__ == '__main__':
  app.run(main)
