"""Hugging Face checkpoints (config.json + model.safetensors) <-> workdirs.

`import_hf(src, workdir)` turns an HF model directory into an ordinary
workdir (from_hf.py); `export_hf(workdir, dst)` writes any step of a workdir
back in HF's layout (to_hf.py). weights.py maps whole checkpoints through a
model_type's Format (FORMATS), and files.py reads and writes the files.

This module gives the names of all four under one roof, for callers that
use `hf.import_hf`, `hf.batch_spec`, `hf.read_tensors` and the like.
"""

from pretrain_lm.convert.files import (
  CONFIG_FILE,
  IMPORT_FILE,
  SHARDED_INDEX_FILE,
  WEIGHTS_FILE,
  read_json_file,
  read_tensors,
)
from pretrain_lm.convert.from_hf import batch_spec, import_hf, import_tokenizer
from pretrain_lm.convert.to_hf import export_hf
from pretrain_lm.convert.weights import (
  FORMATS,
  default_model_type,
  hf_format,
  model_section,
  params_from_hf,
  tensors_to_hf,
)

__all__ = [
  'CONFIG_FILE',
  'FORMATS',
  'IMPORT_FILE',
  'SHARDED_INDEX_FILE',
  'WEIGHTS_FILE',
  'batch_spec',
  'default_model_type',
  'export_hf',
  'hf_format',
  'import_hf',
  'import_tokenizer',
  'model_section',
  'params_from_hf',
  'read_json_file',
  'read_tensors',
  'tensors_to_hf',
]
