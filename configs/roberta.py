r"""RoBERTa pretraining (Liu et al., 2019): BERT's model, a better recipe.

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/roberta.py:size=tiny \
      --workdir=/tmp/roberta_tiny --config.train.num_steps=300

Args: `size` as in configs/bert.py.

Differences from configs/bert.py, as in the paper: no next-sentence
prediction; FULL-SENTENCES packing (rows filled with whole documents back to
back, a separator between documents) at length 512; dynamic masking; batch 8k
sequences with peak lr 6e-4 (base) / 4e-4 (large), Adam b2 0.98, warmup 24k
(base) / 30k (large) over 500k steps; a 50k byte-level BPE vocabulary (here a
SentencePiece BPE model trained on the data, or RoBERTa's own kind with
`--config.data.tokenizer_type=byte_bpe`: GPT-2's byte-level encoding and
RoBERTa's <s> </s> <pad> <unk> <mask>, exported as a RobertaTokenizer). One
deviation: a token here attends only to its own document within a packed
row (segment ids, as in T5X), where RoBERTa let documents of one row see
each other.
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config


def get_config(arg=None):
  """The RoBERTa config for `arg` (e.g. 'size=base')."""
  arg = configlib.parse_arg(arg, size='base')
  c = configlib.base_config()
  c.model.family = 'encoder'
  c.model.size = arg.size
  c.model.update(model_config.size_preset(arg.size))
  c.model.vocab_size = 50265
  c.model.max_len = 514  # RoBERTa's table has 2 extra rows (fairseq offset)
  c.model.type_vocab_size = 1
  c.model.layer_norm_eps = 1e-5

  c.model.pooler = True

  c.objective.name = 'mlm'

  # SentencePiece has a TF op; byte_bpe encodes in Python inside tf.data
  # (one core, under the GIL), a bottleneck for raw text at this batch size
  # (a prepared corpus is encoded once, offline).
  c.data.tokenizer_type = 'bpe'
  c.data.seq_len = 512
  c.data.batch_size = 8192

  large = arg.size == 'large'
  c.optimizer.learning_rate = 4e-4 if large else 6e-4
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.98
  c.optimizer.eps = 1e-6
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 30_000 if large else 24_000
  c.train.num_steps = 500_000

  if arg.size == 'tiny':
    configlib.laptop_schedule(c)
    c.data.batch_size = 64  # RoBERTa's larger batch, scaled down
  return configlib.lock(c)
