r"""ALBERT pretraining (Lan et al., 2020): factorised embedding, shared layers.

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/albert.py:size=tiny \
      --workdir=/tmp/albert_tiny

Args: `size` is a key of SIZES['albert'] (tiny, base, large, xlarge);
`objective` is `sop` (the default, the paper's MLM + sentence-order
prediction) or `mlm` (MLM alone).

The architecture is BERT's post-LN encoder with ALBERT's two parameter
savers: a 128-wide token table projected to the hidden width (E=128 ->
H=768 for base), and one set of layer weights applied at every layer;
`base` has 11.7M parameters (body and pooler) with the 30,000 vocab. The
MLM head maps back to E and is tied to the table.

The loss is the paper's: MLM + sentence-order prediction. Each row holds
one document piece (`doc_sentences` packing), split at a random token into
A and B; half the time they swap places, and a classifier on the pooled
[CLS] says whether they did. The optimizer is the paper's LAMB (lr
0.00176, batch 4096; AdamW for `tiny`). Not implemented: ALBERT's n-gram
masking (spans of 1-3 words; the MLM here masks single tokens).
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config


def get_config(arg=None):
  """The ALBERT config for `arg` (e.g. 'size=base')."""
  arg = configlib.parse_arg(arg, size='base', objective='sop')
  if arg.objective not in ('sop', 'mlm'):
    raise ValueError(
      f"Config arg objective={arg.objective!r}; valid: ['sop', 'mlm']."
    )
  c = configlib.base_config()
  c.model.family = 'encoder'
  c.model.size = arg.size
  c.model.update(model_config.size_preset(arg.size, 'albert'))
  c.model.vocab_size = 30000
  c.model.embed_dim = 128
  c.model.share_layers = True
  c.model.pooler = True
  c.model.max_len = 512
  c.model.activation = 'gelu_tanh'  # ALBERT's gelu_new
  c.model.norm_position = 'post'
  # ALBERT v2 drops dropout: it found it hurts large-batch pretraining.
  c.model.dropout_rate = 0.0
  c.model.attention_dropout_rate = 0.0

  c.objective.name = 'mlm'
  if arg.objective == 'sop':
    c.objective.sentence_task = 'sop'  # on the pooler's [CLS] output

  c.data.seq_len = 512
  c.data.batch_size = 4096
  c.data.packing = 'doc_sentences'

  c.optimizer.name = 'lamb'
  c.optimizer.learning_rate = 0.00176
  c.optimizer.warmup_steps = 3125
  c.optimizer.weight_decay = 0.01
  c.train.num_steps = 125_000

  if arg.size == 'tiny':
    configlib.laptop_schedule(c)
    c.model.embed_dim = 64
    # LAMB's steps are ~lr relative to each weight: too slow for a laptop's
    # 300 steps at its batch of 32, where AdamW does well.
    c.optimizer.name = 'adamw'
  return configlib.lock(c)
