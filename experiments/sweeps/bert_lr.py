r"""BERT learning rate x warmup: 3 peak rates x 2 warmups, 6 runs.

  python -m pretrain_lm.sweep experiments/sweeps/bert_lr.py \
      --base=configs/bert.py:size=small --workdir_root=gs://BUCKET/bert_lr \
      --config.train.num_steps=100000 --dry_run

The rates bracket BERT's 1e-4 (Devlin et al., 2019) by 3x on each side of
the 3e-4 small models usually take; warmup is 1% and 10% of 100k steps.
"""

from pretrain_lm import sweep


def get_sweep():
  return sweep.product(
    sweep.choice('optimizer.learning_rate', [1e-4, 3e-4, 1e-3]),
    sweep.choice('optimizer.warmup_steps', [1_000, 10_000]),
  )
