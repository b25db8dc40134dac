r"""BERT pretraining with masked-language modelling (Devlin et al., 2019).

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/bert.py:size=tiny \
      --workdir=/tmp/bert_tiny --config.train.num_steps=300

Args (after the colon, comma-separated): `size` is a key of
pretrain_lm.models.config.SIZES (tiny, mini, small, medium, base, large).
`tiny` also shrinks the vocabulary, batch and schedule so that it trains in
a few minutes on a laptop CPU with the bundled WikiText-2 corpus.

The recipe is BERT's: AdamW (lr 1e-4, b1 0.9, b2 0.999, eps 1e-6, weight decay
0.01 on all but biases and LayerNorm), 10k warmup steps then linear decay to
zero, dropout 0.1, GELU, post-LN, MLM head tied to the token embedding, 15% of
tokens predicted (80% [MASK] / 10% random / 10% kept). Unlike the reference
code, masks are drawn on the fly each epoch (RoBERTa's dynamic masking), and
the loss is MLM alone (no next-sentence prediction). Rows never cross a
document boundary (`data.packing='doc_sentences'`).
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config


def get_config(arg=None):
  """The BERT config for `arg` (e.g. 'size=base')."""
  arg = configlib.parse_arg(arg, size='base')
  c = configlib.base_config()
  c.model.family = 'encoder'
  c.model.size = arg.size
  c.model.update(model_config.size_preset(arg.size))
  c.model.vocab_size = 30522  # the size of BERT's uncased WordPiece vocab
  c.model.max_len = 512
  c.model.norm_position = 'post'
  c.model.activation = 'gelu'

  c.model.pooler = True  # BERT's tanh pooler (used by NSP and fine-tuning)

  c.objective.name = 'mlm'

  # BERT trained 90% of steps at length 128, batch 256 (and the rest at 512).
  c.data.seq_len = 128
  c.data.batch_size = 256
  # BERT's rows hold text from one document only.
  c.data.packing = 'doc_sentences'

  c.optimizer.learning_rate = 1e-4
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 10_000
  c.train.num_steps = 1_000_000

  if arg.size == 'tiny':
    configlib.laptop_schedule(c)
  return configlib.lock(c)
