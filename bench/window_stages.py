"""Which stage of bmeg's window ranking (`bmeg.models.window.combined_ranking`) put each fault's
first service first, against the self-time rule, with the window's other faults taken out:

    python bench/window_stages.py record --model RUN --traces D/spans.parquet --faults D/fault_list.json \
        --normal D/normal.parquet --window-minutes 0.1 --recent-traces 300 --json STAGES.json
    python bench/window_stages.py analyse STAGES.json [STAGES.json ...]

`record` runs the harness (`bmeg evaluate rca`'s `run_rca`) with `bmeg`, the GNN alone, the
run's window GCN (where it holds one) and the self-time rule, and keeps, per fault, what
`combined_ranking` read on its window: the time shift's parts, the GNN's score shift, the
structure parts and tests and the normal noise they are gated on (the harness report, with a
`stages` entry per fault). `analyse` rebuilds bmeg's ranking from them (checked against the
harness's), and for each latency fault the rule names first and bmeg does not (both with the
window's other faulty services removed, the harness's `rank_others_removed`) says which stage put
bmeg's first there: a structure gate (`structure_changed`, `errors_began` or
`structure_significant`), the decisive call gap (`decisive_shift`), or the rank fusion (and
there, whether the time shift alone or the GNN alone had the fault first), and which part of the
first's time shift lifted it (its own self time, or a call gap as the caller or the callee).
Counts by stage and by fault source, per file.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pandas as pd

from bmeg.evaluation.faults import LATENCY_FAULTS, read_fault_list
from bmeg.evaluation.rankers import GnnRanker, SelfTimeRanker, WindowGcnRanker, _DetectorScores
from bmeg.evaluation.rca import report, run_rca
from bmeg.evaluation.windows import TraceFiles
from bmeg.graphs import SpanForest
from bmeg.graphs.rpc import rpc_view
from bmeg.models.detector import Detector
from bmeg.models.normal import NormalStats, Ranking
from bmeg.models.window import (combined_ranking, decisive_shift, errors_began, node_score_shift, rank_fusion,
                                structure_changed, structure_significant, window_gcn_of, with_normal_baselines)
from bmeg.traces.io import read_spans


class RecordingBmeg:
    """`bmeg` (`combined_ranking`), keeping what it read on each window, in the harness's order."""

    name = "bmeg"

    def __init__(self, scores: _DetectorScores):
        self.scores, self.stages = scores, []

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        window_scores, normal_scores = self.scores(window), self.scores(normal.forest)
        self.stages.append({
            "parts": normal.service_shift_parts(window).to_dict(),
            "gnn": node_score_shift(window_scores, normal_scores).to_dict(),
            "shape": normal.structure_parts(window).to_dict(),
            "tests": normal.structure_tests(window).to_dict(),
            "structure_noise": normal.structure_noise.to_dict(),
            "error_noise": normal.error_noise.to_dict(),
        })
        return combined_ranking(normal, window, window_scores, normal_scores)


def record(args: argparse.Namespace) -> None:
    normal = rpc_view(read_spans(args.normal))
    detector = Detector.load(args.model)
    scores = _DetectorScores(with_normal_baselines(detector, normal))
    bmeg = RecordingBmeg(scores)
    rankers: list = [bmeg, GnnRanker(scores)]
    window_gcn = window_gcn_of(detector)
    if window_gcn is not None:
        rankers.append(WindowGcnRanker(scores, window_gcn))
    rankers.append(SelfTimeRanker())
    files = TraceFiles(args.traces)
    results = run_rca(files, read_fault_list(args.faults, 2), normal, rankers, args.window_minutes,
                      recent_traces=args.recent_traces)
    summary = report(results, [r.name for r in rankers], files, args.window_minutes)
    for fault, stages in zip(summary["faults"], bmeg.stages, strict=True):
        fault["stages"] = stages
    args.json.write_text(json.dumps(summary))
    for name in (r.name for r in rankers):
        scored = summary["latency_faults"][name]
        print(f"{name}: latency AC@1 {scored['ac1']:.3f}, others removed {scored['ac1_others_removed']:.3f}")


def inputs(stages: dict) -> dict:
    """The stages' series and frames back from their JSON form."""
    return {"parts": pd.DataFrame(stages["parts"]), "gnn": pd.Series(stages["gnn"], dtype=float),
            "shape": pd.DataFrame(stages["shape"]), "tests": pd.DataFrame(stages["tests"]),
            "structure_noise": pd.Series(stages["structure_noise"], dtype=float),
            "error_noise": pd.Series(stages["error_noise"], dtype=float)}


