"""Root-cause rankers over a window of traces, all behind one interface.

`ranker.rank(window, normal)` takes the window's traces (an assembled forest in the RPC view,
see `bmeg.faultinject.twin.rpc_view`) and statistics of a normal period, and returns
`[(service, score), ...]`, most suspicious first.

- `bmeg`: the rank fusion of the GNN's window ranking and how far each service's own time
  moved from the normal period (see `BmegRanker`).
- `bmeg-gnn`: the GNN alone: each service's mean node score in the window against its mean
  in the normal period (see `node_score_shift`).
- `firm-svm`: FIRM's SVM scores on the critical path, averaged over the window.
- `ochiai-spectrum (internal)`: spectrum ranking (Ochiai) of services over anomalous vs normal
  traces; an internal approximation in MicroRank's family, *not* MicroRank (no PageRank
  weighting; see `bmeg.evaluation.rcaeval` for the published method).
- `jaccard-association (internal)`: services whose anomalous spans are over-represented in
  anomalous traces; an internal approximation in TraceRCA's family, *not* TraceRCA.
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
#: A service's structure shift below this (5% of its spans changed) counts as none.
STRUCTURE_NOISE = 0.05


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
    server_ns: pd.Series  # by span key of a non-client span: median self ns
    gap_ns: pd.Series  # by client span key: median ns a call spent outside both processes
    children: pd.Series  # by span key: mean number of children
    errors: pd.Series  # by span key: share of spans where an error begins

    @classmethod
    def from_forest(cls, forest: SpanForest) -> NormalStats:
        keys = span_keys(forest)
        durations = pd.Series(forest.duration_ns, index=keys)
        counted, exclusive = exclusive_time(forest)
        frame = pd.DataFrame({"service": counted, "key": keys, "ns": np.maximum(exclusive, MIN_EXCLUSIVE_NS)})
        own = _own_times(forest)
        return cls(
            forest=forest,
            p95_ns=durations.groupby(level=0).quantile(ANOMALY_QUANTILE),
            exclusive_ns=frame.groupby(["service", "key"])["ns"].median(),
            server_ns=own[~own["client"]].groupby("key")["ns"].median(),
            gap_ns=own[own["client"]].groupby("key")["ns"].median(),
            children=pd.Series(_child_counts(forest), index=keys).groupby(level=0).mean(),
            errors=pd.Series(_error_origins(forest), index=keys).groupby(level=0).mean(),
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

    def service_shift(self, forest: SpanForest) -> pd.Series:
        """Per service, how far (log2) its own time moved, with call gaps split between the ends.

        A call's gap (network and queues) grows when the callee is slow to take or answer it,
        and also when the *caller* is slow to send and receive: then every callee of that caller
        shows it. So the median shift over a caller's outgoing calls (to two callees or more) is
        the caller's, and what an edge shows beyond it is the callee's (median over its
        callers). A service's shift is the largest of: its own spans' self time, its part as a
        caller, its part as a callee.
        """
        own = _own_times(forest)
        normal = np.where(own["client"], self.gap_ns.reindex(own["key"]).to_numpy(),
                          self.server_ns.reindex(own["key"]).to_numpy())
        own["shift"] = np.log2(own["ns"] / normal)
        own = own[~np.isnan(normal)]
        servers = own[~own["client"]].groupby("service")["shift"].mean()
        edges = own[own["client"]].groupby(["service", "callee"])["shift"].mean()
        by_caller = edges.groupby(level="service")
        # with one callee, a caller-side and a callee-side slowdown look alike: the callee gets it
        caller = by_caller.median().where(by_caller.size() >= 2, 0.0)
        callee = (edges - caller.reindex(edges.index.get_level_values("service")).to_numpy()).groupby(level="callee").median()
        return pd.concat([servers, caller, callee], axis=1).max(axis=1)


    def structure_shift(self, forest: SpanForest) -> pd.Series:
        """Per service, how far its operations' structure moved from the normal period: per
        operation, |mean children - normal mean| / max(normal mean, 1) plus the rise of the
        share of its spans where an error *begins* (an error span with no error child: callers
        that record the failed call are not where it began); a service's shift is the mean
        over its spans. Means against means, so an operation whose call count varies from
        request to request is not a change. A code fault (an early return, an exception)
        changes the calls a service makes and its status, not its time; the change counts for
        the service that made (or skipped) the calls. Operations the normal period never saw
        are not scored."""
        keys = span_keys(forest)
        frame = pd.DataFrame({"key": keys, "children": _child_counts(forest), "errors": _error_origins(forest)})
        by_key = frame.groupby("key").agg(children=("children", "mean"), errors=("errors", "mean"),
                                          spans=("children", "size"))
        normal_children = self.children.reindex(by_key.index)
        change = (by_key["children"] - normal_children).abs() / np.maximum(normal_children, 1.0)
        change += (by_key["errors"] - self.errors.reindex(by_key.index)).clip(lower=0.0)
        known = change.notna()
        service = pd.Series(forest.spans["service"].to_numpy(zero_copy_only=False), index=keys).groupby(level=0).first()
        weighted = (change[known] * by_key["spans"][known]).groupby(service.reindex(change[known].index)).sum()
        return weighted / by_key["spans"][known].groupby(service.reindex(change[known].index)).sum()


def _child_counts(forest: SpanForest) -> np.ndarray:
    has_parent = forest.parent >= 0
    return np.bincount(forest.parent[has_parent], minlength=forest.num_spans).astype(np.float64)


def _error_origins(forest: SpanForest) -> np.ndarray:
    """1.0 where a span has an error status and none of its children has."""
    error = pc.equal(forest.spans["status"], "error").to_numpy(zero_copy_only=False)
    has_parent = forest.parent >= 0
    child_errors = np.bincount(forest.parent[has_parent], weights=error[has_parent], minlength=forest.num_spans)
    return (error & (child_errors == 0)).astype(np.float64)


def _own_times(forest: SpanForest) -> pd.DataFrame:
    """Per span: service, key, own ns (self time; a client span's is its call's gap), client?, callee."""
    service = forest.spans["service"].to_numpy(zero_copy_only=False)
    _, is_client = span_roles(forest)
    callee = np.full(forest.num_spans, None, dtype=object)
    child = np.flatnonzero(forest.parent >= 0)
    called = child[is_client[forest.parent[child]]]
    callee[forest.parent[called]] = service[called]
    return pd.DataFrame({"service": service, "key": span_keys(forest), "client": is_client & (callee != None),  # noqa: E711
                         "callee": callee, "ns": np.maximum(self_time_ns(forest), MIN_EXCLUSIVE_NS).astype(float)})


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


class StructureRanker:
    """A rule for code faults: rank services by how far their spans' calls and status moved
    from the normal period (`NormalStats.structure_shift`)."""

    name = "structure-shift"

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        return _ranking(normal.structure_shift(window))


class MicroRankRanker:
    """Spectrum analysis: Ochiai of 'service covered' vs 'trace anomalous' (not the published MicroRank)."""

    name = "ochiai-spectrum (internal)"

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        covered = _presence(window).to_numpy()
        failed = normal.anomalous_traces(window)[:, None]
        ef = (covered & failed).sum(axis=0)
        ep = (covered & ~failed).sum(axis=0)
        nf = (~covered & failed).sum(axis=0)
        ochiai = ef / np.sqrt(np.maximum((ef + nf) * (ef + ep), 1))
        return _ranking(pd.Series(ochiai, index=_presence(window).columns))


class TraceRCARanker:
    """Association (not the published TraceRCA): services with anomalous spans, over-represented in anomalous traces.

    Score = Jaccard of {anomalous traces} and {traces where the service has an anomalous span},
    i.e. support and confidence of 'service anomalous -> trace anomalous' in one number.
    """

    name = "jaccard-association (internal)"

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
        # the two forests used last: a window and the normal period, which every window is
        # compared with (keeping only the last one re-scored the normal period twice per window)
        self._held: dict[int, tuple[SpanForest, object]] = {}

    def __call__(self, window: SpanForest):
        held = self._held.pop(id(window), None)
        if held is None or held[0] is not window:
            # the window is a recorded slice of a stream: each trace reads the window's earlier traces
            held = (window, self.detector.score(window, replay=True))
        # the two used last stay, the latest at the end
        self._held = {**dict(list(self._held.items())[-1:]), id(window): held}
        return held[1]


def _mean_over(scores, weights: np.ndarray, values: np.ndarray) -> pd.Series:
    """Per service, the mean of `values` [T, S] over the traces where it is present, weighted by trace."""
    present = scores.present & (weights[:, None] > 0)
    seen = (weights[:, None] * present).sum(axis=0)
    mean = (weights[:, None] * values * present).sum(axis=0) / np.maximum(seen, 1e-12)
    return pd.Series(mean[seen > 0], index=np.asarray(scores.services)[seen > 0])


class FirmSvmRanker:
    """FIRM: the detector's FIRM SVM culprit score of each service on the critical path (RI and CI
    over the window's traces), averaged over the traces where the service is on the path."""

    name = "firm-svm"

    def __init__(self, detector):
        self.detector = detector

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        services, scores = self.detector.firm_scores(window)
        on_path = scores > 0
        mean = scores.sum(axis=0) / np.maximum(on_path.sum(axis=0), 1)
        return _ranking(pd.Series(mean, index=services))


