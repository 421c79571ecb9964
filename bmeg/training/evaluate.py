"""Evaluate a detector on the held-out traces: the thesis's table for B-MEG and the SVM, plus AC@k."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from bmeg.training.metrics import accuracy_at_k, classification_table

if TYPE_CHECKING:
    from bmeg.models.detector import Detector, Scores
    from bmeg.training.pipeline import Labelled


def evaluate(detector: Detector, data: Labelled, raw: Scores | None = None) -> dict:
    raw = raw if raw is not None else detector.score(data.forest, all_models=True)
    routed = detector.route(raw)
    truth = true_services(data, raw)
    test, y = data.test, data.y[data.test]
    verdicts = {
        "bmeg": (routed.anomalous, routed.service),
        "svm": (raw.svm_anomaly >= detector.thresholds["svm"], raw.svm_service),
        "gnn": (raw.gnn_anomaly >= detector.thresholds["graph"], raw.gnn_service),
    }
    metrics: dict = {}
    for name, (anomalous, service) in verdicts.items():
        metrics[name] = {**classification_table(y, anomalous[test]), **_ranking_metrics(raw, service, truth, test[y == 1])}
    for column in ("fault_kind", "fault_source"):
        metrics[f"by_{column}"] = _by_label(data, raw, truth, verdicts, column)
    metrics["routing"] = {"svm_max_services": detector.svm_max_services,
                          "share_to_svm": float(np.mean(routed.to_svm[test]))}
    metrics["thresholds"] = dict(detector.thresholds)
    metrics["test_traces"] = int(len(test))
    metrics["test_anomalous"] = int(np.sum(y))
    return metrics


def _by_label(data: Labelled, raw: Scores, truth: np.ndarray, verdicts: dict, column: str) -> dict:
    """Per value of a trace label (fault kind, fault source) among the held-out bottlenecked
    traces: how many, the share flagged (recall, `br`) and the ranking metrics."""
    values = data.traces[column].to_numpy(zero_copy_only=False)[data.test]
    test, y = data.test, data.y[data.test]
    return {
        value: {
            name: {"n": int(np.sum(values == value)),
                   "br": float(np.mean(anomalous[test][values == value])),
                   **_ranking_metrics(raw, service, truth, test[(values == value) & (y == 1)])}
            for name, (anomalous, service) in verdicts.items()
        }
        for value in sorted(set(values[y == 1]))
    }


def true_services(data: Labelled, scores: Scores) -> np.ndarray:
    """bool [T, S]: the service has a bottleneck node in the trace (columns of `scores`)."""
    forest = data.forest
    column = pd.Index(scores.services).get_indexer(scores.node_services)
    truth = np.zeros(scores.present.shape, dtype=bool)
    rows = np.flatnonzero(data.node_y == 1)
    truth[forest.trace_index[rows], column[rows]] = True
    return truth


def _ranking_metrics(raw: Scores, service: np.ndarray, truth: np.ndarray, traces: np.ndarray) -> dict[str, float]:
    traces = traces[truth[traces].any(axis=1)]
    names = np.array(raw.services, dtype=object)
    rankings, truths = [], []
    for t in traces:
        row = np.where(raw.present[t], service[t], -np.inf)
        rankings.append(names[np.argsort(-row, kind="stable")].tolist())
        truths.append(set(names[truth[t]].tolist()))
    return {"ac1": accuracy_at_k(rankings, truths, 1), "ac3": accuracy_at_k(rankings, truths, 3)}