def ranked(got: dict) -> tuple[list[str], dict[str, str], str | None, pd.Series]:
    """`combined_ranking` from its inputs: (services best first, the gate each changed service
    passed, the decisive service, the fusion's scores)."""
    parts = got["parts"]
    fused = rank_fusion(parts.max(axis=1), got["gnn"])
    shape = got["shape"].reindex(fused.index)
    structure = shape[["calls", "errors"]].sum(axis=1).fillna(0.0)
    gates = {"structure_changed": structure_changed(structure, got["structure_noise"]),
             "errors_began": errors_began(shape, got["error_noise"]),
             "structure_significant": structure_significant(got["tests"]).reindex(fused.index, fill_value=False)}
    changed = gates["structure_changed"] | gates["errors_began"] | gates["structure_significant"]
    gate = {s: "+".join(name for name, fired in gates.items() if fired.get(s, False)) for s in changed[changed].index}
    first = structure[changed].sort_values(ascending=False, kind="stable")
    rest = fused[~changed]
    decisive = decisive_shift(parts[["caller", "callee"]].max(axis=1))
    order = [*first.index, *([decisive] if decisive in rest.index else []),
             *[s for s in rest.index if s != decisive]]
    return [str(s) for s in order], gate, decisive, fused


def stage_of(fault: dict) -> tuple[str, str]:
    """(the stage that put bmeg's first, others removed, first; bmeg's first)."""
    others = set(fault["others"])
    order, gate, decisive, fused = ranked(inputs(fault["stages"]))
    top = next(s for s in order if s not in others)
    if top in gate:
        return f"gate {gate[top]}", top
    table = inputs(fault["stages"])["parts"]
    # the time shift's part that lifted the first: its own self time, or a call gap it got as the
    # caller (the smallest shift of its calls) or as the callee
    lifted = f"its {table.loc[top].idxmax()} part" if top in table.index and table.loc[top].notna().any() else "no time shift"
    if top == decisive:
        return f"decisive call gap ({lifted})", top
    parts = table.max(axis=1).drop(list(others), errors="ignore")
    gnn = inputs(fault["stages"])["gnn"].drop(list(others), errors="ignore")
    if fault["service"] == top:
        return "fusion", top
    if parts.idxmax() == fault["service"]:
        return "fusion: the GNN outvoted the time shift", top
    if gnn.idxmax() == fault["service"]:
        return f"fusion: the time shift ({lifted}) outvoted the GNN", top
    return f"fusion: neither had it first (the first by {lifted})", top


def analyse(paths: list[Path]) -> None:
    for path in paths:
        faults = json.loads(path.read_text())["faults"]
        mismatched = sum(ranked(inputs(f["stages"]))[0][:5] != f["top"]["bmeg"] for f in faults)
        latency = [f for f in faults if f["type"] in LATENCY_FAULTS]
        lost = [f for f in latency if f["rank_others_removed"]["self-time"] == 1
                and f["rank_others_removed"]["bmeg"] != 1]
        won = [f for f in latency if f["rank_others_removed"]["bmeg"] == 1
               and f["rank_others_removed"]["self-time"] != 1]
        print(f"{path}: {len(latency)} latency faults; rebuilt rankings differing from the harness's: {mismatched}; "
              f"the rule right and bmeg wrong: {len(lost)}, the other way: {len(won)}")
        by_stage = Counter(stage_of(f)[0] for f in lost)
        for stage, count in by_stage.most_common():
            sources = Counter(f["type"] for f in lost if stage_of(f)[0] == stage)
            print(f"  {count:3d} {stage}: " + ", ".join(f"{k} {v}" for k, v in sources.most_common()))
        won_by = Counter(stage_of(f)[0] for f in won)
        print("  bmeg's own wins by stage: " + ", ".join(f"{k} {v}" for k, v in won_by.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--model", type=Path, required=True)
    rec.add_argument("--traces", type=Path, required=True)
    rec.add_argument("--faults", type=Path, required=True)
    rec.add_argument("--normal", type=Path, required=True)
    rec.add_argument("--window-minutes", type=float, default=0.1)
    rec.add_argument("--recent-traces", type=int, default=None)
    rec.add_argument("--json", type=Path, required=True)
    ana = commands.add_parser("analyse")
    ana.add_argument("stages", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "record":
        record(args)
    else:
        analyse(args.stages)


if __name__ == "__main__":
    main()
