"""Pretraining objectives, chosen by `config.objective.name`.

An objective is one module with two functions:

- `transform(row, seed, *, config, tokenizer) -> dict[str, tf.Tensor]`: the
  tf.data map from a packed row {'input_ids': int32[L]} to the model's
  features, with static shapes. `seed` is a stateless seed (int64[2]) from
  (data.seed, epoch, row index): all randomness must come from it through
  tf.random.stateless_* ops, so that a restart replays the same batches.
- `loss(outputs, batch) -> (loss, metrics)`: pure JAX, from the model's
  outputs and the batch to a scalar loss and a dict of scalar metrics.
"""

from pretrain_lm.objectives import mlm

OBJECTIVES = {'mlm': mlm}
