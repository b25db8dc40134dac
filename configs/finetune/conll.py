r"""Fine-tuning on CoNLL-2003 named-entity recognition (Tjong Kim Sang &
De Meulder, 2003) as token classification.

Run it (from the repository root), after pretraining an encoder:

  python -m pretrain_lm.finetune \
      --config=configs/finetune/conll.py:data=/data/conll2003 \
      --init=/tmp/bert_base --workdir=/tmp/bert_base_conll

Args: `data` is the folder holding train.txt, valid.txt and test.txt (or
CoNLL's eng.train, eng.testa, eng.testb). As in BERT's NER fine-tuning
(Devlin et al., 2019, section 5.3) each word's label goes on its first
sub-token, a dense layer classifies every token, and the other sub-tokens
are left out of the loss; lr 5e-5, batch 32, 3 epochs, rows of 128 tokens.
The metric is conlleval's entity-level F1 (percent). `task.tag_scheme`
('iob1' or 'iob2') converts tags as they are read; `task.labels` lists the
tag set for data other than CoNLL-2003's 9 NER tags.

`recipe` is `bert` (the above), `ulmfit`, `elmo` or `cove`, as in
configs/finetune/glue.py; with `elmo` and `cove` the frozen body's states
feed the per-token dense layer (CoVe: an encoder-decoder's encoder):

  --config=configs/finetune/conll.py:data=/data/conll2003,recipe=cove

Cross-view training (Clark et al., 2018) learns from untagged text too,
with the paper's four auxiliary views of an encoder (forward, backward,
future, past): `--config.cvt.unlabeled=SOURCE` (a data.source string, one
sentence of whitespace-separated words per line).
"""

from pretrain_lm import configlib
from pretrain_lm.finetune import config as finetune_config


def get_config(arg=None):
  """The CoNLL fine-tuning config for `arg` (e.g. 'data=DIR')."""
  arg = configlib.parse_arg(arg, data='', recipe='bert')
  c = finetune_config.base_config()
  c.task.name = 'conll'
  c.task.data_dir = arg.data
  c.task.seq_len = 128
  c.task.label_column = -1  # the NER column
  c.task.tag_scheme = ''  # as in the files; 'iob1' or 'iob2' converts
  # ConfigDict needs a typed default; () means CoNLL-2003's tags.
  c.task.labels = ()

  c.optimizer.learning_rate = 5e-5
  c.train.num_epochs = 3
  c.data.batch_size = 32
  finetune_config.apply_recipe(c, arg.recipe)
  return configlib.lock(c)
