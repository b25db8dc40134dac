"""Tests for pretrain_lm.finetune.metrics against scikit-learn and scipy."""

import numpy as np
import pytest
import scipy.stats
from sklearn import metrics as sk

from pretrain_lm.finetune import metrics


def _random_classes(seed, n, num_classes, agreement):
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, num_classes, n)
  noise = rng.integers(0, num_classes, n)
  keep = rng.random(n) < agreement
  return labels, np.where(keep, labels, noise)


@pytest.mark.parametrize('seed', range(5))
@pytest.mark.parametrize('num_classes', [2, 3, 5])
def test_classification_metrics_match_sklearn(seed, num_classes):
  labels, predictions = _random_classes(seed, 200, num_classes, 0.6)
  assert metrics.accuracy(labels, predictions) == pytest.approx(
    sk.accuracy_score(labels, predictions)
  )
  assert metrics.matthews_corrcoef(labels, predictions) == pytest.approx(
    sk.matthews_corrcoef(labels, predictions)
  )
  assert metrics.f1_binary(labels, predictions) == pytest.approx(
    sk.f1_score(labels == 1, predictions == 1)
  )
  assert metrics.f1_macro(labels, predictions, num_classes) == pytest.approx(
    sk.f1_score(labels, predictions, average='macro')
  )
  assert metrics.f1_micro(labels, predictions) == pytest.approx(
    sk.f1_score(labels, predictions, average='micro')
  )
  kept = list(range(1, num_classes))
  assert metrics.f1_micro(labels, predictions, ignore=[0]) == pytest.approx(
    sk.f1_score(labels, predictions, labels=kept, average='micro')
  )
  np.testing.assert_array_equal(
    metrics.confusion_matrix(labels, predictions, num_classes),
    sk.confusion_matrix(labels, predictions, labels=range(num_classes)),
  )


def test_binary_metrics_by_hand():
  # TP=2 FP=1 FN=1 TN=1: P = R = F1 = 2/3; MCC = (2*1 - 1*1)/sqrt(3*3*2*2).
  labels = [1, 1, 1, 0, 0]
  predictions = [1, 1, 0, 1, 0]
  assert metrics.f1_binary(labels, predictions) == pytest.approx(2 / 3)
  assert metrics.matthews_corrcoef(labels, predictions) == pytest.approx(1 / 6)
  assert metrics.precision_recall_f1(2, 1, 1) == pytest.approx(
    (2 / 3, 2 / 3, 2 / 3)
  )


def test_degenerate_cases_are_zero_as_in_sklearn():
  # Constant predictions: MCC's denominator is 0; no positives: F1 is 0.
  labels, constant = [0, 1, 1, 0], [1, 1, 1, 1]
  assert metrics.matthews_corrcoef(labels, constant) == 0.0
  assert sk.matthews_corrcoef(labels, constant) == 0.0
  assert metrics.f1_binary([0, 0], [0, 0]) == 0.0
  assert metrics.pearson([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) == 0.0
  assert metrics.spearman([1.0, 1.0], [1.0, 2.0]) == 0.0
  assert metrics.matthews_corrcoef([0, 1, 0], [0, 1, 0]) == 1.0
  assert metrics.matthews_corrcoef([0, 1], [1, 0]) == -1.0


def test_shape_mismatch_and_empty_raise():
  with pytest.raises(ValueError, match='3 labels but 2 predictions'):
    metrics.accuracy([0, 1, 1], [0, 1])
  with pytest.raises(ValueError, match='No examples'):
    metrics.accuracy([], [])


@pytest.mark.parametrize('seed', range(5))
def test_correlations_match_scipy_with_ties(seed):
  rng = np.random.default_rng(seed)
  # STS-B gold scores are multiples of 0.2 in [0, 5]: many ties.
  gold = np.round(rng.uniform(0, 5, 300) / 0.2) * 0.2
  predicted = np.round(gold + rng.normal(0, 1.5, 300), 1)
  assert metrics.pearson(gold, predicted) == pytest.approx(
    scipy.stats.pearsonr(gold, predicted)[0], abs=1e-12
  )
  assert metrics.spearman(gold, predicted) == pytest.approx(
    scipy.stats.spearmanr(gold, predicted)[0], abs=1e-12
  )
  np.testing.assert_allclose(
    metrics.rank(predicted), scipy.stats.rankdata(predicted)
  )
  got = metrics.regression_metrics(gold, predicted)
  assert got['pearson_spearman_mean'] == pytest.approx(
    (got['pearson'] + got['spearman']) / 2
  )


def test_rank_averages_ties_by_hand():
  np.testing.assert_array_equal(
    metrics.rank([10, 20, 10, 30, 20, 20]), [1.5, 4, 1.5, 6, 4, 4]
  )
