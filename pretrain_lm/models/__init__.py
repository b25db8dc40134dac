"""Model families by name: `MODELS[config.model.family](ModelConfig)`."""

from pretrain_lm.models.bilm import BiLMModel
from pretrain_lm.models.config import SIZES, ModelConfig
from pretrain_lm.models.decoder import DecoderModel
from pretrain_lm.models.electra import ElectraModel
from pretrain_lm.models.encoder import EncoderModel
from pretrain_lm.models.encoder_decoder import EncoderDecoderModel
from pretrain_lm.models.plm import PlmModel

MODELS = {
  'encoder': EncoderModel,
  'decoder': DecoderModel,
  'encoder_decoder': EncoderDecoderModel,
  'electra': ElectraModel,
  'bilm': BiLMModel,
  'plm': PlmModel,
}

__all__ = ['MODELS', 'SIZES', 'ModelConfig']