def node_score_shift(window_scores, normal_scores) -> pd.Series:
    """Per service: its nodes' mean GNN score in the window minus the same in the normal period.

    A mean over the service's visits (nodes), not a sum or a per-trace maximum, so a service is
    not ranked up for being visited often or having many nodes per trace; minus its own
    normal-period mean, so a service the model always scores high (a large orchestrator whose
    spans are long whatever happens) is ranked by what changed, not by where time goes.
    A service the normal period never saw is compared with 0.
    """
    def mean_by_service(scores) -> pd.Series:
        return pd.Series(scores.gnn_node).groupby(scores.node_services).mean()

    window = mean_by_service(window_scores)
    return window - mean_by_service(normal_scores).reindex(window.index).fillna(0.0).to_numpy()


class GnnRanker:
    """The GNN alone: each service's mean node score in the window against the normal period
    (`node_score_shift`); no rule, no stage-1 verdict."""

    name = "bmeg-gnn"

    def __init__(self, scores: _DetectorScores):
        self.scores = scores

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        return _ranking(node_score_shift(self.scores(window), self.scores(normal.forest)))


def with_normal_baselines(detector, normal: SpanForest):
    """The detector with its feature baselines refitted on the normal period of the traces at hand.

    A model trained on a twin learned what *deviation from normal* looks like; refitting the
    per-operation baselines (medians and spreads, no labels) makes those deviations mean the
    same on the real system as on the twin.
    """
    from dataclasses import replace

    from bmeg.models.features import FeatureEncoder

    encoder = FeatureEncoder(detector.encoder.variant, detector.encoder.history).fit(normal)
    return replace(detector, encoder=encoder)


