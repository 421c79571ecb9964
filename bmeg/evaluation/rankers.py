"""Root-cause rankers over a window of traces, all behind one interface.

`ranker.rank(window, normal)` takes the window's traces (an assembled forest in the RPC view,
see `bmeg.faultinject.twin.rpc_view`) and statistics of a normal period, and returns
`[(service, score), ...]`, most suspicious first.

- `bmeg`: the detector's GNN node scores, averaged over the window's anomalous traces, times
  how far each service's exclusive time moved from the normal period (see `BmegRanker`).
- `bmeg-gnn`: the detector's own window ranking (mean GNN score over anomalous traces).
- `firm-svm`: FIRM's SVM scores on the critical path, averaged over the window.
- `microrank`: spectrum ranking (Ochiai) of services over anomalous vs normal traces.
- `tracerca`: services whose anomalous spans are over-represented in anomalous traces.
- `self-time`: the increase of each service's exclusive time against the normal period.

Shared definitions: a span is *anomalous* when its duration is above the normal period's p95
of its (service, operation); a trace is anomalous when its root is. A span's *exclusive* time
is its duration not covered by its children; a client span's exclusive time (network and the
callee's queues) counts for the service it called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from bmeg.faultinject.twin import span_roles
from bmeg.graphs import SpanForest
from bmeg.graphs.features import self_time_ns

Ranking = list[tuple[str, float]]
#: The quantile of the normal period above which a span is anomalous.
ANOMALY_QUANTILE = 0.95
#: Exclusive times below this (ns) count as this: keeps ratios of tiny times sane.
MIN_EXCLUSIVE_NS = 10_000


def span_keys(forest: SpanForest) -> np.ndarray:
    """`service\\x1foperation` of each span."""
    return pc.binary_join_element_wise(forest.spans["service"], forest.spans["operation"], "\x1f").to_numpy(
        zero_copy_only=False)


def exclusive_time(forest: SpanForest) -> tuple[np.ndarray, np.ndarray]:
    """(service it counts for, exclusive ns) per span; a client span's time goes to its callee."""
    service = forest.spans["service"].to_numpy(zero_copy_only=False).copy()
    _, is_client = span_roles(forest)
    parent = forest.parent
    child = np.flatnonzero(parent >= 0)
    called = child[is_client[parent[child]]]
    service[parent[called]] = service[called]
    return service, self_time_ns(forest).astype(np.float64)


@dataclass
class NormalStats:
    """What the rankers compare a window with, from a fault-free period."""

    forest: SpanForest  # the normal traces themselves (RPC view)
    p95_ns: pd.Series  # by span key: duration quantile above which a span is anomalous
    exclusive_ns: pd.Series  # by (counted service, span key): median exclusive ns

    @classmethod
    def from_forest(cls, forest: SpanForest) -> NormalStats:
        keys = span_keys(forest)
        durations = pd.Series(forest.duration_ns, index=keys)
        counted, exclusive = exclusive_time(forest)
        frame = pd.DataFrame({"service": counted, "key": keys, "ns": np.maximum(exclusive, MIN_EXCLUSIVE_NS)})
        return cls(
            forest=forest,
            p95_ns=durations.groupby(level=0).quantile(ANOMALY_QUANTILE),
            exclusive_ns=frame.groupby(["service", "key"])["ns"].median(),
        )

    def anomalous_spans(self, forest: SpanForest) -> np.ndarray:
        limit = self.p95_ns.reindex(span_keys(forest)).to_numpy()
        return forest.duration_ns > np.nan_to_num(limit, nan=np.inf)

    def anomalous_traces(self, forest: SpanForest) -> np.ndarray:
        return self.anomalous_spans(forest)[forest.root]

    def exclusive_increase(self, forest: SpanForest) -> pd.Series:
        """Per counted service: mean log2 of exclusive time over its normal median (0: unchanged)."""
        counted, exclusive = exclusive_time(forest)
        index = pd.MultiIndex.from_arrays([counted, span_keys(forest)])
        normal = self.exclusive_ns.reindex(index).to_numpy()
        known = ~np.isnan(normal)
        ratio = np.log2(np.maximum(exclusive[known], MIN_EXCLUSIVE_NS) / normal[known])
        return pd.Series(ratio).groupby(counted[known]).mean()


class Ranker(Protocol):
    name: str

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking: ...


def _ranking(scores: pd.Series) -> Ranking:
    ordered = scores.sort_values(ascending=False, kind="stable")
    return [(str(service), float(score)) for service, score in ordered.items()]


def _presence(forest: SpanForest) -> pd.DataFrame:
    """bool [trace, service]: the trace has a span of the service."""
    frame = pd.DataFrame({"trace": forest.trace_index, "service": forest.spans["service"].to_numpy(zero_copy_only=False)})
    return pd.crosstab(frame["trace"], frame["service"]).gt(0).reindex(range(forest.num_traces), fill_value=False)


class SelfTimeRanker:
    """The simplest rule: rank services by how much their exclusive time grew."""

    name = "self-time"

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        return _ranking(normal.exclusive_increase(window))


