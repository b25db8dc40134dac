r"""BART encoder-decoder (Lewis et al., 2020).

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/bart.py:size=tiny \
      --workdir=/tmp/bart_tiny

Args: `size` is a key of SIZES['bart'] (tiny, base, large).

The architecture is BART's: post-LN with a LayerNorm on each stack's
embeddings, GELU, learned positions (1024) per stack, biases throughout,
one token table for the encoder, the decoder and the tied output layer;
`base` (6 + 6 layers, width 768) has 139.4M parameters with the 50,265
vocab.

The objective is BART's denoising (`denoising`) in BART-large's setting
(section 5.1): 30% of the tokens infilled in spans, each span one [MASK],
and every sentence permuted. Span lengths are Poisson(3.5), as in the
released BART-large recipe (section 2.2's text says lambda = 3), which also
turns 10% of the spans into a random token (infill_random_rate). Rows are
packed 'full_sentences' ([CLS] doc [SEP] doc [SEP] ...), each one sample,
as the paper's complete-document blocks. Other noises are a rate away,
e.g. document rotation alone: --config.objective.rotate_rate=1.0
--config.objective.infill_rate=0 --config.objective.permute_sentences=0.
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config


def get_config(arg=None):
  """The BART config for `arg` (e.g. 'size=base')."""
  arg = configlib.parse_arg(arg, size='base')
  c = configlib.base_config()
  c.model.family = 'encoder_decoder'
  c.model.size = arg.size
  c.model.update(model_config.size_preset(arg.size, 'bart'))
  c.model.vocab_size = 50265
  c.model.max_len = 1024
  c.model.type_vocab_size = 0
  c.model.norm_position = 'post'
  c.model.embed_norm = True
  c.model.layer_norm_eps = 1e-5
  c.model.activation = 'gelu'
  c.model.tie_embeddings = True
  c.model.dropout_rate = 0.1
  c.model.attention_dropout_rate = 0.0

  c.objective.name = 'denoising'
  c.objective.infill_rate = 0.3
  c.objective.poisson_lambda = 3.5
  c.objective.infill_random_rate = 0.1
  c.objective.permute_sentences = 1.0
  c.objective.rotate_rate = 0.0
  c.objective.delete_rate = 0.0
  c.objective.token_mask_rate = 0.0

  c.data.tokenizer_type = 'bpe'
  c.data.packing = 'full_sentences'
  c.data.seq_len = 512
  c.data.batch_size = 8192  # BART: 8,000 sequences of 512, as RoBERTa

  c.optimizer.learning_rate = 4e-4
  c.optimizer.b2 = 0.98
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 10_000
  c.train.num_steps = 500_000

  if arg.size == 'tiny':
    configlib.laptop_schedule(c)
  return configlib.lock(c)
