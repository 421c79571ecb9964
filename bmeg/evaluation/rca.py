"""The root-cause harness: for each injected fault, rank services over the traces of the
minutes after it, and score the rankings (AC@1, AC@3, AC@5, Avg@5) per fault type, overall,
and over the latency-type faults.

Every ranker sees the same windows, in the RPC view (`bmeg.faultinject.twin.rpc_view`), and
the same normal-period statistics. A fault whose window holds no traces is reported as skipped
and not scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from bmeg.evaluation.faults import InjectedFault
from bmeg.evaluation.rankers import NormalStats, Ranker
from bmeg.evaluation.windows import TraceFiles
from bmeg.faultinject.twin import rpc_view
from bmeg.graphs import SpanForest
from bmeg.training.metrics import accuracy_at_k, average_at_k

DEFAULT_WINDOW_MINUTES = 2.0


@dataclass
class FaultResult:
    fault: InjectedFault
    traces: int
    rankings: dict[str, list[str]] = field(default_factory=dict)  # ranker -> services, best first

    def to_dict(self, top: int = 5) -> dict:
        return {
            "service": self.fault.service, "type": self.fault.kind, "start_ns": self.fault.start_ns,
            "pod": self.fault.pod, "traces": self.traces,
            "rank": {name: _position(ranking, self.fault.service) for name, ranking in self.rankings.items()},
            "top": {name: ranking[:top] for name, ranking in self.rankings.items()},
        }


def _position(ranking: list[str], service: str) -> int | None:
    """1-based rank of the true service, None when not ranked at all."""
    return ranking.index(service) + 1 if service in ranking else None


def scores(results: Sequence[FaultResult], ranker: str) -> dict:
    """n, ac1, ac3, ac5, avg5 of one ranker over some faults."""
    rankings = [r.rankings[ranker] for r in results]
    truths = [{r.fault.service} for r in results]
    if not results:
        return {"n": 0, "ac1": None, "ac3": None, "ac5": None, "avg5": None}
    return {"n": len(results), **{f"ac{k}": accuracy_at_k(rankings, truths, k) for k in (1, 3, 5)},
            "avg5": average_at_k(rankings, truths, 5)}


def run_rca(files: TraceFiles, faults: Sequence[InjectedFault], normal: SpanForest, rankers: Sequence[Ranker],
            window_minutes: float = DEFAULT_WINDOW_MINUTES, progress: bool = False) -> list[FaultResult]:
    """Rank services for each fault with every ranker; faults with an empty window get no rankings."""
    stats = NormalStats.from_forest(rpc_view(normal))
    length_ns = int(window_minutes * 60e9)
    results = []
    for fault in tqdm(faults, desc="faults", unit="fault", disable=not progress):
        spans = files.window(fault.start_ns, fault.start_ns + length_ns)
        window = rpc_view(spans)
        result = FaultResult(fault, window.num_traces)
        if window.num_traces:
            result.rankings = {ranker.name: [s for s, _ in ranker.rank(window, stats)] for ranker in rankers}
        results.append(result)
    return results


def report(results: Sequence[FaultResult], rankers: Sequence[str]) -> dict:
    """`{"overall", "latency_faults", "by_type", "faults", "skipped"}`, groups keyed by ranker."""
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
                     "reason": "no traces in the window"} for r in results if not r.rankings],
    }
