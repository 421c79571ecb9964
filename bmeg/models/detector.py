"""The two-stage detector with its SVM fallback and router, and the `Diagnosis` it produces.

`Detector.score(forest)` runs the models over a forest of traces and returns arrays (used by
evaluation and by `diagnose`); `Detector.diagnose(spans)` turns them into the typed `Diagnosis`
with its evidence. The router (`bmeg.models.router`) sends small and simple traces to the
per-trace SVM and the others to the GNN stages; only the chosen model runs on a trace.

A `Detector` holds no state between calls: calling it twice on the same traces gives the same
answer. History features read an explicit `StreamHistory` that a streaming caller owns and
passes in (`bmeg.models.history`); without one, each trace is judged on its own. So does the
crowd check of a diagnosis (`bmeg.models.crowd`): a trace that stage 1 flags is not anomalous
when the stream's traces begun just before it show the machine stalled or busy, slow where it is.
Training and evaluation (`score` without `crowd`) measure the models' own verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from itertools import compress
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from bmeg.diagnosis import Diagnosis
from bmeg.graphs import SpanForest, assemble, critical_paths, node_services, operation_key_array
from bmeg.graphs.critical_path import CriticalPaths
from bmeg.graphs.features import self_time_ns
from bmeg.graphs.rpc import rpc_view
from bmeg.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from bmeg.models.crowd import CrowdRule
from bmeg.models.dgcnn import DGCNN
from bmeg.models.features import FeatureEncoder
from bmeg.models.gcn_node import GCNNodeClassifier, GCNNodeEnsemble, node_classifier
from bmeg.models.graphset import GraphSet
from bmeg.models.history import Observation, StreamHistory
from bmeg.models.inference import limit_cpu_threads, predict_proba, resolve_device
from bmeg.models.router import Router, distinct_paths
from bmeg.models.signs import signs_above, trace_signs
from bmeg.models.window import WINDOW_MEAN_NODE_SCORE, WindowRanker
from bmeg.models.svm import (
    CulpritScorer,
    FirmSVM,
    TraceSVM,
    TraceVectorizer,
    critical_path_frame,
    firm_features,
    node_deviations,
    service_deviations,
)
from bmeg.paths import cache_dir
from bmeg.version import __version__


def default_run_dir(application: str = "socialnet") -> Path:
    """Where `bmeg train` writes and `bmeg diagnose` reads by default."""
    return cache_dir() / "runs" / application


#: The self-time z-score at which an SVM-routed trace's service scores 0.5 in a detector saved
#: without a `CulpritScorer` (the p90 of a normal node is at z = 1 by construction of the
#: baselines, `bmeg.models.features`).
SVM_SERVICE_Z = 3.0
#: How many ranked services a trace's diagnosis lists.
TOP_SERVICES = 5
#: The warning of a trace above stage 1's threshold that the crowd check did not flag.
CROWD_WARNING = ("not flagged: its score is above stage 1's threshold, but the traces begun just before it "
                 "were slow on most services, or on several a little, and so was it only where they were "
                 "(a stalled or busy machine)")


@dataclass(frozen=True)
class Scores:
    """The models' output over a forest (trace order = forest order). A model that did not run
    on a trace (the router sent it to the other) has NaN there."""

    services: list[str]  # columns of the [T, S] matrices
    node_services: np.ndarray  # [N] service of each node (stores split out)
    node_codes: np.ndarray  # [N] each node's service as its column in `services`
    gnn_anomaly: np.ndarray  # [T] DGCNN P(anomalous)
    gnn_node: np.ndarray  # [N] GCN P(bottleneck) of each node (NaN where the GNN did not run)
    gnn_service: np.ndarray  # [T, S] max GCN node score per service (0 where absent)
    svm_anomaly: np.ndarray  # [T] trace SVM P(anomalous)
    svm_service: np.ndarray  # [T, S] CulpritScorer's P(culprit) of each service, for SVM-routed traces (0 where absent)
    present: np.ndarray  # bool [T, S]
    num_paths: np.ndarray  # [T] distinct root-to-leaf paths
    to_svm: np.ndarray  # bool [T]: routed to the SVM
    route: list[str]  # [T] why
    anomaly: np.ndarray  # [T] routed anomaly score
    anomalous: np.ndarray  # bool [T]: above its model's threshold and not held by the crowd check
    above_threshold: np.ndarray  # bool [T]: above its model's threshold (stage 1's verdict before the crowd check)
    service: np.ndarray  # [T, S] routed service scores
    observation: Observation | None  # what a stream history records of these traces (the model's services)
    crowd_explained: np.ndarray  # bool [T]: the crowd explains the trace's slowness (`bmeg.models.crowd`)
    signs: dict[str, np.ndarray] = field(default_factory=dict)  # per sign [T] (`bmeg.models.signs`): read beside the model

    @property
    def num_services(self) -> np.ndarray:
        return self.present.sum(axis=1)


@dataclass(frozen=True)
class Detector:
    application: str
    encoder: FeatureEncoder
    dgcnn: DGCNN
    gcn: GCNNodeClassifier | GCNNodeEnsemble  # an ensemble: bagged over draws of the twin's faults
    vectorizer: TraceVectorizer
    svm: TraceSVM  # the router's per-trace fallback
    firm: FirmSVM  # FIRM's culprit finder over a window
    thresholds: dict[str, float]  # graph (DGCNN), node (GCN), svm (trace SVM), svm_node (its services), sign:* (signs)
    router: Router
    firm_window: int
    services: list[str]  # the training vocabulary
    service_baseline_us: dict[str, float]  # median self time per trace in normal traces
    hparams: dict
    metrics: dict
    device: torch.device = torch.device("cpu")
    run_dir: Path | None = None
    culprit: CulpritScorer | None = None  # where in an SVM-routed trace (None: own time, as saved before it)
    crowd: CrowdRule | None = CrowdRule()  # None: stage 1 does not set a trace against the crowd

    @property
    def version(self) -> str:
        return f"bmeg-{__version__}/{self.application}/{self.encoder.variant}"

    # -- scoring -----------------------------------------------------------------------------
    def score(self, forest: SpanForest, paths: CriticalPaths | None = None, history: StreamHistory | None = None,
              all_models: bool = False, replay: bool = False, context: SpanForest | None = None,
              crowd: bool = False) -> Scores:
        """Scores of the traces. Each trace reads `history` (none: nothing before it), never its
        batch; with `replay` the forest is a recorded stream and each trace also reads the
        forest's earlier traces, and those of `context` (the stream's traces that are history
        only: a generated dataset's unsampled ones), in time order (training and evaluation).
        The router picks one model per trace, or both run everywhere with `all_models` (evaluation).
        With `crowd` (a verdict given to a user: `diagnose`; not training and evaluation, whose
        metrics stay the models' own) the crowd check reads the traces begun before each trace:
        `history`'s recent nodes and the forest's traces, or with `replay` the forest's
        (`crowd_explained`), with whether each of those traces was above stage 1's threshold."""
        paths = paths or critical_paths(forest)
        service_array = node_services(forest, storage_nodes=True)
        services = service_array.to_numpy(zero_copy_only=False)
        past = None if replay else (history.z_self if history is not None else {})
        x = self.encoder.transform(forest, paths, services, past, context if replay else None)
        codes, names = pd.factorize(services)
        present = np.zeros((forest.num_traces, len(names)), dtype=bool)
        present[forest.trace_index, codes] = True
        keys = operation_key_array(forest, service_array)  # Arrow: looked up and numbered without Python strings
        num_paths = distinct_paths(forest, keys)
        to_svm = self.router.to_svm(present.sum(axis=1), num_paths)
        everything = np.arange(forest.num_traces)
        gnn_anomaly, gnn_node, gnn_service = self._gnn_scores(forest, x, codes, len(names), everything if all_models
                                                              else np.flatnonzero(~to_svm))
        svm_anomaly, svm_service = self._svm_scores(forest, x, keys, codes, present,
                                                    everything if all_models else np.flatnonzero(to_svm))
        z_column = self.encoder.names.index("z_log_self_time_us") if self.encoder.variant != "thesis" else None
        observation = None if z_column is None else Observation(
            services, forest.start_ns[forest.root][forest.trace_index], x[:, z_column])
        # what a history records and the crowd reads of these traces: the model's services only
        recorded = observation.of(self.services) if observation is not None and (history is not None or replay) else None
        raw = Scores(
            services=list(names), node_services=services, node_codes=codes, gnn_anomaly=gnn_anomaly, gnn_node=gnn_node,
            gnn_service=gnn_service, svm_anomaly=svm_anomaly, svm_service=svm_service, present=present, num_paths=num_paths,
            to_svm=to_svm, route=[], anomaly=gnn_anomaly, anomalous=np.zeros(forest.num_traces, bool),
            above_threshold=np.zeros(forest.num_traces, bool), service=gnn_service, observation=recorded,
            crowd_explained=np.zeros(forest.num_traces, dtype=bool), signs=trace_signs(forest, x, self.encoder.names),
        )
        routed = self.route(raw)
        if not crowd:
            return routed
        # the crowd check changes only which traces above their threshold are held: route once
        explained = self.crowd_explained(forest, observation, recorded, history, replay, routed.above_threshold)
        return replace(routed, crowd_explained=explained, anomalous=routed.above_threshold & ~explained)

    def crowd_explained(self, forest: SpanForest, observation: Observation | None, recorded: Observation | None,
                        history: StreamHistory | None, replay: bool, above: np.ndarray) -> np.ndarray:
        """`CrowdRule.explained` against the stream's past: the traces begun before each trace
        among those the stream has brought so far, the history's recent nodes (served) and the
        forest's own traces as the history records them (`recorded`; served or replayed), and
        whether each was above stage 1's threshold (the history's, and `above` [T] for the
        forest's: the alarm share). Which batch an earlier trace came in does not matter; a trace
        begun at the same time or later is never read (`CrowdRule.explained`)."""
        if self.crowd is None or observation is None or recorded is None or not len(observation.services):
            return np.zeros(forest.num_traces, dtype=bool)
        starts = forest.start_ns[forest.root]
        past, past_starts, past_above = [recorded], starts, above
        if history is not None and not replay:  # only the history's batches some trace's crowd reads
            lower, upper = self.crowd.reads(observation.trace_start_ns)
            past = [*history.overlapping(lower, upper), recorded]
            earlier_starts, earlier_above = history.alarms_between(lower, upper)
            past_starts, past_above = np.r_[earlier_starts, starts], np.r_[earlier_above, above]
        share = self.crowd.alarm_share(past_starts, past_above, starts)
        return self.crowd.explained(past, observation, forest.trace_index, forest.num_traces, share)

    def route(self, scores: Scores, router: Router | None = None) -> Scores:
        """Apply the router (this detector's unless given), the thresholds and the crowd check
        (unless this detector has none) to raw scores. A trace is above stage 1's threshold when
        its model's score is, or any sign this detector has a threshold for (`bmeg.models.signs`)."""
        router = router or self.router
        to_svm = router.to_svm(scores.num_services, scores.num_paths)
        anomaly = np.where(to_svm, scores.svm_anomaly, scores.gnn_anomaly)
        service = np.where(to_svm[:, None], scores.svm_service, scores.gnn_service)
        held = scores.crowd_explained & (self.crowd is not None)  # a detector without the rule holds nothing
        above = anomaly >= np.where(to_svm, self.thresholds["svm"], self.thresholds["graph"])
        for sign in signs_above(scores.signs, self.thresholds, len(anomaly)).values():
            above = above | sign
        return replace(scores, to_svm=to_svm, route=router.reasons(scores.num_services, scores.num_paths),
                       anomaly=anomaly, anomalous=above & ~held, above_threshold=above, service=service)

    def _gnn_scores(self, forest: SpanForest, x: np.ndarray, codes: np.ndarray, width: int,
                    traces: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """P(anomalous) per trace, P(bottleneck) per node and its max per (trace, service), for
        `traces` (NaN elsewhere)."""
        anomaly = np.full(forest.num_traces, np.nan)
        node = np.full(forest.num_spans, np.nan)
        service = np.full((forest.num_traces, width), np.nan)
        if len(traces) == 0:
            return anomaly, node, service
        graphs = GraphSet.from_forest(forest, x)
        probabilities = predict_proba({"graph": self.dgcnn, "node": self.gcn}, graphs, traces, self.device)
        rows = graphs.node_rows(traces)
        anomaly[traces] = probabilities["graph"]
        node[rows] = probabilities["node"]
        service[traces] = 0.0
        np.maximum.at(service, (forest.trace_index[rows], codes[rows]), probabilities["node"])
        return anomaly, node, service

    def _svm_scores(self, forest: SpanForest, x: np.ndarray, keys: pa.Array, codes: np.ndarray, present: np.ndarray,
                    traces: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        anomaly = np.full(forest.num_traces, np.nan)
        service = np.full(present.shape, np.nan)
        if len(traces) == 0:
            return anomaly, service
        needed = self.culprit is not None or self.vectorizer.culprit_top > 0
        deviations = (self.culprit_features(forest, x, codes, present.shape[1], traces)
                      if needed and "z_log_self_time_us" in self.encoder.names else None)
        vectors = self.trace_vectors(forest, x, keys, traces, deviations)
        anomaly[traces] = self.svm.predict_proba(vectors)[:, 1]
        service[traces] = self._culprit_scores(forest, x, codes, present, traces, deviations)
        return anomaly, service

    def _culprit_scores(self, forest: SpanForest, x: np.ndarray, codes: np.ndarray, present: np.ndarray,
                        traces: np.ndarray, features: np.ndarray | None) -> np.ndarray:
        """[len(traces), S] for SVM-routed traces: P(culprit) of each present service from its
        deviations in own time, queue and its callers' gap (`features`: `culprit_features` of
        `traces`, given when there is a `CulpritScorer`; 0 where absent). A detector saved
        without one (before it existed) scores own time only, as it did: its largest self-time
        z-score through a logistic centred at `SVM_SERVICE_Z`."""
        if "z_log_self_time_us" not in self.encoder.names:  # thesis features: no baselines to compare with
            return np.full((len(traces), present.shape[1]), 0.5)
        z_self = x[:, self.encoder.names.index("z_log_self_time_us")].astype(np.float64)
        if self.culprit is None:
            largest = np.full(present.shape, -np.inf)
            np.maximum.at(largest, (forest.trace_index, codes), z_self)
            own = largest[traces]
            return np.where(np.isfinite(own), 1.0 / (1.0 + np.exp(-(own - SVM_SERVICE_Z))), 0.0)
        assert features is not None  # computed in `_svm_scores` whenever there is a scorer
        scores = np.zeros(features.shape[:2])
        mask = present[traces]
        if mask.any():
            scores[mask] = self.culprit.predict_proba(features[mask])[:, 1]
        return scores

    def culprit_features(self, forest: SpanForest, x: np.ndarray, codes: np.ndarray, width: int,
                         traces: np.ndarray | None = None) -> np.ndarray:
        """`CulpritScorer`'s input: [len(traces), width, 3] (`service_deviations`; all traces by
        default, else only `traces`' nodes are read) from the GNN's node features `x`."""
        column = self.encoder.names.index
        return service_deviations(forest, codes, width, forest.spans["kind"],
                                  x[:, column("z_log_self_time_us")].astype(np.float64),
                                  x[:, column("z_log_wait_us")].astype(np.float64), traces)

    def trace_vectors(self, forest: SpanForest, x: np.ndarray, keys: np.ndarray | pa.Array,
                      traces: np.ndarray | None = None,
                      services: np.ndarray | None = None) -> np.ndarray:
        """The trace SVM's input: [len(traces), vectorizer columns] (all traces by default) from
        the GNN's node features `x`, and the traces' `culprit_features` (`services`; computed
        here when the vectorizer reads them and they are not given)."""
        traces = np.arange(forest.num_traces) if traces is None else np.asarray(traces, dtype=np.int64)
        if self.vectorizer.culprit_top and services is None:
            codes, names = pd.factorize(node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False))
            services = self.culprit_features(forest, x, codes, len(names), traces)
        row_of = np.full(forest.num_traces, -1, dtype=np.int64)
        row_of[traces] = np.arange(len(traces))
        nodes = np.flatnonzero(row_of[forest.trace_index] >= 0)
        deviations = self.vectorizer.deviations
        node_keys = keys.take(pa.array(nodes)) if isinstance(keys, pa.Array) else keys[nodes]
        return self.vectorizer.transform(row_of[forest.trace_index[nodes]], len(traces), node_keys,
                                         self_time_ns(forest)[nodes] / 1e3,
                                         node_deviations(x[nodes], self.encoder.names, deviations) if deviations
                                         else None, services)

    def firm_scores(self, window: SpanForest, paths: CriticalPaths | None = None) -> tuple[list[str], np.ndarray]:
        """FIRM's question over a window of traces: for each trace and service on its critical
        path, the SVM's culprit probability from (RI, CI) over the trailing `firm_window` traces
        of the window (0 off the path). Returns the services (columns) and [T, S]."""
        paths = paths or critical_paths(window)
        services = node_services(window, storage_nodes=True).to_numpy(zero_copy_only=False)
        frame = critical_path_frame(window, services, paths)
        names = [name for name in frame.columns if not name.startswith("__")]
        features = firm_features(frame, self.firm_window)
        on_path = frame[names].notna().to_numpy()
        scores = np.zeros(on_path.shape)
        if on_path.any():
            scores[on_path] = self.firm.predict_proba(features[on_path])[:, 1]
        return names, scores

    # -- diagnosis ---------------------------------------------------------------------------
    def diagnose(self, spans: pa.Table | SpanForest, window: bool = False,
                 history: StreamHistory | None = None, replay: bool = False,
                 ranker: WindowRanker | None = None) -> Diagnosis:
        """Diagnose every trace of a span table (or an assembled forest). Each trace reads
        `history` as it was before this call; the traces are then recorded into it. With
        `replay` the spans are a recorded stream (a file, a dataset): each trace also reads the
        earlier traces among them, as it would have read them live, never the later ones.
        With `window`, the services are also ranked over all the traces: by `ranker` (bmeg's
        ranker against a normal period, `bmeg.models.window`) when given, else by the mean node
        score; `window_method` says which."""
        # Plain values for every trace, validated in one pydantic call: building ~30 small
        # models per trace one by one cost as much as running the models.
        return Diagnosis.model_validate(self.diagnosis_document(spans, window, history, replay, ranker))

    def diagnosis_document(self, spans: pa.Table | SpanForest, window: bool = False,
                           history: StreamHistory | None = None, replay: bool = False,
                           ranker: WindowRanker | None = None) -> dict:
        """The `Diagnosis` as plain values, laid out as `Diagnosis.model_dump()` lays it out.
        `diagnose` validates it; an output that only serialises it (the Kafka consumer, with
        `bmeg.diagnosis.single_trace_json`) skips building the typed objects."""
        forest = spans if isinstance(spans, SpanForest) else assemble(spans, on_bad_trace="raise")
        paths = critical_paths(forest)
        # a window ranked against a normal period reads the GNN's node scores of every trace
        # (`gnn_window_scores`); each trace's verdict is still its routed model's
        ranked = window and ranker is not None
        scores = self.score(forest, paths, history, replay=replay, crowd=True, all_models=ranked)
        if history is not None and scores.observation is not None:
            # only the model's own services: invented names in spans must not grow the history
            history.record(scores.observation)
            history.record_alarms(forest.start_ns[forest.root], scores.above_threshold)
        ranking, method, health = None, None, None
        if window and ranker is not None:
            ranking, health = self._ranked_against_normal(ranker, forest, scores, replay)
            method = ranker.method
        elif window:
            ranking, method = self._window_ranking(scores), WINDOW_MEAN_NODE_SCORE
        return {
            "model_version": self.version, "application": self.application,
            "traces": self._trace_diagnoses(forest, scores, paths),
            "ranking": ranking, "window_method": method, "window_health": health,
        }

    def _ranked_against_normal(self, ranker: WindowRanker, forest: SpanForest, scores: Scores,
                               replay: bool) -> tuple[list[dict], dict | None]:
        """`ranker`'s ranking of the window and its `WindowHealth`, as plain values. The traces' scores serve it when
        they are what the ranker would compute (replayed, by the same baselines, on a forest
        with no internal spans to fold), so a bootstrapped run's window is scored once."""
        view = rpc_view(forest)
        reuse = replay and view is forest and ranker.scores_reusable(self.encoder)
        ranking, health = ranker.ranking(view, scores if reuse else None)
        return [entry.model_dump() for entry in ranking], None if health is None else health.model_dump()

    def _trace_diagnoses(self, forest: SpanForest, scores: Scores, paths: CriticalPaths) -> list[dict]:
        """Each trace's `TraceDiagnosis` as a dict, every field in order; the per-service work is
        done for all traces at once."""
        names = scores.services
        node_threshold = np.where(scores.to_svm, self.thresholds["svm_node"], self.thresholds["node"])
        ranked = _ranked_columns(scores.service, scores.present, TOP_SERVICES)
        ranked_score = np.take_along_axis(scores.service, ranked, axis=1)
        ranked_bottleneck = scores.anomalous[:, None] & (ranked_score >= node_threshold[:, None])
        latency = _service_latency_us(forest, scores)
        by_latency = _ranked_columns(latency, scores.present)
        baselines = [self.service_baseline_us.get(name) for name in names]
        # Where a service has no baseline, its ratio is None (below); 1 only avoids dividing by 0.
        ratio = latency / np.array([baseline or 1.0 for baseline in baselines])
        present_count = scores.present.sum(axis=1)
        fired = signs_above(scores.signs, self.thresholds, forest.num_traces)
        signs = ([list(compress(list(fired), row)) for row in zip(*fired.values(), strict=True)] if fired
                 else [[] for _ in range(forest.num_traces)])
        rows = zip(
            forest.trace_ids, np.diff(forest.trace_offsets).tolist(), (forest.duration_ns[forest.root] / 1e3).tolist(),
            scores.anomalous.tolist(), scores.anomaly.tolist(), scores.to_svm.tolist(),
            np.minimum(present_count, TOP_SERVICES).tolist(), ranked.tolist(), ranked_score.tolist(),
            ranked_bottleneck.tolist(), present_count.tolist(), by_latency.tolist(),
            np.take_along_axis(latency, by_latency, axis=1).tolist(), np.take_along_axis(ratio, by_latency, axis=1).tolist(),
            _path_steps(forest, scores, paths), self._warnings(forest, scores), scores.route,
            forest.start_ns[forest.root].tolist(), signs,
        )
        return [
            {
                "trace_id": trace_id, "spans": spans, "total_us": total_us, "anomalous": anomalous,
                "anomaly_score": anomaly, "threshold": self.thresholds["svm" if to_svm else "graph"],
                "model": "svm" if to_svm else "gnn", "route": route, "signs": signs_t,
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
                 present_t, by_latency_t, latency_t, ratio_t, path, warnings, route, start_ns, signs_t) in rows
        ]

    def _warnings(self, forest: SpanForest, scores: Scores) -> list[list[str]]:
        """Per trace: the repairs made to it, the services the model does not know, and whether
        the crowd check kept it from being flagged."""
        repairs = _warnings_by_trace(forest)
        alphabetical = sorted(range(len(scores.services)), key=scores.services.__getitem__)
        unknown = (scores.present & ~np.isin(scores.services, self.services))[:, alphabetical]
        names = [scores.services[i] for i in alphabetical]
        warnings = []
        crowd_held = scores.above_threshold & ~scores.anomalous
        for trace_id, unknown_t, held in zip(forest.trace_ids, unknown.tolist(), crowd_held.tolist()):
            trace_warnings = list(repairs.get(trace_id, []))
            if any(unknown_t):
                trace_warnings.append("services unknown to the model (scored without a baseline): "
                                      + ", ".join(compress(names, unknown_t)))
            if held:
                trace_warnings.append(CROWD_WARNING)
            warnings.append(trace_warnings)
        return warnings

    def _window_ranking(self, scores: Scores) -> list[dict]:
        """Services over the window with no normal period at hand: mean score over the anomalous
        traces (all, weighted, if none)."""
        weights = scores.anomalous.astype(float) if scores.anomalous.any() else scores.anomaly
        seen = np.maximum((weights[:, None] * scores.present).sum(axis=0), 1e-12)
        mean = (weights[:, None] * scores.service).sum(axis=0) / seen
        order = np.argsort(-mean, kind="stable")
        threshold = self.thresholds["node"]
        return [{"service": scores.services[i], "score": float(mean[i]), "bottleneck": bool(mean[i] >= threshold)}
                for i in order if scores.present[:, i].any()]

    # -- persistence -------------------------------------------------------------------------
    def save(self, run_dir: Path) -> Detector:
        """Write the run directory; returns the detector with its `run_dir` set."""
        state = {
            "application": self.application, "encoder": self.encoder.to_state(),
            "dgcnn": self.dgcnn.state_dict(), "gcn": self.gcn.state_dict(), "thresholds": self.thresholds,
            "vectorizer": self.vectorizer.to_state(), "svm": self.svm.to_state(), "firm": self.firm.to_state(),
            "router": self.router.to_state(), "firm_window": self.firm_window,
            "services": self.services, "service_baseline_us": self.service_baseline_us,
            "hparams": self.hparams, "metrics": self.metrics,
            "culprit": None if self.culprit is None else self.culprit.to_state(),
        }
        save_checkpoint(Path(run_dir), state)
        return replace(self, run_dir=Path(run_dir))

    @classmethod
    def load(cls, run_dir: str | Path, device: str = "auto", application: str | None = None) -> Detector:
        state = load_checkpoint(Path(run_dir), application=application)
        try:
            encoder = FeatureEncoder.from_state(state["encoder"])
            hparams = state["hparams"]
            dgcnn = DGCNN(encoder.num_features, **hparams["dgcnn"])
            gcn = node_classifier(encoder.num_features, **hparams["gcn"])
            dgcnn.load_state_dict(state["dgcnn"])
            gcn.load_state_dict(state["gcn"])
            vectorizer = TraceVectorizer.from_state(state["vectorizer"])
            svm, firm = TraceSVM.from_state(state["svm"]), FirmSVM.from_state(state["firm"])
            router = Router.from_state(state["router"])
            culprit = None if state.get("culprit") is None else CulpritScorer.from_state(state["culprit"])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{run_dir} does not fit this bmeg ({error}): retrain with `bmeg train`") from error
        target = resolve_device(device)
        if target.type == "cpu":
            limit_cpu_threads()
        return cls(
            application=state["application"], encoder=encoder, dgcnn=dgcnn.to(target).eval(),
            gcn=gcn.to(target).eval(), vectorizer=vectorizer, svm=svm, firm=firm, thresholds=state["thresholds"],
            router=router, firm_window=state["firm_window"], services=state["services"],
            service_baseline_us=state["service_baseline_us"], hparams=hparams, metrics=state["metrics"],
            device=target, run_dir=Path(run_dir), culprit=culprit,
        )


def _ranked_columns(values: np.ndarray, present: np.ndarray, limit: int | None = None) -> np.ndarray:
    """Per row, column indices: present columns by descending value first (ties in column
    order), then the absent ones; the first `limit` columns only when given."""
    order = np.lexsort((-values, ~present), axis=1)
    return order if limit is None else order[:, :limit]


def _service_latency_us(forest: SpanForest, scores: Scores) -> np.ndarray:
    """[T, S] each service's self time per trace (µs), in the columns of the score matrices."""
    cells = forest.trace_index * len(scores.services) + scores.node_codes
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
    """The repairs of each trace, as sentences."""
    by_trace: dict[str, list[str]] = {}
    for repair in forest.repairs:
        by_trace.setdefault(repair.trace_id, []).append(str(repair))
    return by_trace
