"""Root-cause rankers over a window of traces, all behind one interface.

`ranker.rank(window, normal)` takes the window's traces (an assembled forest in the RPC view,
see `bmeg.graphs.rpc.rpc_view`) and statistics of a normal period, and returns
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

What a window is compared with, and the interface every ranker follows (`Ranker`, `Ranking`,
`NormalStats`), are in `bmeg.evaluation.normal`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bmeg.diagnosis import ServiceScore
from bmeg.evaluation.normal import NormalStats, Ranker, Ranking
from bmeg.graphs import SpanForest

#: A service's structure shift counts as a change only above this floor ...
STRUCTURE_FLOOR = 0.1
#: ... plus this many times the service's own normal-period noise (`NormalStats.structure_noise`).
NOISE_FACTOR = 2.0
#: A service whose time shift (log2) exceeds every other service's by this much is decisive.
DECISIVE_LEAD = 2.0


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
    whose structure moved beyond their own normal noise (`structure_changed`: a code fault)
    come before the others, by how far it moved; on simulated latency faults no service's
    structure moves at all, so there the order is the fusion's. Then a decisive time shift
    of a call gap (`decisive_shift` of the caller and callee parts) comes before the fusion's
    order."""

    name = "bmeg"

    def __init__(self, scores: _DetectorScores):
        self.scores = scores

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        gnn = node_score_shift(self.scores(window), self.scores(normal.forest))
        parts = normal.service_shift_parts(window)
        fused = rank_fusion(parts.max(axis=1), gnn)
        structure = normal.structure_shift(window).reindex(fused.index).fillna(0.0)
        changed = structure_changed(structure, normal.structure_noise)
        # services whose structure changed come first, by how much; then a decisive time shift;
        # then the rest, by rank fusion
        first = structure[changed].sort_values(ascending=False, kind="stable") + 2.0 + fused.max()
        rest = fused[~changed]
        decisive = decisive_shift(parts[["caller", "callee"]].max(axis=1))
        if decisive in rest.index:
            rest = pd.concat([pd.Series({decisive: 1.0 + fused.max()}), rest.drop(decisive)])
        return _ranking_in_order(pd.concat([first, rest]))


def decisive_shift(shift: pd.Series, lead: float = DECISIVE_LEAD) -> str | None:
    """The service whose time shift (log2) exceeds every other service's by at least `lead`, if
    one does. `BmegRanker` gives it the shifts of the call gaps (the caller and callee parts of
    `NormalStats.service_shift_parts`), not of a service's own self time.

    A service whose calls' gaps grew 4x more than any other's is where the window's time went
    (a network delay): the rank fusion let the GNN's ranking overturn it (on the testbed the
    GNN often ranks the large orchestrators first) and lost network delays the time shift
    alone found. Gaps only: a service's own self time also holds the wait for a free worker,
    so a slow callee can lift its callers' (the testbed twin's simulated entry moved 12.6 log2
    under a network delay two calls below it). Chosen on the testbed and simulated faults
    (README, issue 12, session 6).
    """
    shift = shift.dropna()
    if len(shift) < 2:
        return None
    top = shift.nlargest(2)
    return str(top.index[0]) if top.iloc[0] - top.iloc[1] >= lead else None


def structure_changed(shift: pd.Series, noise: pd.Series, floor: float = STRUCTURE_FLOOR,
                      factor: float = NOISE_FACTOR) -> pd.Series:
    """bool per service of `shift`: its structure shift is above `floor + factor * noise`, its
    noise being how far it moves in the fault-free period (`NormalStats.structure_noise`; 0 for a
    service the period did not measure).

    A fixed bar (5% of spans changed) fired in nearly every real testbed window for a service
    whose calls follow its cache's state (post-storage-service: shift 0.1-0.7 with no fault on
    it, up to 0.23 in its normal period), putting it first whatever the fault: latency AC@1
    0.06. The floor covers a slow drift the short normal period cannot show
    (user-timeline-service: 0.01 in the normal period, 0.07-0.08 in every campaign window); on
    simulated code faults the smallest shift is 0.17, on the testbed's exceptions the median
    is 1.0. Measured (README): testbed latency AC@1 0.06 -> 0.18, exceptions 0.79 -> 0.74; on
    the dev set it hid the two code faults the fixed bar found (AC@1 0.29 -> 0.00).
    """
    return shift > floor + factor * noise.reindex(shift.index).fillna(0.0)


def _ranking_in_order(scores: pd.Series) -> Ranking:
    return [(str(service), float(score)) for service, score in scores.items()]


def window_ranking(detector, window: SpanForest, normal: SpanForest) -> list[ServiceScore]:
    """bmeg's ranking of the services over `window` against a fault-free period `normal` (both
    in the RPC view): what `bmeg evaluate rca` scores as `bmeg`, with the detector's feature
    baselines refitted on `normal` as there. What `bmeg diagnose --window --normal` reports:
    without a normal period the detector can only rank by its mean node score over the window,
    which follows where traces spend their time (dev set, latency AC@1 0.55 against the
    self-time rule's 0.95, README). Each service's score is the reciprocal of its rank; the
    first is the bottleneck."""
    ranking = BmegRanker(_DetectorScores(with_normal_baselines(detector, normal))).rank(
        window, NormalStats.from_forest(normal))
    return [ServiceScore(service=service, score=1.0 / rank, bottleneck=rank == 1)
            for rank, (service, _) in enumerate(ranking, start=1)]


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
