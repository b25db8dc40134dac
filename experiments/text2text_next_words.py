r"""Writes a text-to-text task from the bundled WikiText-2 test file: the
first half of a sentence -> its next four words.

  .venv/bin/python experiments/text2text_next_words.py /tmp/t2t/next_words

The pretraining corpus of the quickstart is WikiText-2's valid.txt; these
sentences come from test.txt, which pretraining never reads. Each sentence
of 10-40 words (lines split at ' . ', headings and blank lines skipped)
whose next four words hold no '<unk>' becomes one example: the input is
its first half (at most 20 words), the target the four words after it.
The first 80% of the sentences in file order go to train.tsv, the rest to
dev.tsv (`input<TAB>target` lines under a header), for
`configs/finetune/text2text.py:data=DIR,metric=f1` (experiments/text2text.md).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pretrain_lm.finetune import text2text  # noqa: E402

TARGET_WORDS = 4


def examples(path: str) -> list[tuple[str, str]]:
  """(first half, next four words) of each usable sentence, in file order."""
  out = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      line = line.strip()
      if not line or line.startswith('='):
        continue
      for sentence in line.split(' . '):
        words = sentence.split()
        if not 10 <= len(words) <= 40:
          continue
        half = len(words) // 2
        target = words[half : half + TARGET_WORDS]
        if '<unk>' in target:
          continue
        out.append(
          (' '.join(words[max(0, half - 20) : half]), ' '.join(target))
        )
  return out


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    raise SystemExit(f'usage: {argv[0]} OUTPUT_DIR')
  rows = examples(os.path.join(text2text.BUNDLED_WIKITEXT, 'test.txt'))
  cut = len(rows) * 4 // 5
  os.makedirs(argv[1], exist_ok=True)
  for split, part in (('train', rows[:cut]), ('dev', rows[cut:])):
    dest = os.path.join(argv[1], f'{split}.tsv')
    with open(dest, 'w', encoding='utf-8') as f:
      f.write('input\ttarget\n')
      f.writelines(f'{a}\t{b}\n' for a, b in part)
    print(f'{dest}: {len(part)} examples')


if __name__ == '__main__':
  main(sys.argv)
