"""bmeg's ranking of the services over a window of traces, against a fault-free period.

`WindowRanker(detector, normal)` holds what a window is compared with: the normal period's
statistics (`bmeg.models.normal.NormalStats`), the detector with its feature baselines refitted
on that period (`with_normal_baselines`) and the detector's scores of it, all computed once;
`ranker.ranking(window)` then ranks each window's services (`combined_ranking`). It is the
ranker `bmeg evaluate rca` measures as `bmeg` (`bmeg.evaluation.rankers.BmegRanker` calls the
same `combined_ranking`), and every door that ranks a window uses it when a normal period is
at hand: `bmeg.diagnose(window=True)` and `bmeg diagnose --window` (a `--normal` period, or the
normal traces a run of `bmeg bootstrap` keeps, `bmeg.paths.NORMAL_TRACES_FILE`), and the REST
server's `POST /diagnose?window=true` (the run's kept traces, read once when the model loads).

Without a normal period a window can only be ranked by the detector's mean node score
(`Detector.diagnose(window=True)` with no ranker): that follows where traces spend their time,
not what changed (dev set, latency AC@1 0.55 against 0.95 for this ranker, README). A
`Diagnosis` says which of the two ranked its window (`window_method`: `WINDOW_NORMAL_PERIOD`
or `WINDOW_MEAN_NODE_SCORE`).

A window's ranking is scored as a recorded stream (each trace reads the window's earlier
traces, `Detector.score(replay=True)`), never the server's stream history, so the same traces
get the same ranking at every door.

The stream's recent traffic. A fixed normal period can stop being the application's normal for
reasons that are no fault (on the testbed the entry service's own time doubled between the
calibration phase and the campaign, README), and a time-shift ranker then names what drifted. A
streaming caller (the REST server) keeps the traces it served (`RecentTraffic`) and compares a
window with the latest `RECENT_TRACES` of them begun before the window's first trace
(`latest_before`, `WindowRanker.against`): their statistics and the detector's scores of them
replace the fixed period's; the detector's feature baselines and the health bound stay the fixed
period's. Where fewer than `MIN_RECENT_TRACES` are at hand the fixed period is used. `bmeg
evaluate rca --recent-traces N` measures the same rule on recorded faults. A fault that lasts
longer than the recent traffic it is compared with becomes its own baseline: this compares a
window with what came just before it, so it answers "what changed at the window's start".
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.diagnosis import ServiceScore, WindowHealth
from bmeg.graphs import SpanForest
from bmeg.graphs.rpc import rpc_view
from bmeg.models.features import FeatureEncoder
from bmeg.models.normal import NormalStats, Ranking
from bmeg.models.window_gcn import WINDOW_GCN_FILE, WindowModel, load_window_gcn, rank_window, service_features
from bmeg.paths import NORMAL_TRACES_FILE
from bmeg.traces import TraceInputError
from bmeg.traces.io import read_spans
from bmeg.traces.schema import trace_starts

#: `bmeg.models.detector.Detector` and its `Scores`, by duck type: the detector module uses this
#: one, never the other way round.
Detector = Any
Scores = Any

#: `Diagnosis.window_method` of a window ranked by `WindowRanker` against a normal period.
WINDOW_NORMAL_PERIOD = "normal-period"
#: ... against the stream's traffic just before it (`WindowRanker.against`).
WINDOW_RECENT_TRAFFIC = "recent-traffic"
#: ... of a window ranked by the detector's mean node score (no normal period at hand).
WINDOW_MEAN_NODE_SCORE = "mean-node-score"

#: A service's structure shift counts as a change only above this floor ...
STRUCTURE_FLOOR = 0.1
#: ... plus this many times the service's own normal-period noise (`NormalStats.structure_noise`).
NOISE_FACTOR = 2.0
#: A service where errors began in a share of its spans above this floor (plus `NOISE_FACTOR`
#: times its own normal-period noise, `NormalStats.error_noise`) more than in the normal period ...
ERROR_FLOOR = 0.02
#: ... in at least this many spans, changed too, whatever its calls did (`errors_began`).
ERROR_MIN_SPANS = 5
#: A service whose structure is this unlikely under the normal period (`structure_significant`:
#: its p-value of `NormalStats.structure_tests`, times the tests made on the window) changed.
STRUCTURE_ALPHA = 1e-3
#: A service whose time shift (log2) exceeds every other service's by this much is decisive.
DECISIVE_LEAD = 2.0
#: The share of a normal period (its latest traces) held back to calibrate `HealthBound` ...
HELD_BACK = 0.5
#: ... whose bounds are this quantile of the shifts of windows drawn from it ...
HEALTH_QUANTILE = 0.99
#: ... at most this many windows (consecutive traces; overlapping when the held-back part is short) ...
CALIBRATION_WINDOWS = 40
#: ... each at most this share of the held-back part, so that they are not nearly all the same traces.
CALIBRATION_SPLITS = 4
#: A normal period whose held-back windows would hold fewer traces than this gives no answer:
#: means over a handful of traces vary so much that the bound would call faulty windows healthy
#: (16-trace windows: a bound of 4.7 log2, above a Hotel Reservation window with 30% of faults).
MIN_CALIBRATION_TRACES = 64
#: A window is compared with the latest this many traces before it (on the testbed at 100 traces/s,
#: 3 s: the gap between two of its fault rounds) ...
RECENT_TRACES = 300
#: ... begun at most this long before the window: older traffic is no baseline for what changed at
#: its start (the dev-set check found it: Nezha keeps traces only around its faults, so the latest
#: 300 before a fault were the previous fault's window, 8 minutes earlier, on the same service) ...
RECENT_MAX_AGE_S = 60.0
#: ... and with at least this many (fewer are too noisy: the fixed normal period is used).
MIN_RECENT_TRACES = 100
#: The spans a streaming caller keeps of its recent traffic (`RecentTraffic`), in bytes.
RECENT_BYTES = 32 * 1024 * 1024


class WindowRanker:
    """bmeg's window ranker against one fault-free period, ready for many windows."""

    def __init__(self, detector: Detector, normal: pa.Table | SpanForest):
        forest = rpc_view(normal)
        if forest.num_traces == 0:
            raise TraceInputError("the normal period holds no complete trace to compare a window with")
        self.stats = NormalStats.from_forest(forest)
        self.detector = with_normal_baselines(detector, forest)
        self.normal_scores = gnn_window_scores(self.detector, forest)
        self.health, self.health_stats = HealthBound.of(forest), self.stats
        self.method = WINDOW_NORMAL_PERIOD
        self.window_gcn = window_gcn_of(detector)  # the fusion's learned ranking where the run holds one

    @classmethod
    def of_run(cls, detector: Detector) -> WindowRanker | None:
        """The ranker against the normal traces the detector's run directory keeps (`bmeg
        bootstrap` writes them), or None when it keeps none (a run of `bmeg train`)."""
        kept = None if detector.run_dir is None else Path(detector.run_dir) / NORMAL_TRACES_FILE
        if kept is None or not kept.is_file():
            return None
        return cls(detector, read_spans(kept, format="parquet"))

    def against(self, recent: pa.Table) -> WindowRanker:
        """This ranker comparing windows with `recent` (the stream's traffic just before a window,
        `latest_before`) instead of the fixed period, where it holds at least `MIN_RECENT_TRACES`
        complete traces; else this ranker itself. The health bound stays the fixed period's, and
        so does the structure noise where larger (`NormalStats.with_noise_of`)."""
        forest = rpc_view(recent)
        if forest.num_traces < MIN_RECENT_TRACES:
            return self
        ranker = copy.copy(self)
        ranker.stats = NormalStats.from_forest(forest).with_noise_of(self.stats)
        ranker.normal_scores = gnn_window_scores(self.detector, forest)
        ranker.method = WINDOW_RECENT_TRAFFIC
        return ranker

    def scores_reusable(self, encoder: FeatureEncoder) -> bool:
        """Whether a detector with `encoder` scores a window as this ranker's detector does (its
        baselines are those of this normal period: a bootstrapped run and the traces it kept),
        so that its replayed scores of a window need not be computed again."""
        return encoder == self.detector.encoder

    def rank(self, window: SpanForest, window_scores: Scores | None = None) -> Ranking:
        """`combined_ranking` of a window in the RPC view; `window_scores`, when given, are this
        ranker's detector's replayed scores of it with the GNN's node score of every trace
        (`scores_reusable`)."""
        scores = window_scores if window_scores is not None else gnn_window_scores(self.detector, window)
        return combined_ranking(self.stats, window, scores, self.normal_scores, self.window_gcn)

    def ranking(self, window: pa.Table | SpanForest,
                window_scores: Scores | None = None) -> tuple[list[ServiceScore], WindowHealth | None]:
        """The window's services ranked, each scored by the reciprocal of its rank, and whether
        anything changed in it (`HealthBound`; None when the normal period is too short to
        calibrate it: then the first is the bottleneck, as before). The first is the bottleneck, unless the window is healthy: then none is."""
        view = rpc_view(window)
        ranked = self.rank(view, window_scores)
        health = None if self.health is None else self.health.check(self.health_stats, view)
        named = health is None or not health.healthy
        return [ServiceScore(service=service, score=1.0 / rank, bottleneck=named and rank == 1)
                for rank, (service, _) in enumerate(ranked, start=1)], health


