r"""Generative text-to-text fine-tuning of a decoder (GPT) or an
encoder-decoder (T5, BART), scored on decoded dev outputs.

Run it (from the repository root), after pretraining e.g. configs/t5.py or
configs/gpt.py:

  python -m pretrain_lm.finetune --config=configs/finetune/text2text.py \
      --init=/tmp/t5_tiny --workdir=/tmp/t5_tiny_headings

Args (after the colon, comma-separated): `data` is a folder holding
train.tsv and dev.tsv (`input<TAB>target` lines) or train.jsonl and
dev.jsonl (`{"input": ..., "target": ...}` lines), local or gs://; empty,
the bundled default: WikiText-2 section headings generated from their
section's first paragraph (train on valid.txt's sections, dev on test.txt's;
pretrain_lm.finetune.text2text.heading_examples). `metric` picks the best
checkpoint: rouge (ROUGE-L), rouge1, rouge2, bleu, exact_match or f1.
`num_beams` (1: greedy search), `length_penalty` (GNMT's alpha for beam
search) and `max_new_tokens` set the decoding of the dev inputs.

The body's own language-model head, restored from pretraining, is the
head: token-level cross-entropy on the target tokens only (a decoder's
input tokens and all padding are masked out). AdamW at lr 1e-4, between
BART's summarisation runs (3e-5) and T5's constant Adafactor 1e-3, with
BERT's warmup and linear decay; batch 16, 5 epochs, inputs of 128 tokens,
targets of 16 (with [SEP]). Every evaluation writes its decoded texts to
the workdir's predictions_<step>.jsonl. Dropout is the body's pretraining
one (head.dropout is unused); init.random_init=True is the from-scratch
baseline on the same architecture and tokenizer.
"""

from pretrain_lm import configlib
from pretrain_lm.finetune import config as finetune_config


def get_config(arg=None):
  """The text-to-text config for `arg` (e.g. 'data=DIR,metric=bleu')."""
  arg = configlib.parse_arg(
    arg,
    data='',
    metric='rouge',
    num_beams=1,
    length_penalty=0.6,
    max_new_tokens=16,
  )
  c = finetune_config.base_config()
  c.task.name = 'text2text'
  c.task.data_dir = arg.data
  c.task.metric = arg.metric
  c.task.seq_len = 128
  c.task.target_len = 16  # target tokens with the closing [SEP]
  c.task.max_new_tokens = arg.max_new_tokens
  c.task.num_beams = arg.num_beams
  c.task.length_penalty = arg.length_penalty

  c.optimizer.learning_rate = 1e-4
  c.train.num_epochs = 5
  c.data.batch_size = 16
  return configlib.lock(c)
