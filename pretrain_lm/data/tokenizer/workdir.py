"""The run's tokenizer in its workdir: found, copied in, or trained."""

import os

import ml_collections
import tensorflow as tf
from absl import logging

from pretrain_lm.data import prepared, records, sources
from pretrain_lm.data.tokenizer.base import (
  SPECIAL_PIECES,
  Tokenizer,
  load_tokenizer,
)
from pretrain_lm.data.tokenizer.train import train_tokenizer

# The file a run keeps its tokenizer in, inside the workdir.
WORKDIR_FILENAME = 'tokenizer.model'


def setup_tokenizer(
  data_config: ml_collections.ConfigDict,
  *,
  vocab_size: int,
  workdir: str,
  is_chief: bool = True,
  reserved_ids: int = 0,
) -> Tokenizer:
  """The run's tokenizer, stored as `workdir/tokenizer.model`.

  Only the chief writes; other processes load the chief's file, so the caller
  must put a barrier between the chief's call and theirs.

  Args:
    data_config: the config's `data` section.
    vocab_size: model.vocab_size, the rows of the embedding table.
    workdir: the run's directory.
    is_chief: whether this is process 0.
    reserved_ids: ids the objective needs after the tokenizer's (T5's
      sentinels): a new tokenizer gets vocab_size - reserved_ids at most.

  Returns:
    The tokenizer, with vocab_size <= `vocab_size` - `reserved_ids`.
  """
  room = vocab_size - reserved_ids
  if room <= len(SPECIAL_PIECES):
    raise ValueError(
      f'model.vocab_size={vocab_size} leaves {room} ids for the tokenizer '
      f'after the {reserved_ids} ids the objective reserves; raise '
      'model.vocab_size.'
    )
  path = os.path.join(workdir, WORKDIR_FILENAME)
  # Resume order: (1) the workdir's tokenizer, since a resumed run must keep
  # the ids its checkpoints were trained with; (2) data.tokenizer, copied into
  # the workdir so the run stays self-contained; (3) a new one trained on
  # data.source.
  # A prepared corpus brings the tokenizer its rows were made with.
  given = data_config.tokenizer
  if not given and data_config.source.strip().startswith(records.PREFIX):
    given = os.path.join(
      prepared.parse_source(data_config.source)[0].directory,
      records.TOKENIZER_FILE,
    )
  if not is_chief or tf.io.gfile.exists(path):
    tokenizer = load_tokenizer(path)
  elif given:
    tokenizer = load_tokenizer(given)
    _check_fits(tokenizer, vocab_size, reserved_ids)
    tf.io.gfile.makedirs(workdir)
    tf.io.gfile.copy(given, path, overwrite=True)
    tokenizer = load_tokenizer(path)
  else:
    logging.info(
      'Training a %s tokenizer (vocab %d) on %s.',
      data_config.tokenizer_type,
      room,
      data_config.source,
    )
    texts = sources.iter_texts(
      data_config, limit=data_config.tokenizer_max_docs
    )
    tokenizer = train_tokenizer(
      texts,
      path,
      vocab_size=room,
      model_type=data_config.tokenizer_type,
      seed=data_config.seed,
    )
  _check_fits(tokenizer, vocab_size, reserved_ids)
  return tokenizer


def _check_fits(
  tokenizer: Tokenizer, vocab_size: int, reserved_ids: int = 0
) -> None:
  """Raises if the model's embedding table has no row for some token id."""
  if tokenizer.vocab_size + reserved_ids > vocab_size:
    reserved = (
      f' plus the {reserved_ids} ids the objective reserves'
      if reserved_ids
      else ''
    )
    raise ValueError(
      f'Tokenizer {tokenizer.path!r} has {tokenizer.vocab_size} tokens'
      f'{reserved}, more than model.vocab_size={vocab_size}; set '
      f'--config.model.vocab_size={tokenizer.vocab_size + reserved_ids} or '
      'larger.'
    )
