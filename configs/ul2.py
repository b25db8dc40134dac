r"""UL2: a mixture of denoisers (Tay et al., 2022), encoder-decoder or decoder.

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/ul2.py:size=tiny \
      --workdir=/tmp/ul2_tiny
  python -m pretrain_lm.main --config=configs/ul2.py:size=tiny,decoder \
      --workdir=/tmp/ul2_decoder_tiny

Args: `size` is a key of SIZES['t5_v1_1'] (tiny, small, base, large;
default base), or with `decoder` of SIZES['gpt2'] (tiny, small, medium,
large, xl; default small).

The objective is the paper's seven denoisers (section 3.1.2, Table 1),
written mode:mean_span:density:weight: R-denoisers (T5 span corruption)
with mean spans 3 and 8 at 15% noise; one S-denoiser, a prefix LM whose
target is on average 25% of the row; X-denoisers with mean spans 3 and 8
at 50% noise and 64 at 15% and 50%. Each row draws one of them with equal
weight, and its inputs start with the paradigm token [NLU], [S2S] or
[NLG] (mode switching). Change the mix with --config.objective.denoisers,
e.g. a larger S weight for a more LM-like model.

The encoder-decoder (objective `ul2`) has T5 v1.1's layout, as t5.py's
v1_1: pre-LN RMSNorm, no biases, relative position buckets, GeGLU, an
untied output layer, no dropout. Its encoder reads data.seq_len = 512
tokens; the decoder length is the longest target of the mixture (342
here, from the X-denoiser with spans of 3 at 50% noise), and rows hold 511
raw tokens so that every denoiser's inputs fit. `decoder` trains UL2's
decoder-only variant (objective `ul2_decoder`) on a GPT-2 body: one
sequence [mode] inputs [SEP] targets [SEP] of 512 tokens, the inputs read
bidirectionally (a prefix LM), only the targets predicted; like the T5 v1.1
layout it has no dropout in pretraining.

Both keep T5's SentencePiece vocabulary of 32,128 ids, 100 sentinels and
the three paradigm tokens reserved, and t5.py's schedule and optimizer
(batch 128 of 512 tokens, 2^19 steps, Adafactor at 0.01 then 1/sqrt(step)).
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config

# Table 1 of the paper: R (3, 15%), (8, 15%); S (25%); X (3, 50%),
# (8, 50%), (64, 15%), (64, 50%).
DENOISERS = (
  'R:3:0.15:1,R:8:0.15:1,S:0:0.25:1,X:3:0.5:1,X:8:0.5:1,X:64:0.15:1,X:64:0.5:1'
)


def get_config(arg=None):
  """The UL2 config for `arg` (e.g. 'size=base' or 'size=small,decoder')."""
  arg = configlib.parse_arg(arg, size='', decoder=False)
  c = configlib.base_config()
  size = arg.size or ('small' if arg.decoder else 'base')
  c.model.size = size
  c.model.vocab_size = 32128
  c.model.type_vocab_size = 0
  if arg.decoder:
    _gpt2_decoder(c, size)
    c.objective.name = 'ul2_decoder'
  else:
    _t5_v1_1(c, size)
    c.objective.name = 'ul2'
  c.objective.denoisers = DENOISERS
  c.objective.num_sentinels = 100

  c.data.packing = 'concat'
  c.data.seq_len = 512
  c.data.batch_size = 128

  # T5's Adafactor (configs/t5.py says which settings).
  c.optimizer.name = 'adafactor'
  c.optimizer.learning_rate = 1e-2
  c.optimizer.warmup_steps = 10_000
  c.optimizer.decay = 'rsqrt'
  c.optimizer.weight_decay = 0.0
  c.optimizer.grad_clip_norm = 0.0
  c.train.num_steps = 524_288  # 2^19, T5's pretraining length

  if size == 'tiny':
    configlib.laptop_schedule(c)
    # Adafactor's steps are relative to each weight's scale: 1e-2, not 1e-3.
    c.optimizer.learning_rate = 1e-2
  return configlib.lock(c)


def _t5_v1_1(c, size: str) -> None:
  """T5 v1.1's encoder-decoder (as configs/t5.py with v1_1)."""
  c.model.family = 'encoder_decoder'
  c.model.update(model_config.size_preset(size, 't5_v1_1'))
  c.model.norm_type = 'rmsnorm'
  c.model.norm_position = 'pre'
  c.model.embed_norm = False
  c.model.layer_norm_eps = 1e-6
  c.model.position = 'relative'
  c.model.relative_buckets = 32
  c.model.relative_max_distance = 128
  c.model.attention_bias = False
  c.model.mlp_bias = False
  c.model.activation = 'geglu'
  c.model.tie_embeddings = False
  c.model.dropout_rate = 0.0
  c.model.attention_dropout_rate = 0.0
  c.model.initializer_range = 0.05


def _gpt2_decoder(c, size: str) -> None:
  """GPT-2's decoder (as configs/gpt.py): learned positions, pre-LN."""
  c.model.family = 'decoder'
  c.model.update(model_config.size_preset(size, 'gpt2'))
  c.model.max_len = 1024
  c.model.activation = 'gelu_tanh'
  c.model.norm_position = 'pre'
  c.model.embed_norm = False
  c.model.layer_norm_eps = 1e-5
  c.model.scaled_residual_init = True
  c.model.dropout_rate = 0.0
  c.model.attention_dropout_rate = 0.0
