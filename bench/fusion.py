"""bmeg's fusion of the time shift and the window GCN: by ranks (`rank_fusion`, bmeg's until
issue 12, session 21) against by standardised scores (`standardised_fusion`, bmeg's since), on
the same windows:

    python bench/fusion.py sim RUN [RUN ...] [--windows 60] [--seed 0] [--cache DIR]
    python bench/fusion.py replay STAGES.json [STAGES.json ...]

`sim` is the synthetic validation: latency windows simulated from each run's twin apart from its
training windows (`bench/window_gcn.py`'s held-out seeds), each ranked by the time shift's largest
part alone, the run's window GCN alone, and each fusion after the decisive call gap
(`decisive_shift`), as `ranked_stages` orders what no structure gate placed; top-1 of a faulty
service per run.

`replay` re-ranks the windows of `bench/window_stages.py record` files (which keep, per fault,
what bmeg's stages read: the time shift's parts, the learned scores, the gates that fired, the
decisive service) with each fusion, and prints AC@1 of latency faults (plain and with the
window's other faulty services removed) and of each fault type; it first counts the windows
where replaying each fusion gives the recorded ranking (top 5; records made before session 21
hold rank fusion's, later ones the standardised fusion's).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bmeg.evaluation.faults import LATENCY_FAULTS
from bmeg.models.window import decisive_shift, rank_fusion, staged_order, standardised_fusion
from bmeg.models.window_gcn import FEATURES, WINDOW_GCN_FILE, load_window_gcn
from bmeg.training.window_gcn import TrainingWindow
from window_gcn import HELD_OUT_SEED, windows_of  # bench/window_gcn.py

FUSIONS: dict[str, Callable[..., pd.Series]] = {"rank fusion (bmeg until session 21)": rank_fusion,
                                                "standardised fusion (bmeg)": standardised_fusion}
PARTS = ("own", "caller", "callee", "wait")


def window_parts(window: TrainingWindow) -> pd.DataFrame:
    """The time shift's parts of a simulated window, from its GCN inputs (NaN where it has none)."""
    x = pd.DataFrame(window.graph.x.numpy(), index=window.graph.services, columns=list(FEATURES))
    return pd.DataFrame({part: x[part].where(x[f"has_{part}"] > 0) for part in PARTS})


def sim(args: argparse.Namespace) -> None:
    for run in args.runs:
        model = load_window_gcn(run / WINDOW_GCN_FILE)
        windows = windows_of(run, args.windows, HELD_OUT_SEED + args.seed, 0.0, args.cache)
        hits: dict[str, list[bool]] = {name: [] for name in ("time shift alone", "window GCN alone", *FUSIONS)}
        for window in windows:
            parts = window_parts(window)
            with torch.no_grad():
                learned = pd.Series(model(window.graph.x, window.graph.edges).numpy(), index=window.graph.services)
            faulty = {window.graph.services[i] for i in window.targets}
            time = parts.max(axis=1).dropna()
            hits["time shift alone"].append(str(time.idxmax()) in faulty)
            hits["window GCN alone"].append(str(learned.idxmax()) in faulty)
            decisive = decisive_shift(parts[["caller", "callee"]].max(axis=1))
            for name, fusion in FUSIONS.items():
                first = staged_order(fusion(parts.max(axis=1), learned), pd.Series(dtype=float), decisive).index[0]
                hits[name].append(str(first) in faulty)
        cells = ", ".join(f"{name} {np.mean(got):.3f}" for name, got in hits.items())
        print(f"{run}: {len(windows)} held-out latency windows (seed {HELD_OUT_SEED + args.seed}): top-1 {cells}",
              flush=True)


def replayed(stages: dict, fusion: Callable[..., pd.Series]) -> list[str]:
    """bmeg's ranking of a recorded window with `fusion` in place of the recorded one."""
    parts = pd.DataFrame(stages["parts"])
    learned = pd.Series(stages["learned"], dtype=float)
    fused = fusion(parts.max(axis=1), learned)
    gated = pd.Series(stages["structure"], dtype=float).reindex([s for s in fused.index if s in stages["gates"]])
    return [str(s) for s in staged_order(fused, gated.fillna(0.0), stages["decisive"]).index]


def replay(args: argparse.Namespace) -> None:
    for path in args.stages:
        faults = json.loads(path.read_text())["faults"]
        recorded = [[s for s, _ in f["stages"]["ranking"]] for f in faults]
        same = {name: sum(replayed(f["stages"], fusion)[:5] == r[:5] for f, r in zip(faults, recorded, strict=True))
                for name, fusion in FUSIONS.items()}
        print(f"{path}: {len(faults)} faults; replayed as recorded (top 5): "
              + ", ".join(f"{name} {count}" for name, count in same.items()))
        for name, fusion in FUSIONS.items():
            rows: dict[str, list[bool]] = {"latency": [], "latency, others removed": []}
            for fault in faults:
                ranking = replayed(fault["stages"], fusion)
                others = set(fault["others"])
                rows.setdefault(fault["type"], []).append(ranking[0] == fault["service"])
                if fault["type"] in LATENCY_FAULTS:
                    rows["latency"].append(ranking[0] == fault["service"])
                    rows["latency, others removed"].append(
                        next(s for s in ranking if s not in others) == fault["service"])
            cells = ", ".join(f"{row} {np.mean(got):.3f} ({len(got)})" for row, got in rows.items() if got)
            print(f"  {name}: AC@1 {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    simulated = commands.add_parser("sim")
    simulated.add_argument("runs", type=Path, nargs="+")
    simulated.add_argument("--windows", type=int, default=60)
    simulated.add_argument("--seed", type=int, default=0)
    simulated.add_argument("--cache", type=Path, default=None)
    recorded = commands.add_parser("replay")
    recorded.add_argument("stages", type=Path, nargs="+")
    args = parser.parse_args()
    sim(args) if args.command == "sim" else replay(args)


if __name__ == "__main__":
    main()
