"""Pretraining objectives, chosen by `config.objective.name`.

An objective is one module with:

- `transform(row, seed, *, config, tokenizer) -> dict[str, tf.Tensor]`: the
  tf.data map from a packed row {'input_ids', 'segment_ids', 'positions'}
  (int32[row length]) to the model's features, with static shapes. `seed`
  is a stateless seed (int64[2]) from (data.seed, epoch, row index): all
  randomness must come from it through tf.random.stateless_* ops, so that a
  restart replays the same batches.
- `loss(outputs, batch) -> (loss, metrics)`: pure JAX, from the model's
  outputs and the batch to a scalar loss and a dict of scalar metrics
  (`num_predictions` weights the evaluation average); or `make_loss(config)`
  returning such a function when it has parameters.
- `FAMILIES`: the model families (pretrain_lm.models.MODELS keys) it trains.
- optionally `row_length(config) -> int`: the packed row length, if not
  data.seq_len (gets the full run config).
- optionally `num_reserved_ids(objective_config) -> int`: ids it needs after
  the tokenizer's vocabulary (T5's sentinels, UL2's mode tokens). The run
  trains its tokenizer with that many fewer ids than model.vocab_size, so
  ids tokenizer.vocab_size, tokenizer.vocab_size + 1, ... never occur in
  text and have embedding rows.
- optionally `check_config(config)`: raises ValueError naming the field
  when the full run config does not suit the objective (validate.py calls
  it before anything is built).
- optionally `needs_partner(objective_config) -> bool`: if True, the
  pipeline passes `partner=`, another packed row of the same epoch (BERT's
  next-sentence prediction takes its random B from it).
"""

import functools

from pretrain_lm.data import pipeline
from pretrain_lm.objectives import (
  bilm,
  clm,
  denoising,
  electra,
  mlm,
  plm,
  prefix_lm,
  reconstruct,
  span_corruption,
  ul2,
  xent,
)

OBJECTIVES = {
  'mlm': mlm,
  'clm': clm,
  'reconstruct': reconstruct,
  'electra': electra,
  'prefix_lm': prefix_lm,
  'bilm': bilm,
  'plm': plm,
  'span_corruption': span_corruption,
  'ul2': ul2,
  'ul2_decoder': ul2.DECODER,
  'denoising': denoising,
}


def loss_fn(objective, config):
  """The objective's loss function for the `objective` config section.

  Calls to it compute the token cross-entropies with
  `config.cross_entropy` (xent.token_xent reads it while the loss traces).
  """
  loss = (
    objective.make_loss(config)
    if hasattr(objective, 'make_loss')
    else objective.loss
  )
  impl = config.cross_entropy

  @functools.wraps(loss)
  def with_cross_entropy(*args, **kwargs):
    with xent.implementation(impl):
      return loss(*args, **kwargs)

  return with_cross_entropy


def num_reserved_ids(objective, config) -> int:
  """Ids the objective reserves after the tokenizer's (0 for most)."""
  if hasattr(objective, 'num_reserved_ids'):
    return objective.num_reserved_ids(config)
  return 0


def needs_partner(objective, config) -> bool:
  """Whether the objective's transform takes a `partner` row."""
  return hasattr(objective, 'needs_partner') and objective.needs_partner(config)


def row_transform(config) -> pipeline.RowTransform:
  """What the input pipeline needs from the run's objective.

  Args:
    config: the full run config (its `objective` section names the
      objective; `row_length` may read `data` too).
  """
  objective = OBJECTIVES[config.objective.name]
  row_length = (
    objective.row_length(config)
    if hasattr(objective, 'row_length')
    else config.data.seq_len
  )
  return pipeline.RowTransform(
    fn=objective.transform,
    row_length=row_length,
    partnered=needs_partner(objective, config.objective),
    reserved_ids=num_reserved_ids(objective, config.objective),
  )
