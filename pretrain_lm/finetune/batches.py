"""A fine-tuning run's rows and batches.

The task's splits as model rows (rows.py reads them), the batch sizes
checked against the mesh, the steps of an epoch, and each training step's
rows: a fresh shuffle of the training split every epoch, interleaved with
unlabelled batches under cross-view training.
"""

import jax
import ml_collections
import numpy as np

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.finetune import rows as rows_lib


def read_splits(
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  family: str,
  task,
  head: str,
) -> tuple[rows_lib.Split, dict[str, rows_lib.Split], rows_lib.Split | None]:
  """The training split, each held-out split by name, and the unlabelled
  rows of cross-view training (None without cvt.unlabeled)."""
  c = config
  train = rows_lib.read_split(
    c, 'train', tokenizer, family, c.task.max_train_examples
  )
  held_out = {
    name: rows_lib.read_split(
      c, name, tokenizer, family, c.task.max_eval_examples
    )
    for name in rows_lib.task_eval_splits(task, c.task)
  }
  unlabeled = None
  if c.cvt.unlabeled:
    unlabeled = rows_lib.unlabeled_split(c, tokenizer, family, head)
  return train, held_out, unlabeled


def batch_sizes(
  config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh
) -> tuple[int, int, int]:
  """The training, evaluation and unlabelled batch sizes (the last two
  default to data.batch_size), each a multiple of the mesh's batch shards
  and of the process count."""
  c = config
  shards = mesh.shape['data'] * mesh.shape['fsdp']
  sizes = (
    c.data.batch_size,
    c.train.eval_batch_size or c.data.batch_size,
    c.cvt.batch_size or c.data.batch_size,
  )
  for field, size in zip(
    ('data.batch_size', 'train.eval_batch_size', 'cvt.batch_size'),
    sizes,
    strict=True,
  ):
    if size % shards or size % jax.process_count():
      raise ValueError(
        f'{field}={size} must be a multiple of the {shards} '
        'batch shards (mesh data x fsdp) and of the process count.'
      )
  return sizes


def steps_per_epoch(
  config: ml_collections.ConfigDict,
  train: rows_lib.Split,
  unlabeled: rows_lib.Split | None,
  batch_size: int,
  unlabeled_batch_size: int,
) -> int:
  """The labelled batches of an epoch; with cross-view training each is
  followed by an unlabelled one, and an epoch has twice the steps."""
  batches_per_epoch = train.num_rows // batch_size
  if not batches_per_epoch:
    raise ValueError(
      f'{train.num_rows} training rows make no batch of '
      f'data.batch_size={batch_size}.'
    )
  if unlabeled is not None and unlabeled.num_rows < unlabeled_batch_size:
    raise ValueError(
      f'cvt.unlabeled={config.cvt.unlabeled!r}: {unlabeled.num_rows} '
      f'unlabelled rows make no batch of {unlabeled_batch_size}.'
    )
  return batches_per_epoch * (1 if unlabeled is None else 2)


def example_batch(features: dict[str, np.ndarray], keys, rows: int) -> dict:
  """ShapeDtypeStructs of a batch of `rows` rows of these features."""
  return {
    k: jax.ShapeDtypeStruct((rows, *features[k].shape[1:]), features[k].dtype)
    for k in keys
  }


def host_rows(rows: np.ndarray) -> np.ndarray:
  """This process's share of a global batch's row indices."""
  per_host = len(rows) // jax.process_count()
  start = jax.process_index() * per_host
  return rows[start : start + per_host]


class TrainBatches:
  """This host's rows of each training step: a fresh shuffle every epoch.

  The order depends only on (seed, epoch), so a resumed run continues
  mid-epoch with exactly the rows it would have seen. With cross-view
  training, even steps take the labelled batches in that order and odd
  steps unlabelled ones, shuffled the same way over their own epochs.
  """

  def __init__(
    self,
    split: rows_lib.Split,
    keys: tuple[str, ...],
    batch_size: int,
    seed: int,
    unlabeled: rows_lib.Split | None = None,
    unlabeled_batch_size: int = 0,
  ):
    self.split, self.keys, self.batch_size = split, keys, batch_size
    self.seed = seed
    self.unlabeled, self.unlabeled_batch_size = unlabeled, unlabeled_batch_size
    self._orders = {}  # stream -> (epoch, its row order)

  def __call__(self, step: int) -> dict[str, np.ndarray]:
    split, keys, B = self.split, self.keys, self.batch_size
    stream = 0
    if self.unlabeled is not None:
      step, stream = divmod(step, 2)
      if stream:
        split, B = self.unlabeled, self.unlabeled_batch_size
        keys = tuple(split.features)
    epoch, index = divmod(step, split.num_rows // B)
    if self._orders.get(stream, (None,))[0] != epoch:
      # The labelled rows keep the order they have without CVT.
      seed = [self.seed, epoch]
      if stream:
        seed.append(1)
      order = np.random.default_rng(seed).permutation(split.num_rows)
      self._orders[stream] = (epoch, order)
    rows = host_rows(self._orders[stream][1][index * B : (index + 1) * B])
    return {k: split.features[k][rows] for k in keys}