def rank_fusion(*scores: pd.Series) -> pd.Series:
    """Reciprocal-rank fusion: sum over the rankings of 1 / (1 + rank), rank 1 = first.

    Each ranking counts by its order only, so one ranking's scale (a low GNN score, a large
    time shift) can never bury what the other ranks first; a service ranked first by one and
    second by the other beats one ranked first by one and tenth by the other. Services missing
    from a ranking are ranked after all of its services. Exact ties keep the first ranking's order.
    """
    index = scores[0].index
    for series in scores[1:]:
        index = index.union(series.index, sort=False)
    total = pd.Series(0.0, index=index)
    for series in scores:
        ranks = series.rank(ascending=False, method="min").reindex(index).fillna(len(series) + 1)
        total += 1.0 / (1.0 + ranks)
    first = scores[0].rank(ascending=False, method="first").reindex(index).fillna(len(index) + 1)
    return total.iloc[np.lexsort((first.to_numpy(), -total.to_numpy()))]


class BmegRanker:
    """B-MEG on a window: reciprocal-rank fusion (`rank_fusion`) of how far each service's own
    time moved from the normal period (`NormalStats.service_shift`, call gaps split between
    caller and callee) and the GNN's own window ranking (`node_score_shift`): by rank, not by
    product, so a low GNN score cannot bury the service the time shift ranks first. Services
    whose structure moved (`NormalStats.structure_shift` at least `STRUCTURE_NOISE`: a code
    fault) come before the others, by how far it moved; on simulated latency faults no
    service's structure moves that far, so there the order is the fusion's."""

    name = "bmeg"

    def __init__(self, scores: _DetectorScores):
        self.scores = scores

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        gnn = node_score_shift(self.scores(window), self.scores(normal.forest))
        fused = rank_fusion(normal.service_shift(window), gnn)
        structure = normal.structure_shift(window).reindex(fused.index).fillna(0.0)
        changed = structure >= STRUCTURE_NOISE
        # services whose structure changed come first, by how much; then the rest, by rank fusion
        first = structure[changed].sort_values(ascending=False, kind="stable")
        return _ranking_in_order(pd.concat([first + 1.0 + fused.max(), fused[~changed]]))


def _ranking_in_order(scores: pd.Series) -> Ranking:
    return [(str(service), float(score)) for service, score in scores.items()]


def default_rankers(detector=None, normal: SpanForest | None = None, published: bool = True) -> list[Ranker]:
    """Every ranker: the detector-based ones first when a detector (and its normal period) is
    given; RCAEval's TraceRCA and MicroRank when `published` and RCAEval is installed."""
    from bmeg.evaluation.rcaeval import METHODS, RCAEvalRanker, rcaeval_available

    baselines: list[Ranker] = [SelfTimeRanker(), StructureRanker()]
    if published and rcaeval_available():
        baselines += [RCAEvalRanker(name) for name in METHODS]
    baselines += [MicroRankRanker(), TraceRCARanker()]
    if detector is None:
        return baselines
    if normal is not None:
        detector = with_normal_baselines(detector, normal)
    scores = _DetectorScores(detector)
    return [BmegRanker(scores), GnnRanker(scores), FirmSvmRanker(detector), *baselines]
