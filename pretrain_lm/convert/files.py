"""The files conversion reads and writes.

An HF model directory (save_pretrained's output): config.json and
model.safetensors (or a sharded index of them); and the record an import
leaves in the workdir (hf_import.json).
"""

import json
import os

import numpy as np
import safetensors.numpy
import tensorflow as tf

from pretrain_lm import workdir as workdir_lib
from pretrain_lm.convert.layout import Tensors

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
SHARDED_INDEX_FILE = 'model.safetensors.index.json'
# Written into an imported workdir: the source config, its HF class, and
# which of our params the source did not have.
IMPORT_FILE = 'hf_import.json'
# TensorFlow-era BERT checkpoints name LayerNorm parameters gamma/beta.
_LEGACY_SUFFIXES = {'.gamma': '.weight', '.beta': '.bias'}


def read_json_file(path: str) -> dict:
  """A JSON file's content; FileNotFoundError naming the file if absent."""
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f'No {os.path.basename(path)} at {path!r}.')
  return workdir_lib.read_json(path)


def _load_safetensors(path: str) -> Tensors:
  """One safetensors file as numpy arrays; bfloat16 via ml_dtypes."""
  try:
    return dict(safetensors.numpy.load_file(path))
  except TypeError:  # numpy has no bfloat16: read the raw layout instead
    import ml_dtypes  # a JAX dependency

    with open(path, 'rb') as f:
      data = f.read()
    size = int.from_bytes(data[:8], 'little')
    header = json.loads(data[8 : 8 + size])
    header.pop('__metadata__', None)
    dtypes = {'BF16': ml_dtypes.bfloat16, 'F16': np.float16}
    dtypes.update({'F32': np.float32, 'F64': np.float64, 'I64': np.int64})
    out = {}
    for name, info in header.items():
      start, end = info['data_offsets']
      buffer = data[8 + size + start : 8 + size + end]
      out[name] = np.frombuffer(buffer, dtypes[info['dtype']]).reshape(
        info['shape']
      )
    return out


def read_tensors(src: str) -> Tensors:
  """The tensors of `src`/model.safetensors (or its sharded index).

  Args:
    src: an HF model directory (save_pretrained's output).

  Returns:
    HF tensor name -> numpy array, TF-era LayerNorm names (gamma, beta)
    renamed to weight and bias.

  Example:
    tensors = files.read_tensors('bert-base-uncased')  # a local directory
    tensors['bert.embeddings.word_embeddings.weight'].shape
  """
  path = os.path.join(src, WEIGHTS_FILE)
  index = os.path.join(src, SHARDED_INDEX_FILE)
  if os.path.exists(path):
    tensors = _load_safetensors(path)
  elif os.path.exists(index):
    shards = sorted(set(read_json_file(index)['weight_map'].values()))
    tensors = {}
    for shard in shards:
      tensors.update(_load_safetensors(os.path.join(src, shard)))
  else:
    other = [
      f
      for f in ('pytorch_model.bin', 'tf_model.h5')
      if os.path.exists(os.path.join(src, f))
    ]
    hint = (
      f" It has {other[0]}: re-save it with transformers' "
      'save_pretrained(..., safe_serialization=True).'
      if other
      else ''
    )
    raise FileNotFoundError(f'No {WEIGHTS_FILE} in {src!r}.{hint}')
  renamed = {}
  for name, tensor in tensors.items():
    for old, new in _LEGACY_SUFFIXES.items():
      if name.endswith(old):
        name = name[: -len(old)] + new
    renamed[name] = tensor
  return renamed


def write_model_files(dst: str, tensors: Tensors, hf_config: dict) -> None:
  """`dst`/model.safetensors (PyTorch's metadata) and `dst`/config.json."""
  safetensors.numpy.save_file(
    tensors, os.path.join(dst, WEIGHTS_FILE), metadata={'format': 'pt'}
  )
  workdir_lib.write_json(os.path.join(dst, CONFIG_FILE), hf_config)
