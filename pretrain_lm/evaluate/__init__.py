"""Held-out loss and perplexity of trained models, and the scores under them.

`python -m pretrain_lm.evaluate --workdir=DIR --data=FILE` (__main__.py)
evaluates a workdir's checkpoint on text. The library: workdirs.py reads
the data and the checkpoint, perplexity.py turns per-token scores into
loss and perplexities per model family, likelihood.py scores token
sequences under each family and batching.py packs them into model calls.
"""

from pretrain_lm.evaluate.likelihood import (
  MASKED_FAMILIES,
  causal_log_likelihoods,
  pseudo_log_likelihoods,
  reconstruction_log_likelihoods,
  score_continuations,
  strided_windows,
)
from pretrain_lm.evaluate.perplexity import (
  FAMILIES,
  context_length,
  evaluate_texts,
  start_ids,
)
from pretrain_lm.evaluate.workdirs import (
  KIND_NAMES,
  check_workdir,
  evaluate_workdir,
  format_table,
  read_documents,
)

__all__ = [
  'FAMILIES',
  'KIND_NAMES',
  'MASKED_FAMILIES',
  'causal_log_likelihoods',
  'check_workdir',
  'context_length',
  'evaluate_texts',
  'evaluate_workdir',
  'format_table',
  'pseudo_log_likelihoods',
  'read_documents',
  'reconstruction_log_likelihoods',
  'score_continuations',
  'start_ids',
  'strided_windows',
]