def gnn_window_scores(detector: Detector, forest: SpanForest) -> Scores:
    """The detector's replayed scores of a window (or of its normal period) with the GNN run on
    every trace: a window's GNN rankings (`node_score_shift`, `culprit_vote_shift`) are the GNN's, whichever traces the
    router sends to the SVM (a bootstrap whose router took the SVM for the small graphs left the
    GNN's node scores NaN on 96% of a window's traces, and the ranking read the other 4%)."""
    return detector.score(forest, replay=True, all_models=True)


def latest_before(spans: pa.Table, start_ns: int, traces: int = RECENT_TRACES,
                  max_age_s: float = RECENT_MAX_AGE_S) -> pa.Table:
    """The spans of the latest `traces` traces of `spans` whose first span began before `start_ns`,
    at most `max_age_s` before it."""
    if spans.num_rows == 0:
        return spans
    first = trace_starts(spans)
    starts = first["start_ns_min"].to_numpy()
    before = np.flatnonzero((starts < start_ns) & (starts >= start_ns - int(max_age_s * 1e9)))
    latest = before[np.argsort(starts[before], kind="stable")[-traces:]] if traces > 0 else before[:0]
    return spans.filter(pc.is_in(spans["trace_id"], first["trace_id"].take(pa.array(latest, pa.int64()))))


