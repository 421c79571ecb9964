"""The two-stage detector with its SVM fallback, and the `Diagnosis` it produces.

`Detector.score(forest)` runs every model over a forest of traces and returns arrays (used by
evaluation and by `diagnose`); `Detector.diagnose(spans)` turns them into the typed
`Diagnosis` with its evidence. Small or simple traces (few distinct services) go to the SVM,
the others to the GNN stages; the cut is chosen on validation data at training time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from itertools import compress
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from bmeg.version import __version__
from bmeg.diagnosis import Diagnosis
from bmeg.graphs import SpanForest, assemble, critical_paths, node_services
from bmeg.graphs.critical_path import CriticalPaths
from bmeg.graphs.features import self_time_ns
from bmeg.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from bmeg.models.dgcnn import DGCNN
from bmeg.models.features import FeatureEncoder
from bmeg.models.gcn_node import GCNNodeClassifier
from bmeg.paths import cache_dir
from bmeg.models.svm import FirmSVM, critical_path_frame, firm_features
from bmeg.training.graphset import GraphSet
from bmeg.training.trainer import limit_cpu_threads, predict_proba, resolve_device

def default_run_dir(application: str = "socialnet") -> Path:
    """Where `bmeg train` writes and `bmeg diagnose` reads by default."""
    return cache_dir() / "runs" / application


#: How many ranked services a trace's diagnosis lists.
TOP_SERVICES = 5


@dataclass
class Scores:
    """Every model's output over a forest (trace order = forest order)."""

    services: list[str]  # columns of the [T, S] matrices
    node_services: np.ndarray  # [N] service of each node (stores split out)
    gnn_anomaly: np.ndarray  # [T] DGCNN P(anomalous)
    gnn_service: np.ndarray  # [T, S] max GCN node score per service (0 where absent)
    svm_service: np.ndarray  # [T, S] SVM score per service on the critical path (0 off it)
    present: np.ndarray  # bool [T, S]
    to_svm: np.ndarray  # bool [T]: routed to the SVM
    anomaly: np.ndarray  # [T] routed anomaly score
    anomalous: np.ndarray  # bool [T]
    service: np.ndarray  # [T, S] routed service scores

    @property
    def svm_anomaly(self) -> np.ndarray:
        return self.svm_service.max(axis=1, initial=0.0)


