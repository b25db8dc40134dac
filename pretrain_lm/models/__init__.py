"""Model families by name: `MODELS[config.model.family](ModelConfig)`."""

from pretrain_lm.models.config import SIZES, ModelConfig
from pretrain_lm.models.encoder import EncoderModel

# The decoder and encoder-decoder families join this dict.
MODELS = {
  'encoder': EncoderModel,
}

__all__ = ['MODELS', 'SIZES', 'ModelConfig']
