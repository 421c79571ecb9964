"""The root-cause harness: for each injected fault, rank services over the traces of the
minutes after it, and score the rankings (AC@1, AC@3, AC@5, Avg@5) per fault type, overall,
and over the latency-type faults.

Where faults run together (the testbed's campaigns start 2-3 at once), one ranking can put only
one of them first, so AC@1 of each against the shared ranking is at most 1/2 or 1/3 however good
the ranking. `ac1_others_removed` also scores each fault with the services of the other faults
whose windows overlap its own taken out of the ranking: a ranking that puts the window's faulty
services first, in any order, scores 1.

Every ranker sees the same windows, in the RPC view (`bmeg.graphs.rpc.rpc_view`), and
the same normal-period statistics. A fault whose window holds no traces is reported as skipped
and not scored, with the time range the trace files do cover.

Published fault lists often give local times where the traces are in UTC (or the other way
round). `hour_offset` looks for the whole-hour shift of the fault list (-14 h to +14 h) that puts
the most faults' windows over the trace files; where it puts more there than no shift does, the
report says so (and `run_rca(..., offset_hours=...)` applies a shift the user confirms).

The normal period is one fixed set of fault-free traces, or, with `recent_minutes`, the traces
of the minutes just before each fault, or, with `recent_traces`, the latest that many traces
before it (`bmeg.models.window.latest_before`: the rule the REST server's window ranking follows) (RCAEval's cases are laid out so: normal data, then the
injection), the same for every ranker. A fixed period can differ from the hours of the faults
for reasons that are no fault: on the testbed the entry service's own time was twice its
calibration phase's in the campaign's healthy traces too (docs/testbed.md, session 9), and a
time-shift ranker then puts it first. A fault whose recent traces are fewer than
`MIN_RECENT_TRACES` is compared with the fixed period.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from tqdm import tqdm

from bmeg.evaluation.faults import InjectedFault
from bmeg.evaluation.rankers import Ranker
from bmeg.models.normal import NormalStats
from bmeg.evaluation.windows import TraceFiles
from bmeg.graphs import SpanForest
from bmeg.graphs.rpc import rpc_view
from bmeg.models.window import MIN_RECENT_TRACES, RECENT_MAX_AGE_S, latest_before
from bmeg.training.metrics import accuracy_at_k, average_at_k

DEFAULT_WINDOW_MINUTES = 2.0
HOUR_NS = 3600 * 10**9
#: Time-zone offsets tried by `hour_offset` (UTC-12 to UTC+14, either way round).
MAX_OFFSET_HOURS = 14


@dataclass
class FaultResult:
    fault: InjectedFault
    traces: int
    rankings: dict[str, list[str]] = field(default_factory=dict)  # ranker -> services, best first
    others: frozenset[str] = frozenset()  # services of the other faults whose windows overlap this one's

    def without_others(self, ranker: str) -> list[str]:
        return [s for s in self.rankings[ranker] if s not in self.others]

    def to_dict(self, top: int = 5) -> dict:
        return {
            "service": self.fault.service, "type": self.fault.kind, "start_ns": self.fault.start_ns,
            "pod": self.fault.pod, "traces": self.traces,
            "rank": {name: _position(ranking, self.fault.service) for name, ranking in self.rankings.items()},
            "rank_others_removed": {name: _position(self.without_others(name), self.fault.service)
                                    for name in self.rankings},
            "others": sorted(self.others),
            "top": {name: ranking[:top] for name, ranking in self.rankings.items()},
        }


def _position(ranking: list[str], service: str) -> int | None:
    """1-based rank of the true service, None when not ranked at all."""
    return ranking.index(service) + 1 if service in ranking else None


def scores(results: Sequence[FaultResult], ranker: str) -> dict:
    """n, ac1, ac3, ac5, avg5 and ac1_others_removed of one ranker over some faults."""
    rankings = [r.rankings[ranker] for r in results]
    truths = [{r.fault.service} for r in results]
    if not results:
        return {"n": 0, "ac1": None, "ac3": None, "ac5": None, "avg5": None, "ac1_others_removed": None}
    return {"n": len(results), **{f"ac{k}": accuracy_at_k(rankings, truths, k) for k in (1, 3, 5)},
            "avg5": average_at_k(rankings, truths, 5),
            "ac1_others_removed": accuracy_at_k([r.without_others(ranker) for r in results], truths, 1)}


def utc(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def hour_offset(files: TraceFiles, faults: Sequence[InjectedFault],
                window_minutes: float = DEFAULT_WINDOW_MINUTES) -> dict:
    """The whole-hour shift of the fault list that puts the most windows over the trace files.

    Returns `{"hours", "windows_over_traces", "unshifted_windows_over_traces"}`; `hours` is 0
    when no shift does better than none (ties go to the smallest shift).
    """
    length_ns = int(window_minutes * 60e9)

    def covered(hours: int) -> int:
        return sum(files.overlaps(f.start_ns + hours * HOUR_NS, f.start_ns + hours * HOUR_NS + length_ns)
                   for f in faults)

    counts = {hours: covered(hours) for hours in range(-MAX_OFFSET_HOURS, MAX_OFFSET_HOURS + 1)}
    best = max(counts, key=lambda hours: (counts[hours], -abs(hours)))
    return {"hours": best if counts[best] > counts[0] else 0, "windows_over_traces": counts[best],
            "unshifted_windows_over_traces": counts[0]}


def run_rca(files: TraceFiles, faults: Sequence[InjectedFault], normal: SpanForest, rankers: Sequence[Ranker],
            window_minutes: float = DEFAULT_WINDOW_MINUTES, progress: bool = False,
            offset_hours: int = 0, recent_minutes: float | None = None,
            recent_traces: int | None = None) -> list[FaultResult]:
    """Rank services for each fault with every ranker; faults with an empty window get no rankings.
    `offset_hours` shifts every fault's time (a fault list written in another time zone);
    `recent_minutes` compares each window with the traces of that many minutes before its fault,
    `recent_traces` with the latest that many before it (the fixed `normal` period where they are
    fewer than `MIN_RECENT_TRACES`)."""
    fixed = NormalStats.from_forest(rpc_view(normal))
    length_ns = int(window_minutes * 60e9)
    results = []
    for fault in tqdm(faults, desc="faults", unit="fault", disable=not progress):
        fault = replace(fault, start_ns=fault.start_ns + offset_hours * HOUR_NS)
        window = rpc_view(files.window(fault.start_ns, fault.start_ns + length_ns))
        result = FaultResult(fault, window.num_traces)
        if window.num_traces:
            stats = recent_normal(files, fault.start_ns, fixed, recent_minutes, recent_traces)
            result.rankings = {ranker.name: [s for s, _ in ranker.rank(window, stats)] for ranker in rankers}
        results.append(result)
    return [replace(r, others=_overlapping_services(r.fault, results, length_ns)) for r in results]


def _overlapping_services(fault: InjectedFault, results: Sequence[FaultResult], length_ns: int) -> frozenset[str]:
    """The services of the other faults whose windows overlap `fault`'s."""
    return frozenset(r.fault.service for r in results
                     if abs(r.fault.start_ns - fault.start_ns) < length_ns and r.fault.service != fault.service)