@dataclass
class Detector:
    application: str
    encoder: FeatureEncoder
    dgcnn: DGCNN
    gcn: GCNNodeClassifier
    svm: FirmSVM
    thresholds: dict[str, float]  # graph (DGCNN), node (GCN), svm
    svm_max_services: int  # traces with at most this many services go to the SVM (-1: none)
    svm_window: int
    services: list[str]  # the training vocabulary
    service_baseline_us: dict[str, float]  # median self time per trace in normal traces
    hparams: dict
    metrics: dict
    device: torch.device = torch.device("cpu")
    run_dir: Path | None = None
    recent: deque[pd.DataFrame] = field(default_factory=deque)  # earlier traces, for SVM windows

    @property
    def version(self) -> str:
        return f"bmeg-{__version__}/{self.application}/{self.encoder.variant}"

    # -- scoring -----------------------------------------------------------------------------
    def score(self, forest: SpanForest, paths: CriticalPaths | None = None, remember: bool = False,
              all_models: bool = False) -> Scores:
        """Scores of the traces. The SVM runs where the router sends a trace to it, or everywhere
        with `all_models` (evaluation). `remember` keeps the traces for later SVM windows."""
        paths = paths or critical_paths(forest)
        services = node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False)
        graphs = GraphSet.from_forest(forest, self.encoder.transform(forest, paths, services))
        everything = np.arange(forest.num_traces)
        probabilities = predict_proba({"graph": self.dgcnn, "node": self.gcn}, graphs, everything, self.device)
        gnn_anomaly, node_scores = probabilities["graph"], probabilities["node"]
        codes, names = pd.factorize(services)
        gnn_service = np.zeros((forest.num_traces, len(names)))
        np.maximum.at(gnn_service, (forest.trace_index, codes), node_scores)
        present = np.zeros_like(gnn_service, dtype=bool)
        present[forest.trace_index, codes] = True
        svm_service = np.zeros_like(gnn_service)
        if all_models or self.svm_max_services >= 0:  # the SVM and its window are in use
            frame = critical_path_frame(forest, services, paths)
            if all_models or np.any(present.sum(axis=1) <= self.svm_max_services):
                svm_service = self._svm_scores(frame, list(names))
            if remember:
                self._remember(frame)
        raw = Scores(
            services=list(names), node_services=services, gnn_anomaly=gnn_anomaly, gnn_service=gnn_service, svm_service=svm_service,
            present=present, to_svm=np.zeros(forest.num_traces, bool), anomaly=gnn_anomaly,
            anomalous=np.zeros(forest.num_traces, bool), service=gnn_service,
        )
        return self.route(raw)

    def route(self, scores: Scores) -> Scores:
        """Apply the router and the thresholds to raw model scores."""
        to_svm = scores.present.sum(axis=1) <= self.svm_max_services
        anomaly = np.where(to_svm, scores.svm_anomaly, scores.gnn_anomaly)
        threshold = np.where(to_svm, self.thresholds["svm"], self.thresholds["graph"])
        service = np.where(to_svm[:, None], scores.svm_service, scores.gnn_service)
        return replace(scores, to_svm=to_svm, anomaly=anomaly, anomalous=anomaly >= threshold, service=service)

    def _svm_scores(self, frame: pd.DataFrame, names: list[str]) -> np.ndarray:
        history = pd.concat(list(self.recent), ignore_index=True) if self.recent else None
        features = firm_features(frame, self.svm_window, history)  # [T, S, 2]
        on_path = frame[names].notna().to_numpy()
        scores = np.zeros(on_path.shape)
        if on_path.any():
            scores[on_path] = self.svm.score_samples(features[on_path])
        return scores

    def _remember(self, frame: pd.DataFrame) -> None:
        """Keep the latest traces that fill the SVM's window (whole batches, oldest dropped)."""
        self.recent.append(frame)
        while sum(len(part) for part in self.recent) - len(self.recent[0]) >= self.svm_window:
            self.recent.popleft()

    # -- diagnosis ---------------------------------------------------------------------------
    def diagnose(self, spans: pa.Table | SpanForest, window: bool = False) -> Diagnosis:
        """Diagnose every trace of a span table (or an assembled forest)."""
        # Plain values for every trace, validated in one pydantic call: building ~30 small
        # models per trace one by one cost as much as running the models.
        return Diagnosis.model_validate(self.diagnosis_document(spans, window))

    def diagnosis_document(self, spans: pa.Table | SpanForest, window: bool = False) -> dict:
        """The `Diagnosis` as plain values, laid out as `Diagnosis.model_dump()` lays it out.
        `diagnose` validates it; an output that only serialises it (the Kafka consumer, with
        `bmeg.diagnosis.single_trace_json`) skips building the typed objects."""
        forest = spans if isinstance(spans, SpanForest) else assemble(spans, on_bad_trace="raise")
        paths = critical_paths(forest)
        scores = self.score(forest, paths, remember=True)
        return {
            "model_version": self.version, "application": self.application,
            "traces": self._trace_diagnoses(forest, scores, paths),
            "ranking": self._window_ranking(scores) if window else None,
        }

    def _trace_diagnoses(self, forest: SpanForest, scores: Scores, paths: CriticalPaths) -> list[dict]:
        """Each trace's `TraceDiagnosis` as a dict, every field in order; the per-service work is
        done for all traces at once."""
        names = scores.services
        node_threshold = np.where(scores.to_svm, self.thresholds["svm"], self.thresholds["node"])
        ranked = _ranked_columns(scores.service, scores.present, TOP_SERVICES)
        ranked_score = np.take_along_axis(scores.service, ranked, axis=1)
        ranked_bottleneck = scores.anomalous[:, None] & (ranked_score >= node_threshold[:, None])
        latency = _service_latency_us(forest, scores)
        by_latency = _ranked_columns(latency, scores.present)
        baselines = [self.service_baseline_us.get(name) for name in names]
        # Where a service has no baseline, its ratio is None (below); 1 only avoids dividing by 0.
        ratio = latency / np.array([baseline or 1.0 for baseline in baselines])
        present_count = scores.present.sum(axis=1)
        rows = zip(
            forest.trace_ids, np.diff(forest.trace_offsets).tolist(), (forest.duration_ns[forest.root] / 1e3).tolist(),
            scores.anomalous.tolist(), scores.anomaly.tolist(), scores.to_svm.tolist(),
            np.minimum(present_count, TOP_SERVICES).tolist(), ranked.tolist(), ranked_score.tolist(),
            ranked_bottleneck.tolist(), present_count.tolist(), by_latency.tolist(),
            np.take_along_axis(latency, by_latency, axis=1).tolist(), np.take_along_axis(ratio, by_latency, axis=1).tolist(),
            _path_steps(forest, scores, paths), self._warnings(forest, scores), forest.start_ns[forest.root].tolist(),
        )
        return [
            {
                "trace_id": trace_id, "spans": spans, "total_us": total_us, "anomalous": anomalous,
                "anomaly_score": anomaly, "threshold": self.thresholds["svm" if to_svm else "graph"],
                "model": "svm" if to_svm else "gnn",
                "bottlenecks": [{"service": names[i], "score": score, "bottleneck": bottleneck}
                                for i, score, bottleneck in zip(ranked_t[:top], score_t, bottleneck_t)],
                "critical_path": path,
                "latencies": [{"service": names[i], "latency_us": value, "baseline_us": baselines[i],
                               "ratio": ratio_i if baselines[i] else None}
                              for i, value, ratio_i in zip(by_latency_t[:present_t], latency_t, ratio_t)],
                "mitigations": [],
                "warnings": warnings,
                "start_time": datetime.fromtimestamp(start_ns / 1e9, tz=UTC),
                "partial": False,
            }
            for (trace_id, spans, total_us, anomalous, anomaly, to_svm, top, ranked_t, score_t, bottleneck_t,
                 present_t, by_latency_t, latency_t, ratio_t, path, warnings, start_ns) in rows
        ]

    def _warnings(self, forest: SpanForest, scores: Scores) -> list[list[str]]:
        """Per trace: the repairs made to it, and the services the model does not know."""
        repairs = _warnings_by_trace(forest)
        alphabetical = sorted(range(len(scores.services)), key=scores.services.__getitem__)
        unknown = (scores.present & ~np.isin(scores.services, self.services))[:, alphabetical]
        names = [scores.services[i] for i in alphabetical]
        warnings = []
        for trace_id, unknown_t in zip(forest.trace_ids, unknown.tolist()):
            trace_warnings = list(repairs.get(trace_id, []))
            if any(unknown_t):
                trace_warnings.append("services unknown to the model (scored without a baseline): "
                                      + ", ".join(compress(names, unknown_t)))
            warnings.append(trace_warnings)
        return warnings

    def _window_ranking(self, scores: Scores) -> list[dict]:
        """Services over the window: mean score over the anomalous traces (all, weighted, if none)."""
        weights = scores.anomalous.astype(float) if scores.anomalous.any() else scores.anomaly
        seen = np.maximum((weights[:, None] * scores.present).sum(axis=0), 1e-12)
        mean = (weights[:, None] * scores.service).sum(axis=0) / seen
        order = np.argsort(-mean, kind="stable")
        threshold = self.thresholds["node"]
        return [{"service": scores.services[i], "score": float(mean[i]), "bottleneck": bool(mean[i] >= threshold)}
                for i in order if scores.present[:, i].any()]

    # -- persistence -------------------------------------------------------------------------
    def save(self, run_dir: Path) -> None:
        state = {
            "application": self.application, "encoder": self.encoder.to_state(),
            "dgcnn": self.dgcnn.state_dict(), "gcn": self.gcn.state_dict(), "thresholds": self.thresholds,
            "svm_max_services": self.svm_max_services, "svm_window": self.svm_window,
            "services": self.services, "service_baseline_us": self.service_baseline_us,
            "hparams": self.hparams, "metrics": self.metrics,
        }
        save_checkpoint(Path(run_dir), state, self.svm)
        self.run_dir = Path(run_dir)

    @classmethod
    def load(cls, run_dir: str | Path, device: str = "auto", application: str | None = None) -> Detector:
        state, svm = load_checkpoint(Path(run_dir), application=application)
        try:
            encoder = FeatureEncoder.from_state(state["encoder"])
            hparams = state["hparams"]
            dgcnn = DGCNN(encoder.num_features, **hparams["dgcnn"])
            gcn = GCNNodeClassifier(encoder.num_features, **hparams["gcn"])
            dgcnn.load_state_dict(state["dgcnn"])
            gcn.load_state_dict(state["gcn"])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{run_dir} does not fit this bmeg ({error}): retrain with `bmeg train`") from error
        target = resolve_device(device)
        if target.type == "cpu":
            limit_cpu_threads()
        return cls(
            application=state["application"], encoder=encoder, dgcnn=dgcnn.to(target).eval(),
            gcn=gcn.to(target).eval(), svm=svm, thresholds=state["thresholds"],
            svm_max_services=state["svm_max_services"], svm_window=state["svm_window"],
            services=state["services"], service_baseline_us=state["service_baseline_us"],
            hparams=hparams, metrics=state["metrics"], device=target, run_dir=Path(run_dir),
        )


