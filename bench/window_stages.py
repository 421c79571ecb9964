"""Which stage of bmeg's window ranking (`bmeg.models.window.combined_ranking`) put each fault's
first service first, against the self-time rule, with the window's other faults taken out:

    python bench/window_stages.py record --model RUN --traces D/spans.parquet --faults D/fault_list.json \
        --normal D/normal.parquet --window-minutes 0.1 --recent-traces 300 --json STAGES.json
    python bench/window_stages.py analyse STAGES.json [STAGES.json ...]

`record` runs the harness (`bmeg evaluate rca`'s `run_rca`) with `bmeg`, the GNN alone, the
run's window GCN (where it holds one) and the self-time rule, and keeps, per fault, what the
library's `window_stages` (the path `combined_ranking` takes) says of its window: bmeg's ranking
with the stage that placed each service, the structure gates that fired and the structure
shifts, the decisive service, the time shift's parts (own / caller / callee / wait,
`NormalStats.service_shift_parts`), the call edges' gap shifts (caller, callee, mean log2:
`NormalStats.call_edge_shifts`) and the GNN's score shift (the harness report, with a `stages`
entry per fault; log2 shifts to 3 decimals; `learned`: the window GCN's logits where the run
holds one, as bmeg fuses them, else the GNN's score shift; `votes`: the GNN's culprit votes bmeg
fuses beside them, null where it fuses none). `analyse`, for each latency fault the rule names
first and bmeg does not (both with the window's other faulty services removed, the harness's
`rank_others_removed`), says which stage put bmeg's first there: a structure gate
(`structure_changed`, `errors_began` or `structure_significant`), the decisive call gap
(`decisive_shift`), or the fusion (and there, which of the rankings it fused had the fault first:
the time shift, the learned ranking, the GNN's culprit votes), and which part of the first's time shift lifted it (its own self time, or
a call gap as the caller or the callee, or the start waits of the calls into it). Counts by stage and by fault source, per file. Files
recorded before session 18 (the stages' inputs, rebuilt here then) are not read.
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
from bmeg.models.window_gcn import WindowModel
from bmeg.models.window import (GATES, STAGE_DECISIVE, STAGE_STRUCTURE, WindowStages, window_gcn_of, window_stages,
                                with_normal_baselines)
from bmeg.traces.io import read_spans


class RecordingBmeg:
    """`bmeg` (`combined_ranking`, through `window_stages`), keeping what it read on each window
    and which stage placed each service, in the harness's order."""

    name = "bmeg"

    def __init__(self, scores: _DetectorScores, window_gcn: WindowModel | None):
        self.scores, self.window_gcn, self.stages = scores, window_gcn, []

    def rank(self, window: SpanForest, normal: NormalStats) -> Ranking:
        got = window_stages(normal, window, self.scores(window), self.scores(normal.forest), self.window_gcn,
                            learned=self.scores.learned(window, normal, self.window_gcn),
                            votes=self.scores.votes(window, normal))
        self.stages.append(recorded(got, normal.call_edge_shifts(window)))
        return got.ranking


def recorded(got: WindowStages, edges: pd.Series) -> dict:
    """A window's `WindowStages` and call edges (`NormalStats.call_edge_shifts`) in compact JSON
    form: log2 shifts to 3 decimals, learned scores and votes to 4 significant digits, no NaN."""
    def rounded(series: pd.Series, digits: int = 3) -> dict[str, float]:
        return {str(k): round(float(v), digits) for k, v in series.dropna().items()}

    def significant(series: pd.Series) -> dict[str, float]:
        return {str(k): float(f"{v:.4g}") for k, v in series.dropna().items()}

    return {"ranking": [[service, got.stage[service]] for service, _ in got.ranking],
            "decisive": got.decisive,
            "gates": {str(s): [g for g in GATES if fired[g]] for s, fired in got.gates[got.gates.any(axis=1)].iterrows()},
            "structure": rounded(got.structure[got.structure != 0]),
            "parts": {column: rounded(got.parts[column]) for column in got.parts.columns},
            "edges": [[str(caller), str(callee), round(float(v), 3)] for (caller, callee), v in edges.dropna().items()],
            "learned": significant(got.learned),
            "votes": None if got.votes is None else significant(got.votes)}


def record(args: argparse.Namespace) -> None:
    normal = rpc_view(read_spans(args.normal))
    detector = Detector.load(args.model)
    scores = _DetectorScores(with_normal_baselines(detector, normal))
    window_gcn = window_gcn_of(detector)
    bmeg = RecordingBmeg(scores, window_gcn)
    rankers: list = [bmeg, GnnRanker(scores)]
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
        if scored["n"]:
            print(f"{name}: latency AC@1 {scored['ac1']:.3f}, others removed {scored['ac1_others_removed']:.3f}")
        else:  # a recording of code faults only
            print(f"{name}: AC@1 {summary['overall'][name]['ac1']:.3f} (no latency faults)")


def stage_of(fault: dict) -> tuple[str, str]:
    """(the stage that put bmeg's first, others removed, first; bmeg's first)."""
    others = set(fault["others"])
    stages = fault["stages"]
    top, stage = next((s, stage) for s, stage in stages["ranking"] if s not in others)
    if stage == STAGE_STRUCTURE:
        return f"gate {'+'.join(stages['gates'][top])}", top
    table = pd.DataFrame(stages["parts"])
    # the time shift's part that lifted the first: its own self time, or a call gap it got as the
    # caller (the smallest shift of its calls) or as the callee
    lifted = f"its {table.loc[top].idxmax()} part" if top in table.index and table.loc[top].notna().any() else "no time shift"
    if stage == STAGE_DECISIVE:
        return f"decisive call gap ({lifted})", top
    if fault["service"] == top:
        return "fusion", top
    fused = {"time shift": table.max(axis=1), "learned ranking": stages["learned"], "GNN's votes": stages.get("votes") or {}}
    had_it = [name for name, scores in fused.items()
              if not (ranked := pd.Series(scores, dtype=float).drop(list(others), errors="ignore").dropna()).empty
              and ranked.idxmax() == fault["service"]]
    if had_it:
        return f"fusion: outvoted, the {' and the '.join(had_it)} had it first (the first by {lifted})", top
    return f"fusion: none had it first (the first by {lifted})", top


def analyse(paths: list[Path]) -> None:
    for path in paths:
        faults = json.loads(path.read_text())["faults"]
        if faults and "ranking" not in faults[0]["stages"]:
            raise SystemExit(f"{path}: recorded before session 18 (no stages per service): record it again")
        mismatched = sum([s for s, _ in f["stages"]["ranking"][:5]] != f["top"]["bmeg"] for f in faults)
        latency = [f for f in faults if f["type"] in LATENCY_FAULTS]
        lost = [f for f in latency if f["rank_others_removed"]["self-time"] == 1
                and f["rank_others_removed"]["bmeg"] != 1]
        won = [f for f in latency if f["rank_others_removed"]["bmeg"] == 1
               and f["rank_others_removed"]["self-time"] != 1]
        print(f"{path}: {len(latency)} latency faults; recorded orders differing from the harness's: {mismatched}; "
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
