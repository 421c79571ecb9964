"""Root-cause rankers over a window of traces, all behind one interface.

`ranker.rank(window, normal)` takes the window's traces (an assembled forest in the RPC view,
see `bmeg.graphs.rpc.rpc_view`) and statistics of a normal period, and returns
`[(service, score), ...]`, most suspicious first.

- `bmeg`: the fusion of a learned window ranking (the window GCN's where the detector's run
  directory holds one, as `bmeg bootstrap` writes it, fused by standardised scores with the
  GNN's culprit votes as a third ranking; else the GNN's, fused by ranks) and how far each
  service's own time moved from the normal period, with
  code faults and decisive call gaps first: the window ranker every door of the product uses
  (`bmeg.models.window.combined_ranking`).
- `bmeg-without-votes`: `bmeg` without the GNN's culprit votes in its fusion (`bmeg` from issue
  12, session 21 to session 25), where the run holds a window GCN.
- `bmeg-rank-fusion`: `bmeg` with the window GCN's ranking fused by ranks (`rank_fusion`, `bmeg`
  from issue 12, session 20 to session 21), where the run holds a window GCN.
- `bmeg-gnn-fusion`: `bmeg` with the per-trace GNN's mean node score shift (`node_score_shift`,
  not `bmeg-gnn`'s culprit votes) in its rank fusion whatever the run holds (`bmeg` before issue
  12, session 20), where the run holds a window GCN.
- `bmeg-gnn`: the GNN alone: how often the GNN names each service the culprit of the window's
  traces it finds anomalous, against the normal period (`culprit_vote_shift`; session 24, before
  it each service's mean node score against the normal period's, `node_score_shift`).
- `bmeg-window-gcn`: a GCN over the window's service graph, trained on windows simulated from
  the twin (`bmeg.models.window_gcn`), where the detector's run directory holds one.
- `firm-svm`: FIRM's SVM scores on the critical path, averaged over the window.
- `ochiai-spectrum (internal)`: spectrum ranking (Ochiai) of services over anomalous vs normal
  traces; an internal approximation in MicroRank's family, *not* MicroRank (no PageRank
  weighting; see `bmeg.evaluation.rcaeval` for the published method).
- `jaccard-association (internal)`: services whose anomalous spans are over-represented in
  anomalous traces; an internal approximation in TraceRCA's family, *not* TraceRCA.
- `self-time`: the increase of each service's exclusive time against the normal period.

What a window is compared with (`NormalStats`, `Ranking`) is in `bmeg.models.normal`; every
ranker follows `Ranker`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import pandas as pd

from bmeg.graphs import SpanForest
from bmeg.models.normal import NormalStats, Ranking
from bmeg.models.window import (combined_ranking, culprit_vote_shift, gnn_window_scores, learned_scores, rank_fusion,
                                standardised_fusion, window_gcn_of, with_normal_baselines)
from bmeg.models.window_gcn import WindowModel


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
    """The detector's scores of one window, a window GCN's and the GNN's culprit votes, computed
    once for every detector-based ranker."""

    def __init__(self, detector):
        self.detector = detector
        # the two forests used last: a window and the normal period, which every window is
        # compared with (keeping only the last one re-scored the normal period twice per window)
        self._held: dict[int, tuple[SpanForest, object]] = {}
        self._kept: dict[str, tuple[tuple, pd.Series]] = {}

    def learned(self, window: SpanForest, normal: NormalStats, window_gcn: WindowModel | None) -> pd.Series:
        """The learned ranking bmeg fuses (`learned_scores`: `window_gcn`'s scores of `window`
        against `normal`, the GNN's shift where None): bmeg, its rank-fusion variant and the
        window GCN alone read the same."""
        return self._last("learned", (window, normal, window_gcn),
                          lambda: learned_scores(normal, window, self(window), self(normal.forest), window_gcn))

    def votes(self, window: SpanForest, normal: NormalStats) -> pd.Series:
        """The GNN's culprit votes of `window` against `normal` (`culprit_vote_shift`): the GNN
        alone ranks by them, bmeg fuses them."""
        return self._last("votes", (window, normal), lambda: culprit_vote_shift(self(window), self(normal.forest)))

    def _last(self, name: str, key: tuple, compute: Callable[[], pd.Series]) -> pd.Series:
        """`compute()`, kept for the last window: computed again only when `key`'s objects change."""
        kept = self._kept.get(name)
        if kept is None or any(a is not b for a, b in zip(kept[0], key)):
            self._kept[name] = kept = (key, compute())
        return kept[1]

    def __call__(self, window: SpanForest):
        held = self._held.pop(id(window), None)
        if held is None or held[0] is not window:
            # the window is a recorded slice of a stream: each trace reads the window's earlier traces
            held = (window, gnn_window_scores(self.detector, window))
        # the two used last stay, the latest at the end
        self._held = {**dict(list(self._held.items())[-1:]), id(window): held}
        return held[1]


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


class GnnRanker:
    """The GNN alone: the services it names the culprits of the window's traces, weighted by
    how anomalous it finds each, against the normal period (`culprit_vote_shift`); no rule, no
    stage-1 threshold."""

    name = "bmeg-gnn"

    def __init__(self, scores: _DetectorScores):
        self.scores = scores

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        return _ranking(self.scores.votes(window, normal))


class WindowGcnRanker:
    """The window GCN (`bmeg.models.window_gcn`): each service's logit from its shifts against
    the normal period, the GNN's score shift and its callers' and callees' in the window."""

    name = "bmeg-window-gcn"

    def __init__(self, scores: _DetectorScores, model: WindowModel):
        self.scores, self.model = scores, model

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        return _ranking(self.scores.learned(window, normal, self.model))  # as bmeg's fusion reads it


class BmegRanker:
    """B-MEG on a window: `bmeg.models.window.combined_ranking`, the ranker every door of the
    product uses, with the detector's scores shared with the other detector-based rankers and
    the run's window GCN (None: the GNN's ranking in the fusion, `bmeg-gnn-fusion`); `fusion` in
    place of bmeg's (`rank_fusion` with a window GCN: `bmeg-rank-fusion`)."""

    def __init__(self, scores: _DetectorScores, window_gcn: WindowModel | None, name: str = "bmeg",
                 fusion: Callable[..., pd.Series] | None = None):
        self.scores, self.window_gcn, self.name, self.fusion = scores, window_gcn, name, fusion

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        return combined_ranking(normal, window, self.scores(window), self.scores(normal.forest), self.window_gcn,
                                self.fusion, self.scores.learned(window, normal, self.window_gcn),
                                self.scores.votes(window, normal))


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
    window_gcn = window_gcn_of(detector)
    learned: list[Ranker] = [] if window_gcn is None else [
        BmegRanker(scores, window_gcn, "bmeg-without-votes", standardised_fusion),
        BmegRanker(scores, window_gcn, "bmeg-rank-fusion", rank_fusion),
        BmegRanker(scores, None, "bmeg-gnn-fusion"), WindowGcnRanker(scores, window_gcn)]
    return [BmegRanker(scores, window_gcn), GnnRanker(scores), *learned, FirmSvmRanker(detector), *baselines]
