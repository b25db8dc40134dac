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
- optionally `row_length(config)`: the packed row length, if not
  data.seq_len.
"""

from pretrain_lm.objectives import clm, electra, mlm, reconstruct

OBJECTIVES = {
  'mlm': mlm,
  'clm': clm,
  'reconstruct': reconstruct,
  'electra': electra,
}


def loss_fn(objective, config):
  """The objective's loss function for the `objective` config section."""
  if hasattr(objective, 'make_loss'):
    return objective.make_loss(config)
  return objective.loss