class MicroRankRanker:
    """Spectrum analysis (MicroRank-style): Ochiai of 'service covered' vs 'trace anomalous'."""

    name = "microrank"

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        covered = _presence(window).to_numpy()
        failed = normal.anomalous_traces(window)[:, None]
        ef = (covered & failed).sum(axis=0)
        ep = (covered & ~failed).sum(axis=0)
        nf = (~covered & failed).sum(axis=0)
        ochiai = ef / np.sqrt(np.maximum((ef + nf) * (ef + ep), 1))
        return _ranking(pd.Series(ochiai, index=_presence(window).columns))


class TraceRCARanker:
    """Association (TraceRCA-style): services with anomalous spans, over-represented in anomalous traces.

    Score = Jaccard of {anomalous traces} and {traces where the service has an anomalous span},
    i.e. support and confidence of 'service anomalous -> trace anomalous' in one number.
    """

    name = "tracerca"

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        frame = pd.DataFrame({
            "trace": window.trace_index,
            "service": window.spans["service"].to_numpy(zero_copy_only=False),
            "anomalous": normal.anomalous_spans(window),
        })
        flagged = frame[frame["anomalous"]].drop_duplicates(["trace", "service"])
        failed = set(np.flatnonzero(normal.anomalous_traces(window)).tolist())
        scores = {}
        for service, group in flagged.groupby("service"):
            traces = set(group["trace"].tolist())
            scores[service] = len(traces & failed) / max(len(traces | failed), 1)
        for service in frame["service"].unique():
            scores.setdefault(service, 0.0)
        return _ranking(pd.Series(scores, dtype=float))


class _DetectorScores:
    """The detector's scores of one window, computed once for every detector-based ranker."""

    def __init__(self, detector):
        self.detector = detector
        self._last: tuple[int, object] | None = None

    def __call__(self, window: SpanForest):
        if self._last is None or self._last[0] != id(window):
            self._last = (id(window), self.detector.score(window))
        return self._last[1]


def _mean_over(scores, rows: np.ndarray, values: np.ndarray) -> pd.Series:
    """Mean of values[rows] per service, over the traces where the service is present."""
    seen = np.maximum(scores.present[rows].sum(axis=0), 1)
    mean = values[rows].sum(axis=0) / seen
    present = scores.present[rows].any(axis=0)
    return pd.Series(mean[present], index=np.asarray(scores.services)[present])


class FirmSvmRanker:
    """FIRM: the detector's SVM score of each service on the critical path, averaged over the window."""

    name = "firm-svm"

    def __init__(self, scores: _DetectorScores):
        self.scores = scores

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        scores = self.scores(window)
        return _ranking(_mean_over(scores, np.arange(window.num_traces), scores.svm_service))


class GnnRanker:
    """The detector's window ranking: mean routed service score over the anomalous traces."""

    name = "bmeg-gnn"

    def __init__(self, scores: _DetectorScores):
        self.scores = scores

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        scores = self.scores(window)
        rows = np.flatnonzero(scores.anomalous)
        if len(rows) == 0:  # nothing flagged: weigh every trace by its anomaly score
            rows = np.arange(window.num_traces)
        return _ranking(_mean_over(scores, rows, scores.service))


def with_normal_baselines(detector, normal: SpanForest):
    """The detector with its feature baselines refitted on the normal period of the traces at hand.

    A model trained on a twin learned what *deviation from normal* looks like; refitting the
    per-operation baselines (medians and spreads, no labels) makes those deviations mean the
    same on the real system as on the twin.
    """
    from dataclasses import replace

    from bmeg.models.features import FeatureEncoder

    encoder = FeatureEncoder(detector.encoder.variant, detector.encoder.history).fit(normal)
    return replace(detector, encoder=encoder, recent=None)


class BmegRanker:
    """B-MEG on a window: the GNN's mean node score over anomalous traces, weighed by how far each
    service's exclusive time moved from the normal period (the detector's scores say which
    services look like bottlenecks trace by trace; the normal-period comparison says which of
    them changed since the faults began)."""

    name = "bmeg"

    def __init__(self, scores: _DetectorScores):
        self.gnn = GnnRanker(scores)

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        gnn = pd.Series(dict(self.gnn.rank(window, normal)))
        moved = normal.exclusive_increase(window).reindex(gnn.index).fillna(0.0).clip(lower=0.0)
        return _ranking(gnn * (1.0 + moved))


def default_rankers(detector=None, normal: SpanForest | None = None) -> list[Ranker]:
    """Every ranker: the detector-based ones first when a detector (and its normal period) is given."""
    baselines: list[Ranker] = [MicroRankRanker(), TraceRCARanker(), SelfTimeRanker()]
    if detector is None:
        return baselines
    if normal is not None:
        detector = with_normal_baselines(detector, normal)
    scores = _DetectorScores(detector)
    return [BmegRanker(scores), GnnRanker(scores), FirmSvmRanker(scores), *baselines]
