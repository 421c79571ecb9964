"""The thesis's evaluation table: accuracy, precision and recall per class, and AC@k of rankings."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.metrics import accuracy_score, precision_recall_curve, precision_recall_fscore_support


def classification_table(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """accuracy, NBP/NBR (non-bottlenecked class), BP/BR (bottlenecked class)."""
    precision, recall, _, _ = precision_recall_fscore_support(
        y_true, y_pred, labels=[0, 1], zero_division=0
    )
    return {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "nbp": float(precision[0]),
        "bp": float(precision[1]),
        "nbr": float(recall[0]),
        "br": float(recall[1]),
    }


def accuracy_at_k(rankings: Sequence[Sequence[str]], truths: Sequence[set[str]], k: int) -> float:
    """AC@k: the share of cases whose true root-cause services include one of the top k ranked."""
    if not rankings:
        return float("nan")
    hits = [bool(set(ranking[:k]) & truth) for ranking, truth in zip(rankings, truths)]
    return float(np.mean(hits))


def average_at_k(rankings: Sequence[Sequence[str]], truths: Sequence[set[str]], k: int = 5) -> float:
    """Avg@k: the mean of AC@1 .. AC@k."""
    return float(np.mean([accuracy_at_k(rankings, truths, j) for j in range(1, k + 1)]))


def threshold_for_precision(y_true: np.ndarray, scores: np.ndarray, min_precision: float) -> float:
    """The threshold with the highest recall whose precision is at least `min_precision`.

    Where no threshold reaches that precision, the one with the best F1.
    """
    if len(np.unique(y_true)) < 2:
        return 0.5
    precision, recall, thresholds = precision_recall_curve(y_true, scores)
    precision, recall = precision[:-1], recall[:-1]  # the last point has no threshold
    feasible = precision >= min_precision
    if feasible.any():
        best = np.flatnonzero(feasible)[np.argmax(recall[feasible])]
    else:
        f1 = 2 * precision * recall / np.maximum(precision + recall, 1e-12)
        best = int(np.argmax(f1))
    return float(thresholds[best])
