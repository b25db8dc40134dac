"""Classification and regression metrics of the downstream tasks, in numpy.

Each function takes gold values first, then predictions (as scikit-learn
does), and returns a Python float in [0, 1] (correlations in [-1, 1]). Where
a metric is undefined (no positive examples, a constant input) it is 0.0, as
scikit-learn's defaults give for F1 and Matthews correlation, so that model
selection never compares against NaN.
"""

from collections.abc import Sequence

import numpy as np

ArrayLike = np.ndarray | Sequence


def _pair(labels: ArrayLike, predictions: ArrayLike, dtype=np.int64):
  """Both as 1-D arrays of one length."""
  labels = np.asarray(labels, dtype).reshape(-1)
  predictions = np.asarray(predictions, dtype).reshape(-1)
  if labels.shape != predictions.shape:
    raise ValueError(
      f'{labels.size} labels but {predictions.size} predictions.'
    )
  if not labels.size:
    raise ValueError('No examples to score.')
  return labels, predictions


def _safe_divide(numerator: float, denominator: float) -> float:
  return float(numerator / denominator) if denominator else 0.0


def accuracy(labels: ArrayLike, predictions: ArrayLike) -> float:
  """The fraction of predictions equal to the label."""
  labels, predictions = _pair(labels, predictions)
  return float(np.mean(labels == predictions))


def confusion_matrix(
  labels: ArrayLike, predictions: ArrayLike, num_classes: int | None = None
) -> np.ndarray:
  """Counts [C, C]: row = gold class, column = predicted class."""
  labels, predictions = _pair(labels, predictions)
  if num_classes is None:
    num_classes = int(max(labels.max(), predictions.max())) + 1
  if labels.min() < 0 or predictions.min() < 0:
    raise ValueError('Class ids must be non-negative.')
  flat = labels * num_classes + predictions
  counts = np.bincount(flat, minlength=num_classes * num_classes)
  return counts.reshape(num_classes, num_classes)


def precision_recall_f1(
  true_positives: float, false_positives: float, false_negatives: float
) -> tuple[float, float, float]:
  """Precision, recall and their harmonic mean F1 from counts."""
  precision = _safe_divide(true_positives, true_positives + false_positives)
  recall = _safe_divide(true_positives, true_positives + false_negatives)
  return (
    precision,
    recall,
    _safe_divide(2 * precision * recall, precision + recall),
  )


def f1_binary(
  labels: ArrayLike, predictions: ArrayLike, positive: int = 1
) -> float:
  """F1 of the `positive` class (MRPC's and QQP's official F1)."""
  labels, predictions = _pair(labels, predictions)
  gold, guess = labels == positive, predictions == positive
  return precision_recall_f1(
    np.sum(gold & guess), np.sum(~gold & guess), np.sum(gold & ~guess)
  )[2]


def f1_macro(
  labels: ArrayLike, predictions: ArrayLike, num_classes: int | None = None
) -> float:
  """The unweighted mean of the per-class F1s (classes 0 .. C-1)."""
  counts = confusion_matrix(labels, predictions, num_classes)
  tp = np.diag(counts)
  fp, fn = counts.sum(0) - tp, counts.sum(1) - tp
  return float(
    np.mean([precision_recall_f1(*c)[2] for c in zip(tp, fp, fn, strict=True)])
  )


def f1_micro(
  labels: ArrayLike,
  predictions: ArrayLike,
  ignore: Sequence[int] = (),
) -> float:
  """F1 of the counts pooled over all classes except `ignore`.

  Without `ignore` it equals accuracy; ignoring a majority class ('O' in
  tagging) makes it the F1 over the remaining classes.
  """
  labels, predictions = _pair(labels, predictions)
  ignored = list(ignore)
  gold_kept = ~np.isin(labels, ignored)
  guess_kept = ~np.isin(predictions, ignored)
  tp = np.sum((labels == predictions) & gold_kept)
  return precision_recall_f1(
    tp, np.sum(guess_kept) - tp, np.sum(gold_kept) - tp
  )[2]


def matthews_corrcoef(labels: ArrayLike, predictions: ArrayLike) -> float:
  """Matthews correlation (CoLA's metric), the multi-class R_K form.

  Gorodkin (2004): with the confusion matrix C, t_k = row sums, p_k =
  column sums, c = trace and s = total,
  MCC = (c s - t.p) / sqrt((s^2 - p.p)(s^2 - t.t)); for two classes this is
  the usual (TP TN - FP FN) / sqrt(...).
  """
  counts = confusion_matrix(labels, predictions).astype(np.float64)
  t, p = counts.sum(1), counts.sum(0)
  c, s = np.trace(counts), counts.sum()
  denominator = np.sqrt((s * s - p @ p) * (s * s - t @ t))
  return _safe_divide(c * s - t @ p, denominator)


def pearson(x: ArrayLike, y: ArrayLike) -> float:
  """Pearson's correlation coefficient (0.0 if either input is constant)."""
  x, y = _pair(x, y, np.float64)
  dx, dy = x - x.mean(), y - y.mean()
  denominator = np.sqrt((dx @ dx) * (dy @ dy))
  return float(np.clip(_safe_divide(dx @ dy, denominator), -1.0, 1.0))


def rank(x: ArrayLike) -> np.ndarray:
  """1-based ranks of `x`, tied values sharing their average rank."""
  values, inverse, counts = np.unique(
    np.asarray(x).reshape(-1), return_inverse=True, return_counts=True
  )
  del values
  # Group g occupies ranks first_g .. first_g + count_g - 1.
  first = np.cumsum(counts) - counts + 1
  return (first + (counts - 1) / 2.0)[inverse]


def spearman(x: ArrayLike, y: ArrayLike) -> float:
  """Spearman's rank correlation: Pearson's of the average ranks."""
  x, y = _pair(x, y, np.float64)
  return pearson(rank(x), rank(y))


def regression_metrics(x: ArrayLike, y: ArrayLike) -> dict[str, float]:
  """Pearson, Spearman and their mean (GLUE's STS-B score)."""
  metrics = {'pearson': pearson(x, y), 'spearman': spearman(x, y)}
  metrics['pearson_spearman_mean'] = (
    metrics['pearson'] + metrics['spearman']
  ) / 2
  return metrics
