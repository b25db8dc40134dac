r"""T5 encoder-decoder (Raffel et al., 2020), v1.0 or v1.1 layout.

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/t5.py:size=tiny \
      --workdir=/tmp/t5_tiny

Args: `size` is a key of SIZES['t5'] (tiny, small, base, large); `v1_1`
switches to T5 v1.1 (SIZES['t5_v1_1'], GeGLU, untied output layer, no
dropout in pretraining).

Both layouts: pre-LN RMSNorm without bias, no biases anywhere, relative
position buckets (32 buckets, max distance 128) learned once per stack,
token table shared by encoder and decoder. v1.0 uses ReLU and a tied output
layer: 60.5M parameters for small and 222.9M for base with the 32,128 vocab;
v1.1 base has 247.6M.

The objective is the paper's span corruption (`span_corruption`): 15% of
the tokens are noise, in spans of mean length 3, so rows of 568 raw tokens
become 512 encoder inputs and at most 114 targets; 100 sentinel ids are
kept out of the tokenizer's vocabulary. The optimizer is T5's Adafactor
(factored second moments, update clipping at RMS 1, parameter-scaled
steps, no momentum, no weight decay or global-norm clipping) at 0.01 for
10k steps, then 1/sqrt(step) (`optimizer.decay='rsqrt'`); the 10k steps
ramp up linearly here where T5 held 0.01.
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config


def get_config(arg=None):
  """The T5 config for `arg` (e.g. 'size=base,v1_1')."""
  arg = configlib.parse_arg(arg, size='base', v1_1=False)
  c = configlib.base_config()
  c.model.family = 'encoder_decoder'
  c.model.size = arg.size
  table = 't5_v1_1' if arg.v1_1 else 't5'
  c.model.update(model_config.size_preset(arg.size, table))
  c.model.vocab_size = 32128
  c.model.type_vocab_size = 0
  c.model.norm_type = 'rmsnorm'
  c.model.norm_position = 'pre'
  c.model.embed_norm = False
  c.model.layer_norm_eps = 1e-6
  c.model.position = 'relative'
  c.model.relative_buckets = 32
  c.model.relative_max_distance = 128
  c.model.attention_bias = False
  c.model.mlp_bias = False
  c.model.activation = 'relu'
  c.model.tie_embeddings = True
  c.model.dropout_rate = 0.1
  c.model.attention_dropout_rate = 0.1
  c.model.initializer_range = 0.05
  if arg.v1_1:
    c.model.activation = 'geglu'
    c.model.tie_embeddings = False
    c.model.dropout_rate = 0.0
    c.model.attention_dropout_rate = 0.0

  c.objective.name = 'span_corruption'
  c.objective.noise_density = 0.15
  c.objective.mean_span_length = 3.0
  c.objective.num_sentinels = 100

  c.data.packing = 'concat'
  c.data.seq_len = 512
  c.data.batch_size = 128

  c.optimizer.name = 'adafactor'
  c.optimizer.learning_rate = 1e-2
  c.optimizer.warmup_steps = 10_000
  c.optimizer.decay = 'rsqrt'
  c.optimizer.weight_decay = 0.0
  c.optimizer.grad_clip_norm = 0.0
  c.train.num_steps = 524_288  # 2^19, T5's pretraining length

  if arg.size == 'tiny':
    configlib.laptop_schedule(c)
    # Adafactor's steps are relative to each weight's scale: 1e-2, not 1e-3.
    c.optimizer.learning_rate = 1e-2
  return configlib.lock(c)