class RecentTraffic:
    """The spans a streaming caller served lately, at most `max_bytes` of them (the oldest
    batches are let go first), to compare a window with (`before`)."""

    def __init__(self, max_bytes: int = RECENT_BYTES):
        self.max_bytes = max_bytes
        self._batches: deque[tuple[pa.Table, int]] = deque()
        self._bytes = 0

    def record(self, spans: pa.Table) -> None:
        size = spans.nbytes
        if spans.num_rows == 0 or size > self.max_bytes:
            return
        self._batches.append((spans, size))
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._bytes -= self._batches.popleft()[1]

    def before(self, window: pa.Table) -> pa.Table:
        """The latest traces begun before the window's first span (`latest_before`), the
        window's own traces left out (a trace served before may come again in a window)."""
        if not self._batches or window.num_rows == 0:
            return window.slice(0, 0)
        kept = pa.concat_tables([batch for batch, _ in self._batches], promote_options="permissive")
        kept = kept.filter(pc.invert(pc.is_in(kept["trace_id"], pc.unique(window["trace_id"]))))
        return latest_before(kept, int(pc.min(window["start_ns"]).as_py()))


class WindowDetector:
    """A detector whose window diagnoses are ranked against its run's normal traces when it keeps
    some (`WindowRanker.of_run`: a run of `bmeg bootstrap`), else by its mean node score: what
    the mitigation loops diagnose a window with. `window_method` says which."""

    def __init__(self, detector: Detector):
        self.detector, self.ranker = detector, WindowRanker.of_run(detector)
        self.version: str = detector.version
        self.window_method = WINDOW_MEAN_NODE_SCORE if self.ranker is None else WINDOW_NORMAL_PERIOD

    def diagnose(self, spans: pa.Table, window: bool = False) -> Any:
        return self.detector.diagnose(spans, window=window, ranker=self.ranker if window else None)


@dataclass(frozen=True)
class WindowShift:
    """How far a window moved from a normal period, in the quantities `combined_ranking` orders by."""

    time: float  # the largest time shift (log2) of a service's part (`NormalStats.service_shift_parts`)
    gap_lead: float  # how far (log2) the largest call-gap shift leads the second (`decisive_shift`'s test)
    structure: float  # the largest excess over a structure gate (> 0: one fires): the shift beyond
    # `structure_changed`'s or `errors_began`'s (shares), or how far below `STRUCTURE_ALPHA` the test of
    # counts' corrected p-value is (log10, `structure_significant`)
    service: str | None  # whose time shift is the largest


