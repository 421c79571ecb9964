"""Models compared in one run of the root-cause harness: e.g. a twin-only bootstrap against one
started from a family-pretrained run (`bmeg bootstrap --pretrained`):

    python bench/family_pretrain.py --model twin=RUN_A --model family=RUN_B \
        --traces D/spans.parquet --faults D/fault_list.json --normal D/normal.parquet --window-minutes 0.1 \
        [--recent-traces 300]
    python bench/family_pretrain.py --model twin=RUN_A --model family=RUN_B \
        --simulated bmeg/faultinject/topologies/trainticket.yaml [--window-seconds 10]

Every model is scored on the same windows by the rankers of `bmeg evaluate rca` that depend on
it, `bmeg` (the combined ranker), `bmeg-gnn` (the GNN alone) and, where the run directory holds
a window GCN, `bmeg-window-gcn` (`bmeg bootstrap` or `bench/window_gcn.py` trains it) and
`bmeg-gnn-fusion` (`bmeg` with the GNN, not the window GCN, in its fusion), named `<ranker>[<model>]`, and any window GCN file given with
`--window-gcn LABEL=FILE` (on the first model's GNN scores); the self-time and structure-shift
rules, which need no model, once. `--simulated` simulates the faults as `bmeg evaluate rca-sim`
does (one episode per service and source, a normal period of twice the
window). Prints AC@1 / Avg@5 per fault group (latency faults, code faults, all).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bmeg.evaluation.faults import read_fault_list
from bmeg.evaluation.rankers import (BmegRanker, GnnRanker, SelfTimeRanker, StructureRanker,
                                     WindowGcnRanker, _DetectorScores, window_gcn_of)
from bmeg.evaluation.rca import report, run_rca
from bmeg.evaluation.simulated import simulated_faults
from bmeg.evaluation.windows import TraceFiles
from bmeg.faultinject import load_topology
from bmeg.graphs import SpanForest
from bmeg.graphs.rpc import rpc_view
from bmeg.models.detector import Detector
from bmeg.models.normal import NormalStats, Ranking
from bmeg.models.window import node_score_shift, with_normal_baselines
from bmeg.models.window_gcn import WindowGraph, WindowModel, load_window_gcn, rank_window, service_features
from bmeg.traces.io import read_spans


class Named:
    """A ranker under another name (the same ranker class for several models)."""

    def __init__(self, ranker, name: str):
        self.ranker, self.name = ranker, name

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        return self.ranker.rank(window, normal)


class SharedWindowGraph:
    """A window's `service_features` (on the first model's GNN scores), computed once for every
    window GCN file given with `--window-gcn`: the harness ranks each window with every ranker in
    turn, and reading the features is most of a window GCN's time."""

    def __init__(self, scores: _DetectorScores):
        self.scores = scores
        self._last: tuple[SpanForest, NormalStats, WindowGraph] | None = None

    def __call__(self, window: SpanForest, normal: NormalStats) -> WindowGraph:
        if self._last is None or self._last[0] is not window or self._last[1] is not normal:
            gnn = node_score_shift(self.scores(window), self.scores(normal.forest))
            self._last = (window, normal, service_features(normal, window, gnn))
        return self._last[2]


class WindowGcnFile:
    """A window GCN file's ranking (as `WindowGcnRanker`'s) on the shared features."""

    def __init__(self, graph: SharedWindowGraph, model: WindowModel, name: str):
        self.graph, self.model, self.name = graph, model, name

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        return rank_window(self.model, self.graph(window, normal))


def rankers(models: dict[str, Path], normal: SpanForest, window_gcns: dict[str, Path] | None = None) -> list:
    chosen: list = []
    for label, run_dir in models.items():
        detector = Detector.load(run_dir)
        scores = _DetectorScores(with_normal_baselines(detector, normal))
        window_gcn = window_gcn_of(detector)
        chosen += [Named(BmegRanker(scores, window_gcn), f"bmeg[{label}]"), Named(GnnRanker(scores), f"bmeg-gnn[{label}]")]
        if window_gcn is not None:
            chosen += [Named(BmegRanker(scores, None), f"bmeg-gnn-fusion[{label}]"),
                       Named(WindowGcnRanker(scores, window_gcn), f"bmeg-window-gcn[{label}]")]
        if label == next(iter(models)):  # other window GCN files read the first model's GNN scores
            graph = SharedWindowGraph(scores)
            chosen += [WindowGcnFile(graph, load_window_gcn(path), f"bmeg-window-gcn[{name}]")
                       for name, path in (window_gcns or {}).items()]
    return [*chosen, SelfTimeRanker(), StructureRanker()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="LABEL=RUN_DIR (repeat)")
    parser.add_argument("--traces", type=Path)
    parser.add_argument("--faults", type=Path)
    parser.add_argument("--normal", type=Path)
    parser.add_argument("--window-minutes", type=float, default=0.1)
    parser.add_argument("--recent-traces", type=int, default=None,
                        help="compare each window with the latest N traces before its fault (`bmeg evaluate rca`'s option)")
    parser.add_argument("--simulated", type=Path, help="a topology spec: simulate its faults instead")
    parser.add_argument("--window-seconds", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--window-gcn", action="append", default=[],
                        help="LABEL=FILE: one more window GCN file, scored with the first model's GNN (repeat)")
    parser.add_argument("--json", type=Path, help="also write the harness's whole report (every fault's ranks) here")
    args = parser.parse_args()
    models = {label: Path(run) for label, _, run in (given.partition("=") for given in args.model)}
    with tempfile.TemporaryDirectory() as scratch:
        if args.simulated is not None:
            sim = simulated_faults(load_topology(args.simulated), Path(scratch), normal_s=2 * args.window_seconds,
                                   window_s=args.window_seconds, seed=args.seed)
            normal, files, faults, minutes = rpc_view(sim.normal), TraceFiles(sim.traces), \
                read_fault_list(sim.fault_list, 0), sim.window_minutes
        else:
            if args.traces is None or args.faults is None or args.normal is None:
                parser.error("give --traces, --faults and --normal, or --simulated")
            normal, files, faults, minutes = rpc_view(read_spans(args.normal)), TraceFiles(args.traces), \
                read_fault_list(args.faults, 2), args.window_minutes
        chosen = rankers(models, normal, {label: Path(file) for label, _, file in
                                          (given.partition("=") for given in args.window_gcn)})
        results = run_rca(files, faults, normal, chosen, minutes, progress=False, recent_traces=args.recent_traces)
        summary = report(results, [r.name for r in chosen], files, minutes)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    groups = {"latency": summary["latency_faults"], "all": summary["overall"],
              **{kind: ranked for kind, ranked in summary["by_type"].items()}}
    header = ["method", *groups]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for ranker in chosen:
        cells = [_cell(groups[g][ranker.name]) for g in groups]
        print(f"| {ranker.name} | " + " | ".join(cells) + " |")


def _cell(score: dict) -> str:
    if not score["n"]:
        return "-"
    return f"{score['ac1']:.2f} / {score['avg5']:.2f} ({score['n']})"


if __name__ == "__main__":
    main()
