"""TFDS datasets as a source: prepared builders only, split by host."""

from typing import Any

import tensorflow as tf

from pretrain_lm.data.sources.autograph import no_autograph
from pretrain_lm.data.sources.spec import TFDS_PREFIX


def _tfds_builder(source: str, field: str, data_dir: str):
  """The prepared TFDS builder that `source` names."""
  # Imported here: it takes about a second and most runs read text files.
  import tensorflow_datasets as tfds

  name = source[len(TFDS_PREFIX) :]
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
  except ValueError as e:  # tfds' DatasetNotFoundError lists ~1000 names.
    first_line = str(e).split('\n', 1)[0]
    raise ValueError(
      f'{field}: unknown TFDS dataset {name!r} ({first_line}).'
    ) from None
  if not builder.is_prepared():
    raise FileNotFoundError(
      f'{field}: TFDS dataset {name!r} is not prepared in '
      f'{builder.data_dir!r}. Prepare it where there is network access '
      f'(`tfds build {name} --data_dir=DIR`) and set '
      '--config.data.tfds_data_dir=DIR; runs never download.'
    )
  return builder


def tfds_texts(
  source: str,
  field: str,
  split: str,
  process_index: int,
  process_count: int,
  *,
  data_dir: str,
  text_key: str,
) -> tuple[tf.data.Dataset, Any]:
  """Part `process_index` of a TFDS split's texts, unstripped; and the part."""
  import tensorflow_datasets as tfds

  builder = _tfds_builder(source, field, data_dir)
  if text_key not in builder.info.features:
    raise KeyError(
      f'data.tfds_text_key={text_key!r} is not a feature of {source!r}; it '
      f'has {sorted(builder.info.features)}.'
    )
  part = tfds.split_for_jax_process(
    split, process_index=process_index, process_count=process_count
  )
  ds = builder.as_dataset(
    split=part,
    shuffle_files=False,
    read_config=tfds.ReadConfig(try_autocache=False),
  )
  return ds.map(no_autograph(lambda example: example[text_key])), part
