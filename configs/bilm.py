r"""A bidirectional LM in the manner of ELMo (Peters et al., 2018).

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/bilm.py:size=tiny \
      --workdir=/tmp/bilm_tiny

Args: `size` is a key of SIZES['gpt2'] (tiny, small, medium, large, xl);
each of the two stacks has that many layers. `tiny` trains in minutes on a
laptop CPU with the bundled WikiText-2 corpus (configlib.laptop_schedule).

What follows ELMo: a forward LM and a backward LM trained jointly on the
sum of their log-likelihoods, with separate layers per direction but one
token representation and one output softmax shared by both; the model
returns every layer's forward and backward states (`layer_states`) for
ELMo's task-specific weighted mix of layers. What differs: each direction
is a GPT-2-style pre-LN causal Transformer stack (learned positions,
tanh-GELU, scaled residual init) instead of a 2-layer LSTM with
projections, and tokens are BPE pieces embedded by a table instead of a
character CNN over words; documents are packed GPT-style ('concat') rather
than read as shuffled sentences. The optimizer is gpt.py's (GPT-3's
small-model AdamW recipe).
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config


def get_config(arg=None):
  """The bilm config for `arg` (e.g. 'size=small')."""
  arg = configlib.parse_arg(arg, size='small')
  c = configlib.base_config()
  c.model.family = 'bilm'
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

  c.objective.name = 'bilm'

  c.data.tokenizer_type = 'bpe'
  c.data.packing = 'concat'
  c.data.seq_len = 1024
  c.data.batch_size = 512

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
    configlib.laptop_schedule(c)
  return configlib.lock(c)
