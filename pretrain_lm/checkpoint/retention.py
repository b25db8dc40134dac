"""Which checkpoints a retention policy keeps: latest, best, permanent."""

import math
from collections.abc import Iterable, Mapping


def retained_steps(
  steps: Iterable[int],
  *,
  keep: int,
  keep_best: int = 0,
  metrics: Mapping[int, float | None] | None = None,
  best_mode: str = 'min',
  keep_every: int = 0,
) -> set[int]:
  """The steps a retention policy keeps: latest ∪ best ∪ permanent ∪ newest.

  Args:
    steps: the committed checkpoints' steps.
    keep: the latest `keep` steps are kept (for resuming); 0 keeps all.
    keep_best: the `keep_best` steps with the best metric are kept; steps
      without a (finite) metric are never among them. 0: none.
    metrics: step -> the metric the best ones are ranked by.
    best_mode: 'min' (a loss) or 'max' (an accuracy) is best.
    keep_every: steps that are multiples of it are kept forever; 0: none.

  Returns:
    The steps to keep; the newest step is always among them.
  """
  steps = sorted(set(steps))
  if not steps:
    return set()
  kept = {steps[-1]}
  kept.update(steps if keep <= 0 else steps[-keep:])
  if keep_best > 0:
    ranked = [
      s
      for s in steps
      if (metrics or {}).get(s) is not None and math.isfinite(metrics[s])
    ]
    sign = 1 if best_mode == 'min' else -1
    # Ties go to the later step: it has trained longer.
    ranked.sort(key=lambda s: (sign * metrics[s], -s))
    kept.update(ranked[:keep_best])
  if keep_every > 0:
    kept.update(s for s in steps if s % keep_every == 0)
  return kept
