r"""Fine-tuning on SQuAD v1.1 / v2.0 span extraction (Rajpurkar et al.).

Run it (from the repository root), after pretraining an encoder:

  python -m pretrain_lm.finetune \
      --config=configs/finetune/squad.py:data=/data/squad \
      --init=/tmp/bert_base --workdir=/tmp/bert_base_squad

Args: `data` is the folder holding train-v1.1.json and dev-v1.1.json (or
the -v2.0 files with `version=2`). The recipe is BERT's (Devlin et al., 2019,
sections 4.2-4.3; rows, stride and search from its run_squad.py): rows of 384
tokens, questions cut to 64, a 128-token document stride, start/end logits
from one dense layer on every token, lr 5e-5, batch 32 for 3 epochs (v1.1)
or batch 48 for 2 epochs (v2.0), answers of at most 30 tokens from the 20
best starts and ends. v2.0 answers
'' when the [CLS] no-answer score beats the best span by more than
task.null_score_diff_threshold. Metrics are the official scripts' exact match
and F1 (percent); F1 picks the best checkpoint.
"""

from pretrain_lm import configlib
from pretrain_lm.finetune import config as finetune_config


def get_config(arg=None):
  """The SQuAD fine-tuning config for `arg` (e.g. 'data=DIR,version=2')."""
  arg = configlib.parse_arg(arg, data='', version=1)
  if arg.version not in (1, 2):
    raise ValueError(f'Config arg version={arg.version}; valid: 1, 2.')
  c = finetune_config.base_config()
  c.task.name = 'squad'
  c.task.data_dir = arg.data
  c.task.version_2 = arg.version == 2
  c.task.seq_len = 384
  c.task.max_query_len = 64
  c.task.doc_stride = 128
  c.task.n_best = 20
  c.task.max_answer_len = 30
  c.task.null_score_diff_threshold = 0.0

  c.optimizer.learning_rate = 5e-5
  c.train.num_epochs = 2 if c.task.version_2 else 3
  c.data.batch_size = 48 if c.task.version_2 else 32
  return configlib.lock(c)
