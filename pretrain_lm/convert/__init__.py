"""Checkpoint conversion: Hugging Face checkpoints <-> pretrain_lm workdirs.

  python -m pretrain_lm.convert import --from=hf --src=DIR --workdir=DIR
  python -m pretrain_lm.convert export --to=hf --workdir=DIR --dst=DIR

From Python, the same two operations:

  from pretrain_lm import convert
  convert.import_hf('path/to/hf-bert', 'workdirs/bert_hf')
  convert.export_hf('workdirs/quickstart', 'workdirs/quickstart_hf')

See pretrain_lm/convert/hf.py; one module per architecture holds its tensor
table (bert.py for BERT and RoBERTa, gpt2.py, t5.py, bart.py), and
tokenizer.py converts the tokenizer files.
"""

from pretrain_lm.convert.hf import FORMATS, export_hf, import_hf

__all__ = ['FORMATS', 'export_hf', 'import_hf']
