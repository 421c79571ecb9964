"""Evaluate a detector on the held-out traces: the thesis's table for B-MEG and the SVM, plus AC@k."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa

from bmeg.graphs import SpanForest, assemble
from bmeg.models.router import Router
from bmeg.training.labelled import Labelled
from bmeg.training.metrics import accuracy_at_k, classification_table

if TYPE_CHECKING:
    from bmeg.models.detector import Detector, Scores


def evaluate(detector: Detector, data: Labelled, raw: Scores | None = None, cost: bool = False) -> dict:
    """The thesis's table per model on the test traces, AC@k, per fault kind, the routing; with
    `cost`, each model's inference throughput on (up to 1,000) test traces, measured in one run."""
    raw = raw if raw is not None else detector.score(data.forest, all_models=True, replay=True, context=data.context)
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
    metrics["routing"] = {**detector.router.to_state(), "share_to_svm": float(np.mean(routed.to_svm[test])),
                          **detector.hparams.get("router_choice", {})}
    if cost:
        seconds = measure_cost(detector, data.forest, test, {"gnn": Router(), "svm": Router.everything(),
                                                             "bmeg": detector.router})
        metrics["traces_per_s"] = {name: 1.0 / value for name, value in seconds.items()}
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


def measure_cost(detector: Detector, forest: SpanForest, traces: np.ndarray, routers: dict[str, Router],
                 limit: int = 1_000) -> dict[str, float]:
    """Seconds per trace of `detector.diagnose` (features, the routed models, the diagnosis) under
    each router, on up to `limit` of `traces` (a whole batch at a time, as the consumer sends
    them), in CPU time of this process (steadier than wall-clock on a shared machine: other jobs'
    time is not counted); each the best of 5 runs."""
    chosen = np.sort(traces)[:limit]
    sample = assemble(forest.spans.take(pa.array(np.flatnonzero(np.isin(forest.trace_index, chosen)))))
    seconds = {}
    for name, router in routers.items():
        routed = replace(detector, router=router)
        runs = []
        for _ in range(5):
            began = time.process_time()
            routed.diagnosis_document(sample)
            runs.append(time.process_time() - began)
        seconds[name] = min(runs) / max(sample.num_traces, 1)
    return seconds


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
