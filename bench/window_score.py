"""The GNN's window score, seven ways, in one run of the root-cause harness:

    python bench/window_score.py --model RUN --traces D/spans.parquet --faults D/fault_list.json \
        --normal D/normal.parquet [--window-minutes 0.1]          # the testbed dataset D
    python bench/window_score.py --model RUN --simulated RUN/twin.yaml [--window-seconds 10] [--stores] [--scheduler]

Each variant replaces `bmeg.models.window.node_score_shift` (the GNN's per-service window score
against the normal period) and is scored twice on the same windows: alone (as `bmeg-gnn`) and
inside bmeg's combined ranker as it fused the GNN before the window GCN (`combined_ranking`
with no window GCN: `bmeg-VARIANT`). Variants, per service over its nodes (visits):
- `diff` (`node_score_shift`: `bmeg-gnn` until session 24, and still the window GCN's input):
  the window's mean node score minus the normal period's mean;
- `z`: that difference over the standard deviation of the service's node scores in the normal
  period (a service whose score varies a lot with no fault must move more);
- `logit`: the difference of the two means on the log-odds scale (a service the model always
  scores near 1, a large orchestrator, cannot gain much on the plain scale, nor lose it);
- `quantile`: each window node's score as its quantile among the service's normal node scores,
  averaged, minus 0.5 (a service's level and spread both taken out);
- `vote-weighted` (`culprit_vote_shift`, `bmeg-gnn` since session 24): the share of the
  window's traces visiting the service whose highest-scored service it is (the GNN's per-trace
  culprit), minus that share in the normal period, each trace's vote weighted by the DGCNN's
  P(anomalous); `vote`: unweighted; `vote-soft`: each trace's P(anomalous) split over its
  services in proportion to their scores instead of one culprit (session 24, not adopted);
  `vote-owner`: `vote-weighted` with each store folded into its one caller (`store_callers`: a
  trace whose culprit is a store votes for the service whose client spans stand for it), and
  `vote-owner-T` only where that caller's own time moved by more than T (log2) in the window
  (session 25, neither adopted: folding cannot name a store, and the twin's simulated store
  faults are found by `vote-weighted`; `--stores` simulates those).
All are means over visits (or over the traces visiting), so none rewards a service for being
visited often. The self-time rule is printed beside them, and bmeg as every door ranks (`bmeg`:
the time shift, its window GCN and the GNN's `vote-weighted` shift in the standardised fusion,
session 26) and `bmeg-without-votes` (sessions 21-25's: the first two; session 26 measured it as
`bmeg` against `bmeg-with-votes`). Prints AC@1 / Avg@5 per fault group.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import bmeg.models.window as window_module
from bmeg.evaluation.faults import read_fault_list
from bmeg.evaluation.rankers import BmegRanker, SelfTimeRanker, _DetectorScores, _ranking
from bmeg.evaluation.rca import report, run_rca
from bmeg.evaluation.windows import TraceFiles
from bmeg.graphs import SpanForest, store_callers
from bmeg.graphs.rpc import rpc_view
from bmeg.models.detector import Detector
from bmeg.models.normal import NormalStats, Ranking
from bmeg.models.window import (
    combined_ranking,
    culprit_vote_shift,
    node_score_shift,
    standardised_fusion,
    window_gcn_of,
    with_normal_baselines,
)
from bmeg.traces.io import read_spans

LOGIT_CLIP = 1e-4
MIN_SPREAD = 0.01


def _nodes(scores: Any) -> pd.DataFrame:
    frame = pd.DataFrame({"service": scores.node_services, "score": scores.gnn_node})
    return frame.dropna()


def z_shift(window_scores: Any, normal_scores: Any) -> pd.Series:
    normal = _nodes(normal_scores).groupby("service")["score"]
    spread = normal.std().clip(lower=MIN_SPREAD)
    diff = node_score_shift(window_scores, normal_scores)
    return diff / spread.reindex(diff.index).fillna(MIN_SPREAD).to_numpy()


def logit_shift(window_scores: Any, normal_scores: Any) -> pd.Series:
    def logit(p: pd.Series) -> pd.Series:
        p = p.clip(LOGIT_CLIP, 1 - LOGIT_CLIP)
        return np.log(p / (1 - p))

    window = _nodes(window_scores).groupby("service")["score"].mean()
    normal = _nodes(normal_scores).groupby("service")["score"].mean().reindex(window.index).fillna(LOGIT_CLIP)
    return logit(window) - logit(normal).to_numpy()


def quantile_shift(window_scores: Any, normal_scores: Any) -> pd.Series:
    normal = {service: np.sort(group.to_numpy()) for service, group in _nodes(normal_scores).groupby("service")["score"]}
    nodes = _nodes(window_scores)
    out = {}
    for service, group in nodes.groupby("service")["score"]:
        reference = normal.get(service)
        if reference is None or len(reference) == 0:
            out[service] = 0.5
            continue
        below = np.searchsorted(reference, group.to_numpy(), side="left")
        at_or_below = np.searchsorted(reference, group.to_numpy(), side="right")
        out[service] = float(((below + at_or_below) / 2 / len(reference)).mean()) - 0.5
    return pd.Series(out, dtype=float)


def soft_votes(scores: Any) -> pd.Series:
    """Per service: each trace's P(anomalous) split over its services in proportion to the GNN's
    per-service scores, summed over the traces visiting the service, over those traces."""
    service = np.where(scores.present, np.nan_to_num(scores.gnn_service, nan=0.0), 0.0)
    share = service / np.maximum(service.sum(axis=1, keepdims=True), 1e-12)
    weight = np.nan_to_num(scores.gnn_anomaly, nan=0.0)[:, None]
    visits = scores.present.sum(axis=0)
    return pd.Series((share * weight).sum(axis=0) / np.maximum(visits, 1), index=scores.services)[visits > 0]


def soft_vote_shift(window_scores: Any, normal_scores: Any) -> pd.Series:
    window = soft_votes(window_scores)
    return window - soft_votes(normal_scores).reindex(window.index).fillna(0.0).to_numpy()


VARIANTS: dict[str, Callable[[Any, Any], pd.Series]] = {
    "diff": node_score_shift, "z": z_shift, "logit": logit_shift, "quantile": quantile_shift,
    "vote": partial(culprit_vote_shift, weighted=False), "vote-weighted": culprit_vote_shift, "vote-soft": soft_vote_shift,
    "vote-owner": culprit_vote_shift,  # with each store folded into its one caller (`GnnVariant.rank`)
    "vote-owner-0.1": culprit_vote_shift, "vote-owner-0.25": culprit_vote_shift, "vote-owner-0.5": culprit_vote_shift,
}
#: the variants whose stores fold into their callers: always, or where the caller's own time
#: (its server spans' self time, log2) moved by more than the suffix
FOLDING = {"vote-owner": None, "vote-owner-0.1": 0.1, "vote-owner-0.25": 0.25, "vote-owner-0.5": 0.5}


class GnnVariant:
    def __init__(self, scores: _DetectorScores, variant: str):
        self.scores, self.variant, self.name = scores, variant, f"gnn-{variant}"

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        shift = VARIANTS[self.variant]
        if self.variant in FOLDING:
            owners = store_callers(normal.forest) | store_callers(window)
            moved = FOLDING[self.variant]
            if moved is not None:
                own = normal.service_shift_parts(window)["own"]
                owners = {store: owner for store, owner in owners.items() if own.get(owner, 0.0) > moved}
            shift = partial(shift, owners=owners)
        return _ranking(shift(self.scores(window), self.scores(normal.forest)))


class BmegVariant:
    def __init__(self, scores: _DetectorScores, variant: str):
        self.scores, self.variant, self.name = scores, variant, f"bmeg-{variant}"

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        # combined_ranking reads the module's node_score_shift: swapped for this call only
        window_module.node_score_shift = VARIANTS[self.variant]  # type: ignore[assignment]
        try:
            return combined_ranking(normal, window, self.scores(window), self.scores(normal.forest))
        finally:
            window_module.node_score_shift = node_score_shift  # type: ignore[assignment]


def rankers(detector: Detector, normal: SpanForest) -> list:
    detector = with_normal_baselines(detector, normal)
    scores, window_gcn = _DetectorScores(detector), window_gcn_of(detector)
    fused = [] if window_gcn is None else [BmegRanker(scores, window_gcn),
                                           BmegRanker(scores, window_gcn, "bmeg-without-votes", standardised_fusion)]
    return [*fused, *(BmegVariant(scores, v) for v in VARIANTS if v not in FOLDING),
            *(GnnVariant(scores, v) for v in VARIANTS), SelfTimeRanker()]


def table(summary: dict, names: list[str]) -> None:
    groups = {"latency": summary["latency_faults"], **summary["by_type"], "all": summary["overall"]}
    groups = {group: methods for group, methods in groups.items() if next(iter(methods.values()))["n"]}  # no faults: no column
    print("method | " + " | ".join(f"{g} ({next(iter(v.values()))['n']})" for g, v in groups.items()))
    for name in names:
        cells = [f"{v[name]['ac1']:.2f} / {v[name]['avg5']:.2f}" for v in groups.values()]
        print(f"{name} | " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--traces", type=Path)
    parser.add_argument("--faults", type=Path)
    parser.add_argument("--normal", type=Path)
    parser.add_argument("--window-minutes", type=float, default=0.1)
    parser.add_argument("--pod-suffix-parts", type=int, default=2)
    parser.add_argument("--simulated", type=Path, default=None, help="a topology (a twin): simulated faults instead")
    parser.add_argument("--window-seconds", type=float, default=10.0)
    parser.add_argument("--stores", action="store_true", help="with --simulated: faults on the stores, not the services")
    parser.add_argument("--scheduler", action="store_true",
                        help="with --simulated: CPU faults as the kernel's scheduler makes them (a quota, a hog)")
    args = parser.parse_args()
    detector = Detector.load(args.model, device="cpu")
    with tempfile.TemporaryDirectory() as out:
        if args.simulated is not None:
            from bmeg.evaluation.simulated import simulated_faults
            from bmeg.faultinject import load_topology

            spec = load_topology(args.simulated)
            stores = sorted(name for name, service in spec.services.items() if service.storage) if args.stores else None
            sim = simulated_faults(spec, Path(out), normal_s=20.0, window_s=args.window_seconds, seed=0, services=stores,
                                   scheduler=args.scheduler)
            normal, traces, fault_list, minutes, suffix = sim.normal, sim.traces, sim.fault_list, sim.window_minutes, 0
        else:
            normal, traces, fault_list = read_spans(args.normal), args.traces, args.faults
            minutes, suffix = args.window_minutes, args.pod_suffix_parts
        normal_forest = rpc_view(normal)
        chosen = rankers(detector, normal_forest)
        results = run_rca(TraceFiles(traces), read_fault_list(fault_list, suffix), normal, chosen, minutes, progress=True)
    table(report(results, [r.name for r in chosen]), [r.name for r in chosen])


if __name__ == "__main__":
    main()
