r"""XLNet pretraining (Yang et al., 2019): permutation language modelling.

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/xlnet.py:size=tiny \
      --workdir=/tmp/xlnet_tiny

Args: `size` is a key of SIZES['bert'] (tiny, mini, small, medium, base,
large); XLNet-Base and -Large have BERT's dimensions. `tiny` also shrinks
the vocabulary, batch and schedule for a laptop CPU and the bundled corpus.

Each row gets a random factorisation order; the last 1/K of it (K = 6, the
paper's partial prediction) is predicted with two-stream self-attention
(pretrain_lm.models.plm): the content stream is the encoder kept for
fine-tuning, the query stream predicts each target from the tokens before
it in the order. Post-LN, GELU, dropout 0.1, no LayerNorm on the
embeddings, full 512-token rows, AdamW (eps 1e-6, weight decay 0.01) with
linear decay, as XLNet. The schedule is BERT's (batch 256, lr 1e-4, 10k
warmup, 1M steps), the setting of XLNet's like-for-like comparison with
BERT (section 3.2); XLNet-Large itself used batch 8192, lr 4e-4, 40k
warmup, 500k steps.

What differs from XLNet: positions are T5's relative buckets
(model.position='relative'), a learned per-head bias on the bucketed
offset, where XLNet uses Transformer-XL's sinusoidal relative encoding
with content- and position-dependent terms. Relative rather than learned
absolute positions keep XLNet's design in which the query stream starts
from one position-free vector w (here [MASK]'s embedding) and learns where
its target is only through attention, and rows of any length work. There
is no segment recurrence (memory) and no relative segment encoding (BERT's
token-type embedding stays, all 0 in pretraining), rows are packed
documents rather than XLNet's two-segment inputs, and targets are single
tokens, not the n-gram spans of the released code.
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config


def get_config(arg=None):
  """The XLNet config for `arg` (e.g. 'size=base')."""
  arg = configlib.parse_arg(arg, size='base')
  c = configlib.base_config()
  c.model.family = 'plm'
  c.model.size = arg.size
  c.model.update(model_config.size_preset(arg.size))
  c.model.vocab_size = 32000  # XLNet's SentencePiece vocabulary
  c.model.norm_position = 'post'
  c.model.embed_norm = False  # XLNet feeds the embeddings in unnormalised
  c.model.activation = 'gelu'
  c.model.position = 'relative'
  c.model.relative_buckets = 32
  c.model.relative_max_distance = 128
  c.model.pooler = True  # a [CLS] summary for fine-tuning

  c.objective.name = 'plm'
  c.objective.plm_k = 6

  c.data.seq_len = 512
  c.data.batch_size = 256
  # Encoder-style rows: [CLS] doc [SEP] doc [SEP] ...
  c.data.packing = 'full_sentences'

  c.optimizer.learning_rate = 1e-4
  c.optimizer.eps = 1e-6
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 10_000
  c.optimizer.decay = 'linear'
  c.train.num_steps = 1_000_000

  if arg.size == 'tiny':
    configlib.laptop_schedule(c)
  return configlib.lock(c)
