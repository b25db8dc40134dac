"""Checkpoint conversion: Hugging Face checkpoints <-> pretrain_lm workdirs.

  python -m pretrain_lm.convert import --from=hf --src=DIR --workdir=DIR
  python -m pretrain_lm.convert export --to=hf --workdir=DIR --dst=DIR

From Python, the same two operations:

  from pretrain_lm import convert
  convert.import_hf('path/to/hf-bert', 'workdirs/bert_hf')
  convert.export_hf('workdirs/quickstart', 'workdirs/quickstart_hf')

from_hf.py imports, to_hf.py exports, weights.py applies a model_type's
tensor table to a whole checkpoint, and files.py reads and writes the files
(hf.py gives all their names in one module); one module per architecture
holds its tensor table (bert.py for BERT and RoBERTa, gpt2.py, t5.py,
bart.py), layout.py the tables' common parts, and tokenizer.py converts the
tokenizer files.
"""

from pretrain_lm.convert.from_hf import import_hf
from pretrain_lm.convert.to_hf import export_hf
from pretrain_lm.convert.weights import FORMATS

__all__ = ['FORMATS', 'export_hf', 'import_hf']
