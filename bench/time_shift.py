"""The time-shift half of bmeg's ranker alone against the self-time rule, per fault type.

    python bench/time_shift.py --traces D/spans.parquet --faults D/fault_list.json --normal D/normal.parquet \
        [--window-minutes 0.1]
    python bench/time_shift.py --simulated bmeg/faultinject/topologies/trainticket.yaml [...more topologies]

For each fault's window: AC@1 of `NormalStats.service_shift` with a caller's part taken as the
smallest shift of its calls (now) and as their median (before), and of the self-time rule
(`NormalStats.exclusive_increase`). No model is needed: these are the rules the ranker fuses with
the GNN's ranking. `--simulated` simulates the faults `bmeg evaluate rca-sim --window-seconds 10`
does (`simulated_faults`, a 20-s normal period, seed 0). The last line of each data set says, for
the `DECISIVE_LEAD` rule of `bmeg.models.window.decisive_shift` (on the call gaps' parts, as the ranker), in how many fault windows a
service led by that much and in how many of them it was a faulty one (that of the fault or of one
injected at the same time: the testbed injects 2-3 at once).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd

from bmeg.evaluation.faults import read_fault_list
from bmeg.models.normal import NormalStats
from bmeg.models.window import decisive_shift
from bmeg.evaluation.windows import TraceFiles
from bmeg.graphs.rpc import rpc_view
from bmeg.traces.io import read_spans

LATENCY = {"network_delay", "cpu_consumed", "cpu_contention"}


def first(scores: pd.Series) -> str | None:
    return None if scores.dropna().empty else str(scores.idxmax())


def rows_of(stats: NormalStats, files: TraceFiles, fault_list: Path, window_ns: int, suffix_parts: int) -> list[dict]:
    rows = []
    faults = read_fault_list(fault_list, suffix_parts)
    for fault in faults:
        window = rpc_view(files.window(fault.start_ns, fault.start_ns + window_ns))
        if not window.num_traces:
            continue
        parts = stats.service_shift_parts(window)
        smallest = parts.max(axis=1)
        decisive = decisive_shift(parts[["caller", "callee"]].max(axis=1))
        rows.append({"type": fault.kind,
                     "shift, caller's part the smallest (now)": first(smallest) == fault.service,
                     "shift, caller's part the median (before)": first(stats.service_shift(window, "median")) == fault.service,
                     "self-time rule": first(stats.exclusive_increase(window)) == fault.service,
                     "decisive": decisive is not None,
                     # with faults at once (the testbed): the service of any fault whose window overlaps
                     "decisive right": decisive in {f.service for f in faults if abs(f.start_ns - fault.start_ns) < window_ns}})
    return rows


def report(name: str, rows: list[dict]) -> None:
    frame = pd.DataFrame(rows)
    frame["group"] = frame["type"]
    latency = frame[frame["type"].isin(LATENCY)].assign(group="latency")
    table = pd.concat([frame, latency]).groupby("group")
    methods = [c for c in frame.columns if c not in ("type", "group", "decisive", "decisive right")]
    print(f"== {name}: AC@1 per fault type (number of faults)")
    for group, of_group in table:
        print(f"  {group} ({len(of_group)}): " + ", ".join(f"{m} {of_group[m].mean():.2f}" for m in methods))
    print(f"  decisive lead: {int(frame['decisive'].sum())} windows, the faulty service in "
          f"{int(frame['decisive right'].sum())}; code-fault windows with one: "
          f"{int(frame[frame['type'].isin(['exception', 'return'])]['decisive'].sum())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulated", type=Path, nargs="*", default=None, help="topologies: simulated faults instead")
    parser.add_argument("--traces", type=Path)
    parser.add_argument("--faults", type=Path)
    parser.add_argument("--normal", type=Path)
    parser.add_argument("--window-minutes", type=float, default=0.1)
    parser.add_argument("--pod-suffix-parts", type=int, default=2)
    args = parser.parse_args()
    if args.simulated:
        from bmeg.evaluation.simulated import simulated_faults
        from bmeg.faultinject import load_topology

        for topology in args.simulated:
            with tempfile.TemporaryDirectory() as out:
                sim = simulated_faults(load_topology(topology), Path(out), normal_s=20.0, window_s=10.0, seed=0)
                stats = NormalStats.from_forest(rpc_view(sim.normal))
                report(topology.stem, rows_of(stats, TraceFiles(sim.traces), sim.fault_list,
                                              int(sim.window_minutes * 60e9), 0))
        return
    if not (args.traces and args.faults and args.normal):
        parser.error("--traces, --faults and --normal are required (or --simulated TOPOLOGY ...)")
    stats = NormalStats.from_forest(rpc_view(read_spans(args.normal)))
    report(args.traces.parent.name, rows_of(stats, TraceFiles(args.traces), args.faults,
                                            int(args.window_minutes * 60e9), args.pod_suffix_parts))


if __name__ == "__main__":
    main()