def _ranked_columns(values: np.ndarray, present: np.ndarray, limit: int | None = None) -> np.ndarray:
    """Per row, column indices: present columns by descending value first (ties in column
    order), then the absent ones; the first `limit` columns only when given."""
    order = np.lexsort((-values, ~present), axis=1)
    return order if limit is None else order[:, :limit]


def _service_latency_us(forest: SpanForest, scores: Scores) -> np.ndarray:
    """[T, S] each service's self time per trace (µs), in the columns of the score matrices."""
    column_of = {name: i for i, name in enumerate(scores.services)}
    column = np.fromiter(map(column_of.__getitem__, scores.node_services), np.int64, forest.num_spans)
    cells = forest.trace_index * len(scores.services) + column
    latency = np.bincount(cells, weights=self_time_ns(forest) / 1e3, minlength=scores.present.size)
    return latency.reshape(scores.present.shape)


def _path_steps(forest: SpanForest, scores: Scores, paths: CriticalPaths) -> list[list[dict]]:
    """Each trace's critical path steps in time order (each span before its path children),
    named like the rankings: a store's client span is the store's step."""
    rows = np.flatnonzero(paths.on_path)
    rows = rows[np.lexsort((forest.depth[rows], paths.window_start_ns[rows], forest.trace_index[rows]))]
    steps = [
        {"service": service, "operation": operation, "exclusive_us": exclusive_us}
        for service, operation, exclusive_us in zip(
            scores.node_services[rows].tolist(), forest.spans["operation"].take(rows).to_pylist(),
            (paths.exclusive_ns[rows] / 1e3).tolist(),
        )
    ]
    ends = np.cumsum(np.bincount(forest.trace_index[rows], minlength=forest.num_traces)).tolist()
    return [steps[start:end] for start, end in zip([0, *ends[:-1]], ends)]


def _warnings_by_trace(forest: SpanForest) -> dict[str, list[str]]:
    """Repair warnings name their trace; group them by it."""
    by_trace: dict[str, list[str]] = {}
    for message in forest.warnings:
        for trace_id in forest.trace_ids:
            if trace_id in message:
                by_trace.setdefault(trace_id, []).append(message)
                break
    return by_trace
