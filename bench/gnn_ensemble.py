"""The GNN alone, one bootstrap against the mean of several, in one run of the root-cause harness:

    python bench/gnn_ensemble.py --runs RUN-s6 RUN-s7 RUN-s8 RUN-s9 RUN-s10 RUN-s11 --members 3 \
        --traces D/spans.parquet --faults D/fault_list.json --normal D/normal.parquet [--window-minutes 0.08] \
        [--recent-traces 300]

The runs are bootstraps of one application (`bmeg bootstrap NORMAL --seed S`), each its own twin
draws, DGCNN and node GCN. Consecutive runs, `--members` at a time, make an ensemble, ranked two
ways beside each run's own `bmeg-gnn` (`culprit_vote_shift`):
- `vote-mean`: the mean of the members' culprit vote shifts (each member names each trace's
  culprit and weighs it by its own P(anomalous));
- `score-mean`: the members' per-trace service scores and P(anomalous) averaged first, then one
  culprit vote shift.
Also per run: bmeg (`bmeg`), bmeg fed the ensemble's `vote-mean` in place of its run's own votes
(`bmeg-vote-mean`, the first member's window GCN and time shift), and the window GCN; the
self-time rule once. Unlike `bagged_node_stage` (`--node-draws`, one twin, one DGCNN: issue 12,
session 28, rule W), a member here differs in everything a bootstrap draws. Prints AC@1 / Avg@5
per fault group for every ranker, and the latency AC@1 of the single runs' mean against the
ensembles' mean (issue 12, session 33, rule C).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from window_score import table

from bmeg.evaluation.faults import read_fault_list
from bmeg.evaluation.rankers import SelfTimeRanker, _DetectorScores, _ranking
from bmeg.evaluation.rca import report, run_rca
from bmeg.evaluation.windows import TraceFiles
from bmeg.graphs import SpanForest
from bmeg.graphs.rpc import rpc_view
from bmeg.models.detector import Detector
from bmeg.models.normal import NormalStats, Ranking
from bmeg.models.window import combined_ranking, culprit_vote_shift, window_gcn_of, with_normal_baselines
from bmeg.traces.io import read_spans


class Member:
    """One bootstrap's scores, as the harness's detector-based rankers share them."""

    def __init__(self, run: Path, normal: SpanForest):
        self.name = run.name
        self.scores = _DetectorScores(with_normal_baselines(Detector.load(run, device="cpu"), normal))
        self.window_gcn = window_gcn_of(self.scores.detector)

    def votes(self, window: SpanForest, normal: NormalStats) -> pd.Series:
        return self.scores.votes(window, normal)

    def bmeg(self, window: SpanForest, normal: NormalStats, votes: pd.Series | None = None) -> Ranking:
        learned = self.scores.learned(window, normal, self.window_gcn)
        own = self.votes(window, normal) if votes is None else votes
        return combined_ranking(normal, window, self.scores(window), self.scores(normal.forest), self.window_gcn,
                                None, learned, own)


def vote_mean(members: list[Member], window: SpanForest, normal: NormalStats) -> pd.Series:
    return pd.concat([m.votes(window, normal) for m in members], axis=1).fillna(0.0).mean(axis=1)


def averaged_scores(members: list[Member], forest: SpanForest) -> Any:
    """The first member's scores of `forest` with the members' service scores and P(anomalous) averaged."""
    each = [m.scores(forest) for m in members]
    if any(list(s.services) != list(each[0].services) for s in each):
        raise ValueError("the members score the forest's services in different orders")
    return replace(each[0], gnn_service=np.mean([s.gnn_service for s in each], axis=0),
                   gnn_anomaly=np.mean([s.gnn_anomaly for s in each], axis=0))


class Ranked:
    """A ranker of the harness from a function of (window, normal period)."""

    def __init__(self, name: str, rank: Any):
        self.name, self._rank = name, rank

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        return self._rank(window, normal)


def rankers(members: list[Member], size: int) -> tuple[list[Ranked], list[str], list[str]]:
    """Every ranker, the names of the single runs' `bmeg-gnn` and the names of the ensembles' `vote-mean`."""
    singles = [Ranked(f"bmeg-gnn {m.name}", lambda w, n, m=m: _ranking(m.votes(w, n))) for m in members]
    groups = [members[i:i + size] for i in range(0, len(members) - size + 1, size)]
    ensembles = []
    for group in groups:
        label = "+".join(m.name for m in group)
        ensembles += [
            Ranked(f"vote-mean {label}", lambda w, n, g=group: _ranking(vote_mean(g, w, n))),
            Ranked(f"score-mean {label}", lambda w, n, g=group: _ranking(
                culprit_vote_shift(averaged_scores(g, w), averaged_scores(g, n.forest)))),
            Ranked(f"bmeg-vote-mean {label}", lambda w, n, g=group: g[0].bmeg(w, n, vote_mean(g, w, n))),
        ]
    fused = [Ranked(f"bmeg {m.name}", m.bmeg) for m in members]
    window_gcns = [Ranked(f"bmeg-window-gcn {m.name}", lambda w, n, m=m: _ranking(m.scores.learned(w, n, m.window_gcn)))
                   for m in members if m.window_gcn is not None]
    every = [*singles, *ensembles, *fused, *window_gcns, Ranked(SelfTimeRanker.name, SelfTimeRanker().rank)]
    return every, [r.name for r in singles], [r.name for r in ensembles if r.name.startswith("vote-mean")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, nargs="+", required=True, help="bootstraps of one application")
    parser.add_argument("--members", type=int, default=3, help="runs per ensemble, taken in the order given")
    parser.add_argument("--traces", type=Path, required=True)
    parser.add_argument("--faults", type=Path, required=True)
    parser.add_argument("--normal", type=Path, required=True)
    parser.add_argument("--window-minutes", type=float, default=0.08)
    parser.add_argument("--recent-traces", type=int, default=None, help="normal period: the latest N traces before each window")
    parser.add_argument("--pod-suffix-parts", type=int, default=2)
    args = parser.parse_args()
    if not 1 <= args.members <= len(args.runs):
        parser.error(f"--members must be between 1 and the {len(args.runs)} runs given")
    normal = read_spans(args.normal)
    members = [Member(run, rpc_view(normal)) for run in args.runs]
    chosen, singles, ensembles = rankers(members, args.members)
    results = run_rca(TraceFiles(args.traces), read_fault_list(args.faults, args.pod_suffix_parts), normal, chosen,
                      args.window_minutes, progress=True, recent_traces=args.recent_traces)
    summary = report(results, [r.name for r in chosen])
    table(summary, [r.name for r in chosen])
    latency = summary["latency_faults"]
    single = statistics.mean(latency[name]["ac1"] for name in singles)
    ensemble = statistics.mean(latency[name]["ac1"] for name in ensembles)
    print(f"GNN alone, latency AC@1: single runs' mean {single:.3f}, vote-mean ensembles' mean {ensemble:.3f} "
          f"({ensemble - single:+.3f}); self-time rule {latency[SelfTimeRanker.name]['ac1']:.3f}")


if __name__ == "__main__":
    main()