def recent_normal(files: TraceFiles, start_ns: int, fixed: NormalStats, minutes: float | None,
                   traces: int | None) -> NormalStats:
    """The normal period of the `minutes` before `start_ns`, or of the latest `traces` before it,
    with `fixed`'s structure noise where larger (`NormalStats.with_noise_of`, as the REST server's
    `WindowRanker.against`), or `fixed` where neither is asked for or it is too thin."""
    if traces is not None:
        spans = latest_before(files.window(start_ns - int(RECENT_MAX_AGE_S * 1e9), start_ns), start_ns, traces)
    elif minutes is not None:
        spans = files.window(start_ns - int(minutes * 60e9), start_ns)
    else:
        return fixed
    recent = rpc_view(spans)
    if recent.num_traces < MIN_RECENT_TRACES:
        return fixed
    return NormalStats.from_forest(recent).with_noise_of(fixed)


def report(results: Sequence[FaultResult], rankers: Sequence[str], files: TraceFiles | None = None,
           window_minutes: float = DEFAULT_WINDOW_MINUTES) -> dict:
    """`{"overall", "latency_faults", "by_type", "faults", "skipped"}`, groups keyed by ranker.
    With `files`, a skipped fault's reason names the time range the traces cover."""
    scored = [r for r in results if r.rankings]
    latency = [r for r in scored if r.fault.is_latency]
    kinds = sorted({r.fault.kind for r in scored})

    def groups(subset):
        return {name: scores(subset, name) for name in rankers}

    return {
        "overall": groups(scored),
        "latency_faults": groups(latency),
        "by_type": {kind: groups([r for r in scored if r.fault.kind == kind]) for kind in kinds},
        "faults": [r.to_dict() for r in scored],
        "skipped": [{"service": r.fault.service, "type": r.fault.kind, "start_ns": r.fault.start_ns,
                     "reason": _empty_reason(r.fault, files, window_minutes)} for r in results if not r.rankings],
    }


def _empty_reason(fault: InjectedFault, files: TraceFiles | None, window_minutes: float) -> str:
    end_ns = fault.start_ns + int(window_minutes * 60e9)
    reason = f"no traces in the window {utc(fault.start_ns)} to {utc(end_ns)}"
    coverage = files.coverage() if files is not None else None
    if files is None or coverage is None:
        return reason
    if files.overlaps(fault.start_ns, end_ns):
        return reason + " (a trace file overlaps it, but no trace's root starts in it)"
    reason += f"; the trace files cover {utc(coverage[0])} to {utc(coverage[1])}"
    before = [f.last_ns for f in files.files if f.last_ns < fault.start_ns]
    after = [f.first_ns for f in files.files if f.first_ns >= end_ns]
    if before and after:
        reason += f", with no file between {utc(max(before))} and {utc(min(after))}"
    return reason
