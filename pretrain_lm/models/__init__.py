"""Model families by name: `MODELS[config.model.family](ModelConfig)`."""

from pretrain_lm.models.config import SIZES, ModelConfig
from pretrain_lm.models.decoder import DecoderModel
from pretrain_lm.models.electra import ElectraModel
from pretrain_lm.models.encoder import EncoderModel
from pretrain_lm.models.encoder_decoder import EncoderDecoderModel

MODELS = {
  'encoder': EncoderModel,
  'decoder': DecoderModel,
  'encoder_decoder': EncoderDecoderModel,
  'electra': ElectraModel,
}

__all__ = ['MODELS', 'SIZES', 'ModelConfig']
