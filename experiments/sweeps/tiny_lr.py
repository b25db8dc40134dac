r"""A sweep that runs on a laptop CPU in minutes: two (lr, warmup) pairs.

  python -m pretrain_lm.sweep experiments/sweeps/tiny_lr.py \
      --base=configs/bert.py:size=tiny --workdir_root=/tmp/tiny_lr \
      --parallel=2 --config.train.num_steps=100
  python -m pretrain_lm.sweep --summarize /tmp/tiny_lr

`zip` pairs the lists elementwise: each rate gets its own warmup.
"""

from pretrain_lm import sweep


def get_sweep():
  return sweep.zip(
    sweep.choice('optimizer.learning_rate', [1e-3, 3e-3]),
    sweep.choice('optimizer.warmup_steps', [10, 20]),
  )
