"""Reconstruct the input (an encoder-decoder autoencoder, no noise).

The encoder reads the packed row; the decoder, fed the row shifted right
within each document (a [CLS] starts every document), predicts it token by
token. Nothing is corrupted, so this only shows the encoder-decoder loop
works; span corruption (T5) and denoising (BART) are the real objectives.
"""

import ml_collections
import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.objectives import clm

FAMILIES = ('encoder_decoder',)


def shift_right(ids, segments, start_id: int):
  """Decoder inputs: the previous token of the same document, else start."""
  previous = tf.concat([[start_id], ids[:-1]], axis=0)
  same = tf.concat([[False], segments[1:] == segments[:-1]], axis=0)
  return tf.where(same, previous, start_id)


def transform(
  row: dict[str, tf.Tensor],
  seed: tf.Tensor,
  *,
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> dict[str, tf.Tensor]:
  """encoder_* and decoder_* features of one row, targets = the row."""
  del seed, config
  ids = tf.cast(row['input_ids'], tf.int32)
  segments = tf.cast(row['segment_ids'], tf.int32)
  positions = tf.cast(row['positions'], tf.int32)
  decoder_input = shift_right(ids, segments, tokenizer.cls_id)
  return {
    'encoder_input_ids': ids,
    'encoder_segment_ids': segments,
    'encoder_positions': positions,
    'decoder_input_ids': tf.where(segments != 0, decoder_input, 0),
    'decoder_segment_ids': segments,
    'decoder_positions': positions,
    'target_ids': ids,
    'target_weights': tf.cast(segments != 0, tf.float32),
  }


loss = clm.loss
