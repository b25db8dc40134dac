r"""ELECTRA pretraining (Clark et al., 2020): replaced-token detection.

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/electra.py:size=tiny \
      --workdir=/tmp/electra_tiny

Args: `size` is a key of SIZES['electra'] (tiny, small, base, large), the
discriminator's body.

A generator (model.generator_width of the discriminator's width, heads and
MLP: 1/4 by default) and the discriminator share the token, position and
token-type embeddings (E wide: 128 for small, the hidden width otherwise).
The generator predicts 15% masked tokens (85% of them shown as [MASK], the
rest unchanged, as in the ELECTRA code), its samples replace them, and the
discriminator classifies every token; loss = MLM + 50 x discriminator loss
(objective.disc_weight). After pretraining the discriminator is the model.
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config


def get_config(arg=None):
  """The ELECTRA config for `arg` (e.g. 'size=small')."""
  arg = configlib.parse_arg(arg, size='small')
  c = configlib.base_config()
  c.model.family = 'electra'
  c.model.size = arg.size
  c.model.update(model_config.size_preset(arg.size, 'electra'))
  c.model.vocab_size = 30522
  c.model.embed_dim = 128 if arg.size == 'small' else 0
  c.model.generator_width = 0.25
  c.model.max_len = 512
  c.model.norm_position = 'post'

  c.objective.name = 'electra'
  c.objective.mask_rate = 0.25 if arg.size == 'large' else 0.15
  c.objective.mask_token_rate = 0.85
  c.objective.random_token_rate = 0.0
  c.objective.disc_weight = 50.0

  c.data.seq_len = 128 if arg.size == 'small' else 512
  c.data.batch_size = {'small': 128, 'base': 256}.get(arg.size, 2048)
  # Documents back to back, masked from each other (see configs/bert.py).
  c.data.packing = 'full_sentences'

  c.optimizer.learning_rate = {'small': 5e-4, 'base': 2e-4}.get(arg.size, 2e-4)
  c.optimizer.warmup_steps = 10_000
  c.optimizer.weight_decay = 0.01
  c.train.num_steps = 1_000_000 if arg.size != 'large' else 400_000

  if arg.size == 'tiny':
    configlib.laptop_schedule(c)
    c.model.generator_width = 0.5
  return configlib.lock(c)