def window_shift(normal: NormalStats, window: SpanForest) -> WindowShift:
    """`WindowShift` of a window (RPC view) against `normal`; 0 for a quantity no service has."""
    parts = normal.service_shift_parts(window)
    time = parts.max(axis=1).dropna()
    gaps = parts[["caller", "callee"]].max(axis=1).dropna().nlargest(2)
    structure = normal.structure_parts(window)
    beyond = pd.concat([_beyond_gate(structure[["calls", "errors"]].sum(axis=1), normal.structure_noise),
                        _errors_beyond_gate(structure, normal.error_noise),
                        _counts_beyond_gate(normal.structure_tests(window))]).dropna()
    return WindowShift(time=float(time.max()) if len(time) else 0.0,
                       gap_lead=float(gaps.iloc[0] - gaps.iloc[1]) if len(gaps) == 2 else 0.0,
                       structure=float(beyond.max()) if len(beyond) else 0.0,
                       service=str(time.idxmax()) if len(time) else None)


def _beyond_gate(shift: pd.Series, noise: pd.Series, floor: float = STRUCTURE_FLOOR,
                 factor: float = NOISE_FACTOR) -> pd.Series:
    """How far each shift is above `floor + factor * noise` (the gate of `structure_changed`; 0
    noise for a service the normal period did not measure)."""
    return shift - (floor + factor * noise.reindex(shift.index).fillna(0.0))


def _errors_beyond_gate(parts: pd.DataFrame, noise: pd.Series, floor: float = ERROR_FLOOR,
                        min_spans: int = ERROR_MIN_SPANS, factor: float = NOISE_FACTOR) -> pd.Series:
    """How far each service's `errors` part is above its own gate (`errors_began`); NaN where
    errors began in fewer than `min_spans` spans."""
    return _beyond_gate(parts["errors"].where(parts["error_spans"] >= min_spans), noise, floor, factor)


def _counts_beyond_gate(tests: pd.DataFrame, alpha: float = STRUCTURE_ALPHA) -> pd.Series:
    """How far each service's corrected p-value is below `alpha` (`structure_significant`), in
    log10: > 0 where the test of counts fires."""
    corrected = tests["p"] * tests["tests"].sum()
    return np.log10(alpha) - np.log10(np.maximum(corrected, 1e-300))


