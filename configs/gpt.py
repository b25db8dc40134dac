r"""GPT-2 pretraining with next-token prediction (Radford et al., 2019).

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/gpt.py:size=tiny \
      --workdir=/tmp/gpt_tiny

Args: `size` is a key of SIZES['gpt2'] (tiny, small, medium, large, xl);
`objective` is 'clm' (every next token, the default) or 'prefix_lm'
(each document's first part is read bidirectionally and only the rest is
predicted; Raffel et al. 2020, §3.2.2):

  --config=configs/gpt.py:size=tiny,objective=prefix_lm

The architecture is GPT-2's: pre-LN with a final LayerNorm, learned
positions (1024), tanh-GELU, residual projections initialised with
std 0.02 / sqrt(2 * layers), output logits tied to the token embedding,
and no token types; `small` has 124M parameters with the 50,257 vocab.
The tokenizer trained on the data is SentencePiece BPE;
`--config.data.tokenizer_type=byte_bpe` trains GPT-2's byte-level BPE
instead (with RoBERTa's specials, </s> ending each document).

`tiny` is nanoGPT's CPU recipe on Shakespeare (experiments/shakespeare_char):
character tokens, 4 layers, 4 heads, width 128, context 64, batch 12, 2000
steps, AdamW lr 1e-3 (100 warmup steps, cosine to 1e-4), b2 0.99, weight
decay 0.1, clipping 1.0, no dropout and no biases; first 90% of the text for
training, the last 10% for validation.
"""

import os

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config

# The decoder objectives this file can pick (`objective=`).
OBJECTIVES = ('clm', 'prefix_lm')


def get_config(arg=None):
  """The GPT config for `arg` (e.g. 'size=small')."""
  arg = configlib.parse_arg(arg, size='small', objective='clm')
  if arg.objective not in OBJECTIVES:
    raise ValueError(
      f'Config arg objective={arg.objective!r}; valid: {list(OBJECTIVES)}.'
    )
  c = configlib.base_config()
  c.model.family = 'decoder'
  c.model.size = arg.size
  c.model.update(model_config.size_preset(arg.size, 'gpt2'))
  c.model.vocab_size = 50257
  c.model.max_len = 1024
  c.model.type_vocab_size = 0
  c.model.activation = 'gelu_tanh'
  c.model.norm_position = 'pre'
  c.model.embed_norm = False
  c.model.layer_norm_eps = 1e-5
  c.model.scaled_residual_init = True
  c.model.dropout_rate = 0.1
  c.model.attention_dropout_rate = 0.1

  c.objective.name = arg.objective

  # Not byte_bpe: it encodes in Python inside tf.data (configs/roberta.py).
  c.data.tokenizer_type = 'bpe'
  c.data.packing = 'concat'
  c.data.seq_len = 1024
  c.data.batch_size = 512

  # GPT-3's small-model recipe (GPT-2's paper gives no optimizer details).
  c.optimizer.learning_rate = 6e-4
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.1
  c.optimizer.warmup_steps = 2000
  c.optimizer.decay = 'cosine'
  c.optimizer.final_learning_rate = 6e-5
  c.train.num_steps = 600_000

  if arg.size == 'tiny':
    nanogpt_shakespeare_char(c)
  return configlib.lock(c)


def nanogpt_shakespeare_char(c) -> None:
  """nanoGPT's CPU Shakespeare recipe (its README reports val loss 1.88)."""
  text = os.path.join(configlib.CORPUS_DIR, 'tinyshakespeare', 'input.txt')
  c.data.source = text + '[:90%]'
  c.data.eval_source = text + '[90%:]'
  c.data.doc_format = 'file'
  c.data.tokenizer_type = 'char'
  c.model.vocab_size = 128  # >= the 65 characters + 5 special tokens
  c.model.max_len = 64
  c.model.dropout_rate = 0.0
  c.model.attention_dropout_rate = 0.0
  c.model.attention_bias = False
  c.model.mlp_bias = False
  c.data.seq_len = 64
  c.data.batch_size = 12
  c.data.shuffle_buffer = 20_000  # every row of the 1 MB text
  c.data.eval_batches = 20
  c.optimizer.learning_rate = 1e-3
  c.optimizer.final_learning_rate = 1e-4
  c.optimizer.b2 = 0.99
  c.optimizer.warmup_steps = 100
  c.optimizer.weight_decay = 0.1
  c.optimizer.grad_clip_norm = 1.0
  c.train.num_steps = 2000
  c.train.log_every = 100
  c.train.eval_every = 250
  c.checkpoint.every = 500
