r"""Writes the bundled SST-2 as a text-to-text task: sentence -> label word.

  .venv/bin/python experiments/text2text_sst2.py /tmp/t2t/sst2

The folder gets train.tsv (the 8,000 bundled training sentences) and
dev.tsv (the 872 dev sentences), `input<TAB>target` lines under an
`input<TAB>target` header, the target 'negative' or 'positive' (T5's
label words for SST-2, Raffel et al., 2020, appendix D), for
`configs/finetune/text2text.py:data=DIR,metric=exact_match`
(experiments/text2text.md).
"""

import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pretrain_lm.finetune import glue  # noqa: E402

WORDS = {'0': 'negative', '1': 'positive'}


def convert(source: str, dest: str) -> int:
  """One bundled SST-2 TSV -> input/target TSV; returns the example count."""
  with open(source, newline='') as f:
    rows = list(csv.DictReader(f, delimiter='\t', quoting=csv.QUOTE_NONE))
  with open(dest, 'w') as f:
    f.write('input\ttarget\n')
    for row in rows:
      # The bundled dev file names its text column 'content', train
      # 'sentence' (glue.PRESETS['sst2'].text_a).
      text = row.get('sentence') or row['content']
      f.write(f'{" ".join(text.split())}\t{WORDS[row["label"]]}\n')
  return len(rows)


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    raise SystemExit(f'usage: {argv[0]} OUTPUT_DIR')
  os.makedirs(argv[1], exist_ok=True)
  for split in ('train', 'dev'):
    dest = os.path.join(argv[1], f'{split}.tsv')
    n = convert(os.path.join(glue.BUNDLED_SST2, f'{split}.tsv'), dest)
    print(f'{dest}: {n} examples')


if __name__ == '__main__':
  main(sys.argv)