class HealthBound:
    """"Nothing changed" for a window, calibrated on the application's own fault-free traces.

    The normal period is split by time (`HELD_BACK` of its traces, the latest, held back): the
    earlier part is summarised as the ranker summarises the whole (`NormalStats`), and windows
    of consecutive held-back traces are compared with it (`window_shift`). Each bound is the
    `HEALTH_QUANTILE` of those windows' shifts (the structure bound at least the ranker's own
    gate, 0); a window is healthy when none of its shifts (against the whole period) is above
    its bound. The held-back windows are as long as the window checked, in traces, rounded down
    to a power of two (shorter windows vary more: the bound errs towards "healthy"), and at most
    a `CALIBRATION_SPLITS`th of the held-back part: windows nearly as long as the part are nearly
    all the same traces, and their quantile is the spread of one window, not of many (a
    simulated Social Network window of 5,000 traces against 5,000 held back: 24 of 40 healthy
    windows called changed). Bounds are kept per length. By time, not at random: what moves a
    healthy application's times is often a drift (load, a cache), and a random split would
    hide it from the bound.
    """

    def __init__(self, earlier: NormalStats, later: SpanForest, quantile: float = HEALTH_QUANTILE,
                 windows: int = CALIBRATION_WINDOWS):
        self.earlier, self.quantile, self.windows = earlier, quantile, windows
        order = np.argsort(later.start_ns[later.root], kind="stable")
        self._later_ids = np.asarray(later.trace_ids, dtype=object)[order]
        self._later_spans = later.spans
        self._bounds: dict[int, tuple[WindowShift, int]] = {}

    @classmethod
    def of(cls, normal: SpanForest, held_back: float = HELD_BACK) -> HealthBound | None:
        """The bound of a normal period (RPC view), or None when it is too short to hold back
        `CALIBRATION_SPLITS` windows of `MIN_CALIBRATION_TRACES` traces."""
        if round(normal.num_traces * held_back) < CALIBRATION_SPLITS * MIN_CALIBRATION_TRACES:
            return None
        order = np.argsort(normal.start_ns[normal.root], kind="stable")
        count = min(max(round(normal.num_traces * held_back), 1), normal.num_traces - 1)
        ids = np.asarray(normal.trace_ids, dtype=object)[order]
        return cls(NormalStats.from_forest(_traces(normal.spans, ids[:-count])), _traces(normal.spans, ids[-count:]))

    def length(self, traces: int) -> int:
        """The held-back windows' length, in traces, for a window of `traces` traces."""
        return 2 ** int(np.log2(max(min(traces, len(self._later_ids) // CALIBRATION_SPLITS), 1)))

    def bound(self, length: int) -> tuple[WindowShift, int]:
        """(bounds, how many held-back windows they came from) for held-back windows of `length` traces."""
        if length not in self._bounds:
            starts = np.unique(np.linspace(0, len(self._later_ids) - length, self.windows).round().astype(int))
            shifts = [window_shift(self.earlier, _traces(self._later_spans, self._later_ids[start:start + length]))
                      for start in starts]
            quantile = partial(np.quantile, q=self.quantile)
            bounds = WindowShift(time=float(quantile([s.time for s in shifts])),
                                 gap_lead=float(quantile([s.gap_lead for s in shifts])),
                                 structure=max(float(quantile([s.structure for s in shifts])), 0.0), service=None)
            self._bounds[length] = (bounds, len(starts))
        return self._bounds[length]

    def check(self, normal: NormalStats, window: SpanForest) -> WindowHealth:
        """Whether `window` (RPC view) moved from `normal` (the whole period) beyond the bounds."""
        shift = window_shift(normal, window)
        length = self.length(window.num_traces)
        bounds, windows = self.bound(length)
        healthy = (shift.time <= bounds.time and shift.gap_lead <= bounds.gap_lead
                   and shift.structure <= bounds.structure)
        return WindowHealth(healthy=healthy, time_shift=shift.time, time_bound=bounds.time,
                            gap_lead=shift.gap_lead, gap_bound=bounds.gap_lead, structure_excess=shift.structure,
                            structure_bound=bounds.structure, service=shift.service,
                            calibration_traces=length, calibration_windows=windows)


def _traces(spans: pa.Table, trace_ids: np.ndarray) -> SpanForest:
    """The RPC view of the traces `trace_ids` of a span table."""
    return rpc_view(spans.filter(pc.is_in(spans["trace_id"], pa.array(list(trace_ids), pa.string()))))


def combined_ranking(normal: NormalStats, window: SpanForest, window_scores: Any, normal_scores: Any,
                     window_gcn: WindowModel | None = None, fusion: Callable[..., pd.Series] | None = None,
                     learned: pd.Series | None = None, votes: pd.Series | None = None) -> Ranking:
    """B-MEG on a window: a fusion of how far each service's own time moved from the normal
    period (`NormalStats.service_shift_parts`, call gaps split between caller and callee) and a
    learned window ranking: given `window_gcn`, the window GCN's (`window_gcn_scores`), fused by
    standardised scores (`standardised_fusion`, which reads how far each ranking puts a service
    ahead; issue 12, session 21) with the GNN's culprit votes as a third ranking, equal weights
    (`culprit_vote_shift`: on the testbed they put first some network delays and CPU faults the
    other two put second; session 26); else the GNN's own (`node_score_shift` of the detector's
    scores of the window and of the normal period), fused by ranks (`rank_fusion`). Neither is a product,
    so a low learned score cannot bury the service the time shift puts far ahead. Services
    whose structure moved beyond their own normal noise (`structure_changed`: a code fault) come
    before the others, by how far it moved, and so do services where errors began beyond their
    own noise (`errors_began`: an exception in a few percent of requests); on simulated latency
    faults no service's structure moves at all, so there the order is the fusion's; and so do
    services whose odd spans are too many for the normal period (`structure_significant`: an
    exception or an early return on a few percent of the requests, or on a rarely used
    operation, which moves the service's shares less than the floors). Before them all comes
    a decisive time shift of a call gap (`decisive_shift` of the caller and callee parts): a
    callee whose calls grew 4x slower than any other's makes its callers time out and pile up,
    which moves their structure (on the shop a quota cut on the cart set off
    `structure_significant` on the frontend that called it; issue 12, session 41). Which of the
    three stages placed each service, and what they read: `window_stages`. `fusion` replaces the fusion chosen so, votes and all (the harness
    compares `rank_fusion` with a window GCN so: `bmeg-rank-fusion`); `learned` and `votes`, the
    window GCN's scores and the GNN's culprit votes of this window where the caller holds them
    already (`learned_scores`, `culprit_vote_shift`)."""
    return window_stages(normal, window, window_scores, normal_scores, window_gcn, fusion, learned, votes).ranking


#: The stages of `combined_ranking`, in the order they place services (`WindowStages.stage`): the
#: decisive call gap, a structure gate, the rank fusion.
STAGE_STRUCTURE, STAGE_DECISIVE, STAGE_FUSION = "structure", "decisive", "fusion"
#: The structure gates, as `WindowStages.gates` names its columns.
GATES = ("structure_changed", "errors_began", "structure_significant")


@dataclass(frozen=True)
class WindowStages:
    """`combined_ranking` of a window, with what its stages read and which stage placed each service."""

    parts: pd.DataFrame  # `NormalStats.service_shift_parts` of the window: own / caller / callee / wait (log2)
    learned: pd.Series  # the learned ranking's scores (`node_score_shift`, or the window GCN's logits)
    votes: pd.Series | None  # the GNN's culprit votes fused as a third ranking (`culprit_vote_shift`), or none
    fused: pd.Series  # the fusion of the largest part, `learned` and `votes`, best first
    structure: pd.Series  # per service of `fused`: its structure shift (calls + errors parts; 0 where none)
    gates: pd.DataFrame  # bool per service of `fused`, a column per structure gate (`GATES`)
    decisive: str | None  # `decisive_shift` of the call gaps: first, whatever gate fired on it
    ranking: Ranking  # `combined_ranking`'s answer
    stage: pd.Series  # per service of `ranking`, in its order: `STAGE_STRUCTURE`, `STAGE_DECISIVE` or `STAGE_FUSION`


def window_stages(normal: NormalStats, window: SpanForest, window_scores: Any, normal_scores: Any,
                  window_gcn: WindowModel | None = None, fusion: Callable[..., pd.Series] | None = None,
                  learned: pd.Series | None = None, votes: pd.Series | None = None) -> WindowStages:
    """`combined_ranking` of a window (its arguments), as `WindowStages`."""
    if learned is None:
        learned = learned_scores(normal, window, window_scores, normal_scores, window_gcn)
    if fusion is None and window_gcn is not None:
        fusion = standardised_fusion
        votes = culprit_vote_shift(window_scores, normal_scores) if votes is None else votes
    else:
        votes = None  # a fusion given in place of bmeg's fuses two rankings, as does bmeg's without a window GCN
    return ranked_stages(normal.service_shift_parts(window), learned, normal.structure_parts(window),
                         normal.structure_tests(window), normal.structure_noise, normal.error_noise, fusion, votes)


def learned_scores(normal: NormalStats, window: SpanForest, window_scores: Any, normal_scores: Any,
                   window_gcn: WindowModel | None = None) -> pd.Series:
    """The learned ranking `combined_ranking` fuses: the window GCN's logits given `window_gcn`,
    else the GNN's `node_score_shift`."""
    gnn = node_score_shift(window_scores, normal_scores)
    return gnn if window_gcn is None else window_gcn_scores(window_gcn, normal, window, gnn)


def ranked_stages(parts: pd.DataFrame, learned: pd.Series, shape: pd.DataFrame, tests: pd.DataFrame,
                  structure_noise: pd.Series, error_noise: pd.Series,
                  fusion: Callable[..., pd.Series] | None = None, votes: pd.Series | None = None) -> WindowStages:
    """`combined_ranking`'s stages from what it reads of a window: the time shift's `parts`
    (`NormalStats.service_shift_parts`), the `learned` scores, the structure's `shape`
    (`NormalStats.structure_parts`) and `tests` (`NormalStats.structure_tests`), and the normal
    period's noise of both (`NormalStats.structure_noise`, `NormalStats.error_noise`); `fusion`
    orders what no gate placed (`standardised_fusion` or, by default, `rank_fusion`) from the
    largest part, `learned` and, given them, the GNN's culprit `votes`."""
    fused = (fusion or rank_fusion)(parts.max(axis=1), learned, *([] if votes is None else [votes]))
    shape = shape.reindex(fused.index)
    structure = shape[["calls", "errors"]].sum(axis=1).fillna(0.0)
    gates = pd.DataFrame(dict(zip(GATES, (structure_changed(structure, structure_noise),
                                          errors_began(shape, error_noise),
                                          structure_significant(tests).reindex(fused.index, fill_value=False)))))
    changed = gates.any(axis=1)
    decisive = decisive_shift(parts[["caller", "callee"]].max(axis=1))
    order = staged_order(fused, structure[changed], decisive)
    stage = pd.Series(STAGE_FUSION, index=order.index, dtype=object)
    stage[changed[changed].index] = STAGE_STRUCTURE
    if decisive in order.index:
        stage[decisive] = STAGE_DECISIVE
    return WindowStages(parts=parts, learned=learned, votes=votes, fused=fused, structure=structure,
                        gates=gates.astype(bool), decisive=decisive,
                        ranking=[(str(service), float(score)) for service, score in order.items()], stage=stage)


def staged_order(fused: pd.Series, gated: pd.Series, decisive: str | None) -> pd.Series:
    """`ranked_stages`' order, best first, with its scores: the `decisive` call gap's service
    first; then the `gated` services (their structure shift, in `fused`'s order), by how far
    their structure moved; then the rest in the fusion's order."""
    first = gated[gated.index != decisive].sort_values(ascending=False, kind="stable") + 2.0 + fused.max()
    if decisive in fused.index:
        first = pd.concat([pd.Series({decisive: max([float(fused.max()), *first]) + 1.0}), first])
    return pd.concat([first, fused.drop(first.index)])


def window_gcn_scores(model: WindowModel, normal: NormalStats, window: SpanForest, gnn_shift: pd.Series) -> pd.Series:
    """The window GCN's logit of each service of the window (`bmeg.models.window_gcn`), given
    the per-trace GNN's `node_score_shift` of it."""
    ranked = rank_window(model, service_features(normal, window, gnn_shift))
    return pd.Series(dict(ranked), dtype=float)


def window_gcn_of(detector: Detector) -> WindowModel | None:
    """The window GCN the detector's run directory holds (`WINDOW_GCN_FILE`), or None."""
    path = None if detector.run_dir is None else Path(detector.run_dir) / WINDOW_GCN_FILE
    return load_window_gcn(path) if path is not None and path.is_file() else None


def node_score_shift(window_scores: Any, normal_scores: Any) -> pd.Series:
    """Per service: its nodes' mean GNN score in the window minus the same in the normal period.

    A mean over the service's visits (nodes), not a sum or a per-trace maximum, so a service is
    not ranked up for being visited often or having many nodes per trace; minus its own
    normal-period mean, so a service the model always scores high (a large orchestrator whose
    spans are long whatever happens) is ranked by what changed, not by where time goes.
    A service the normal period never saw is compared with 0.
    """
    def mean_by_service(scores: Any) -> pd.Series:
        return pd.Series(scores.gnn_node).groupby(scores.node_services).mean()

    window = mean_by_service(window_scores)
    return window - mean_by_service(normal_scores).reindex(window.index).fillna(0.0).to_numpy()


def culprit_votes(scores: Any, weighted: bool = True, owners: Mapping[str, str] | None = None) -> pd.Series:
    """Per service: the share of the traces visiting it whose culprit it is (the service of the
    GNN's highest node score in the trace), each trace's vote weighted by the GNN's P(anomalous)
    where `weighted`. With `owners` (store -> its one caller, `store_callers`) a trace whose
    culprit is a store votes for the store's caller, and stores get no row."""
    service = np.where(scores.present, np.nan_to_num(scores.gnn_service, nan=-1.0), -np.inf)
    column = {name: i for i, name in enumerate(scores.services)}
    voter = np.array([column.get((owners or {}).get(name, name), i) for i, name in enumerate(scores.services)], dtype=int)
    culprit = np.zeros(scores.present.shape)
    culprit[np.arange(len(service)), voter[service.argmax(axis=1)]] = 1.0
    weight = np.nan_to_num(scores.gnn_anomaly, nan=0.0)[:, None] if weighted else 1.0
    visits = scores.present.sum(axis=0)
    votes = (culprit * scores.present * weight).sum(axis=0) / np.maximum(visits, 1)
    return pd.Series(votes, index=scores.services)[(visits > 0) & (voter == np.arange(len(voter)))]


def culprit_vote_shift(window_scores: Any, normal_scores: Any, weighted: bool = True,
                       owners: Mapping[str, str] | None = None) -> pd.Series:
    """The GNN's own window ranking (`bmeg-gnn`): per service, its `culprit_votes` in the window
    minus in the normal period (0 where the normal period never saw it).

    Each trace names one culprit, so a service gains nothing from being visited often or from
    many nodes per trace; a share of the traces visiting it, so not from being on every path;
    weighted by how anomalous the GNN finds the trace, so the healthy traces of a window barely
    vote; minus the normal period's, so a service the GNN blames whatever happens (a large
    orchestrator) is ranked by what changed. Chosen over `node_score_shift` on the testbed and
    the twin (issue 12, session 24: the GNN alone's latency AC@1 +0.07 to +0.08 on each).
    """
    window = culprit_votes(window_scores, weighted, owners)
    return window - culprit_votes(normal_scores, weighted, owners).reindex(window.index).fillna(0.0).to_numpy()


def with_normal_baselines(detector: Detector, normal: SpanForest) -> Detector:
    """The detector with its feature baselines refitted on the normal period of the traces at hand.

    A model trained on a twin learned what *deviation from normal* looks like; refitting the
    per-operation baselines (medians and spreads, no labels) makes those deviations mean the
    same on the real system as on the twin.
    """
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


def standardised_fusion(*scores: pd.Series) -> pd.Series:
    """Score fusion: the sum over the rankings of each service's score standardised within the
    window (minus the window's mean, over its spread), best first.

    Unlike `rank_fusion` it reads margins: a service that one ranking puts far ahead of the rest
    keeps that lead against a second ranking that has it a few places down (the case `rank_fusion`
    loses: a time shift of 1.15 log2 against the next service's 0.09, ranked 4th by a window GCN).
    Equal weights, as `WindowGCNEnsemble` averages its members. A service missing from a ranking
    counts as that ranking's lowest score. Exact ties keep the first ranking's order."""
    index = scores[0].index
    for series in scores[1:]:
        index = index.union(series.index, sort=False)
    total = pd.Series(0.0, index=index)
    for series in scores:
        values = series.reindex(index)
        values = values.fillna(values.min() if values.notna().any() else 0.0)
        spread = float(values.std(ddof=0))
        total += (values - values.mean()) / spread if spread > 0 else 0.0
    first = scores[0].rank(ascending=False, method="first").reindex(index).fillna(len(index) + 1)
    return total.iloc[np.lexsort((first.to_numpy(), -total.to_numpy()))]


def decisive_shift(shift: pd.Series, lead: float = DECISIVE_LEAD) -> str | None:
    """The service whose time shift (log2) exceeds every other service's by at least `lead`, if
    one does. `combined_ranking` gives it the shifts of the call gaps (the caller and callee
    parts of `NormalStats.service_shift_parts`), not of a service's own self time.

    A service whose calls' gaps grew 4x more than any other's is where the window's time went
    (a network delay): the rank fusion let the GNN's ranking overturn it (on the testbed the
    GNN often ranks the large orchestrators first) and lost network delays the time shift
    alone found. Gaps only: a service's own self time also holds the wait for a free worker,
    so a slow callee can lift its callers' (the testbed twin's simulated entry moved 12.6 log2
    under a network delay two calls below it). Chosen on the testbed and simulated faults
    (docs/issue-12.md, session 6).
    """
    shift = shift.dropna()
    if len(shift) < 2:
        return None
    top = shift.nlargest(2)
    return str(top.index[0]) if top.iloc[0] - top.iloc[1] >= lead else None


def errors_began(parts: pd.DataFrame, noise: pd.Series, floor: float = ERROR_FLOOR,
                 min_spans: int = ERROR_MIN_SPANS, factor: float = NOISE_FACTOR) -> pd.Series:
    """bool per service of `parts` (`NormalStats.structure_parts`): errors began in more of its
    spans than in the normal period, by a share above `floor + factor * noise` and in at least
    `min_spans` spans.

    The `errors` part of the structure shift on its own gate: `structure_changed`'s floor (0.1)
    is set for call counts, which drift with a cache's state; where an error begins does not
    drift so (the testbed's normal noise of it is 0 in every service), and an exception that
    fails a few percent of a service's requests moves it less than 0.1 (docs/issue-12.md,
    session 12). `min_spans`: a rarely visited service with one failed request is no change.
    """
    return _errors_beyond_gate(parts, noise, floor, min_spans, factor) > 0


def structure_significant(tests: pd.DataFrame, alpha: float = STRUCTURE_ALPHA) -> pd.Series:
    """bool per service of `tests` (`NormalStats.structure_tests` of a window): its p-value,
    times the number of tests made on the window (Bonferroni: one per span key of every
    service), is below `alpha`.

    Counts, not shares: `structure_changed`'s floor asks a tenth of a service's spans to change,
    which a code fault on a rarely used operation, or on a few percent of the requests, never
    does; a test of the counts fires on a few odd spans where the normal period makes them
    unlikely, and needs many where it does not (a key whose fewest children are common, one
    that fails now and then, a short period). Chosen on the testbed's partial code faults and
    its single-fault dataset (docs/issue-12.md, session 16)."""
    return _counts_beyond_gate(tests, alpha) > 0


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
    return _beyond_gate(shift, noise, floor, factor) > 0
