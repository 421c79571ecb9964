"""The bmeg ranker's structure gate: a fixed bar vs a bar above each service's own normal noise.

    python bench/structure_gate.py --traces D/spans.parquet --faults D/fault_list.json \
        --normal D/normal.parquet --harness RCA.json [--window-minutes 0.1] [--json OUT]

RCA.json is the `--json` output of `bmeg evaluate rca` on the same traces, faults and window
(it gives the GNN's ranking of each window, `bmeg-gnn`; the GNN is not run again here). For
each fault's window this recomputes what the bmeg ranker does (`BmegRanker`: the rank fusion of
`NormalStats.service_shift` and the GNN's ranking, the services whose structure changed
first, then a decisive time shift) once per gate, and prints AC@1 and Avg@5 per fault type and on each half of the fault
list (in time order), so a rule chosen on one half is seen on the other. The harness's JSON
keeps the GNN's top 5 only: services below its 5th count as unranked by it, so the fixed bar's
row's AC@1 is the harness's (it says in how many windows), its Avg@5 may differ.

    python bench/structure_gate.py --simulated bmeg/faultinject/topologies/trainticket.yaml
    python bench/structure_gate.py --healthy H.parquet --recent-traces 300 --window-minutes 0.08

`--healthy` cuts fault-free traffic (`bmeg testbed record`) into consecutive windows, each
compared with the latest `--recent-traces` traces before it, and prints per gate the share of
windows in which it lets some service through (a false alarm of the gate: nothing changed).

simulates the faults `bmeg evaluate rca-sim --window-seconds 10` does (`simulated_faults`, a 20-s
normal period, seed 0) and counts the services on which the fixed bar and the default gate
decide differently: the gate is the only part of the ranker that changed, so where no decision
differs, `rca-sim`'s bmeg figures are the same under both (the GNN is not needed).

`--recent-traces N` compares each window with the latest N traces before its fault, as `bmeg
evaluate rca --recent-traces N` does (`recent_normal`); `--parameters D/faults.json` splits the
code faults by what they did (`return`/`exception`, from their `error` parameter) and the share
of requests they hit (`share`, 1 when absent): `return share=0.05`, ...

Gates: `fixed` (the bar before, a shift of 0.05), `FLOOR+FACTORxnoise`
(`bmeg.models.window.structure_changed`, noise from `NormalStats.structure_noise`), `no gate`
(the rank fusion alone), and `0.1+2xnoise|errors>E`: the default structure gate or the
errors' own gate with the floor E (`bmeg.models.window.errors_began`; the default's E is
`ERROR_FLOOR`; `0.1+2xnoise` alone is the rule before session 12); `counts<A` the test of counts
alone (`structure_significant` at alpha A, session 16) and `0.1+2xnoise|errors>0.02|counts<A`
session 12's gate or it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from bmeg.evaluation.faults import code_fault_kinds, fault_key, read_fault_list
from bmeg.models.normal import NormalStats
from bmeg.models.window import (ERROR_FLOOR, NOISE_FACTOR, STRUCTURE_FLOOR, decisive_shift, errors_began, rank_fusion,
                                structure_changed, structure_significant)
from bmeg.evaluation.rca import recent_normal
from bmeg.evaluation.windows import TraceFiles
from bmeg.graphs.rpc import rpc_view
from bmeg.traces.io import read_spans

LATENCY = {"network_delay", "cpu_consumed", "cpu_contention"}
FIXED_BAR = 0.05
GATES = [(0.05, 2.0), (0.1, 1.0), (0.1, 2.0), (0.1, 3.0), (0.2, 2.0), (np.inf, 0.0)]
#: Floors of the errors' own gate (`errors_began`, session 12) beside the 0.1 + 2 x noise gate.
ERROR_FLOORS = [0.0, 0.01, 0.02, 0.05]
#: Family-wise alphas of the test of counts (`structure_significant`, session 16).
ALPHAS = [1e-2, 1e-3, 1e-4, 1e-6]


def gate_name(floor: float | None, factor: float | None) -> str:
    if floor is None:
        return "fixed"
    return "no gate" if np.isinf(floor) else f"{floor:g}+{factor:g}xnoise"


def ranked_first(structure: pd.Series, fused: pd.Series, changed: pd.Series, decisive: str | None) -> list[str]:
    """The bmeg ranker's order: changed services by shift, then a decisive time shift, then the rest by fusion."""
    changed = changed.reindex(fused.index).fillna(False).astype(bool)
    first = structure.reindex(fused.index).fillna(0.0)[changed].sort_values(ascending=False, kind="stable")
    rest = list(fused[~changed].index)
    if decisive in rest:
        rest = [decisive, *(s for s in rest if s != decisive)]
    return [*first.index, *rest]


def simulated(topology: Path) -> None:
    """Gate decisions of the fixed bar and the default gate on simulated fault windows."""
    import tempfile

    from bmeg.evaluation.simulated import simulated_faults
    from bmeg.faultinject import load_topology

    with tempfile.TemporaryDirectory() as out:
        sim = simulated_faults(load_topology(topology), Path(out), normal_s=20.0, window_s=10.0, seed=0)
        stats = NormalStats.from_forest(rpc_view(sim.normal))
        files = TraceFiles(sim.traces)
        decisions = differ = gated_right = code = 0
        counted_differ = counted_right = counted_wrong = wrong = 0
        for fault in read_fault_list(sim.fault_list, 0):
            window = rpc_view(files.window(fault.start_ns, fault.start_ns + int(sim.window_minutes * 60e9)))
            shape = stats.structure_parts(window)
            structure = shape[["calls", "errors"]].sum(axis=1)
            new = structure_changed(structure, stats.structure_noise) | errors_began(shape, stats.error_noise)
            counted = new | structure_significant(stats.structure_tests(window)).reindex(new.index, fill_value=False)
            decisions += len(structure)
            differ += int(((structure >= FIXED_BAR) != new).sum())
            counted_differ += int((counted != new).sum())
            counted_wrong += int(counted.drop(fault.service, errors="ignore").sum())
            wrong += int(new.drop(fault.service, errors="ignore").sum())
            if fault.kind in ("return", "exception"):
                code += 1
                gated_right += int(bool(new.get(fault.service, False)))
                counted_right += int(bool(counted.get(fault.service, False)))
    noisy = stats.structure_noise[stats.structure_noise > 0]
    print(f"{topology.stem}: services with normal structure noise > 0: {len(noisy)}; "
          f"gate decisions that differ from the fixed bar: {differ} of {decisions}; "
          f"code faults whose service the gate lets through: {gated_right} of {code}, other services let through: {wrong}; "
          f"with the test of counts (session 16): {counted_differ} decisions differ, code faults let through "
          f"{counted_right} of {code}, services let through that are not the fault's: {counted_wrong}")


def healthy(path: Path, window_minutes: float, recent_traces: int) -> None:
    """Per gate, the share of fault-free windows in which it lets some service through."""
    spans = read_spans(path)
    files = TraceFiles(path)
    starts = spans["start_ns"].to_numpy()
    length = int(window_minutes * 60e9)
    fired: dict[str, list[bool]] = {}
    first = int(starts.min()) + int(5e9)  # the first 5 s: the fallback normal period, never a window
    fallback = NormalStats.from_forest(rpc_view(files.window(int(starts.min()), first)))
    for start in range(first, int(starts.max()) - length, length):
        stats = recent_normal(files, start, fallback, None, recent_traces)
        window = rpc_view(files.window(start, start + length))
        shape = stats.structure_parts(window)
        structure = shape[["calls", "errors"]].sum(axis=1)
        session12 = structure_changed(structure, stats.structure_noise) | errors_began(shape, stats.error_noise)
        tests = stats.structure_tests(window)
        fired.setdefault("0.1+2xnoise|errors>0.02", []).append(bool(session12.any()))
        for alpha in ALPHAS:
            counted = structure_significant(tests, alpha)
            fired.setdefault(f"counts<{alpha:g}", []).append(bool(counted.any()))
            if counted.any():
                print(f"  counts<{alpha:g} fired at {start}: {list(counted[counted].index)}")
    for gate, flags in fired.items():
        print(f"{gate}: fired in {sum(flags)} of {len(flags)} healthy windows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulated", type=Path, default=None, help="a topology: the simulated check instead")
    parser.add_argument("--healthy", type=Path, default=None, help="fault-free spans: the gates' false alarms instead")
    parser.add_argument("--traces", type=Path)
    parser.add_argument("--faults", type=Path)
    parser.add_argument("--normal", type=Path)
    parser.add_argument("--harness", type=Path, help="bmeg evaluate rca --json output")
    parser.add_argument("--window-minutes", type=float, default=0.1)
    parser.add_argument("--pod-suffix-parts", type=int, default=2)
    parser.add_argument("--recent-traces", type=int, default=None, help="as bmeg evaluate rca --recent-traces")
    parser.add_argument("--parameters", type=Path, default=None, help="the campaign's faults.json: code faults by mode and share")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.simulated:
        simulated(args.simulated)
        return
    if args.healthy:
        healthy(args.healthy, args.window_minutes, args.recent_traces or 300)
        return
    if not (args.traces and args.faults and args.normal and args.harness):
        parser.error("--traces, --faults, --normal and --harness are required (or --simulated TOPOLOGY)")

    fixed = NormalStats.from_forest(rpc_view(read_spans(args.normal)))
    kinds = code_fault_kinds(args.parameters) if args.parameters else {}
    harness = {(f["start_ns"], f["service"]): f for f in json.loads(args.harness.read_text())["faults"]}
    files = TraceFiles(args.traces)
    gates = [(None, None), *GATES]
    rows = []
    for fault in read_fault_list(args.faults, args.pod_suffix_parts):
        window = rpc_view(files.window(fault.start_ns, fault.start_ns + int(args.window_minutes * 60e9)))
        ran = harness.get((fault.start_ns, fault.service))
        if not window.num_traces or ran is None:
            continue
        stats = recent_normal(files, fault.start_ns, fixed, None, args.recent_traces)
        kind = kinds.get(fault_key(fault.start_ns, fault.service), fault.kind)
        gnn_top = ran["top"]["bmeg-gnn"]
        gnn = pd.Series(np.arange(len(gnn_top), 0, -1, dtype=float), index=gnn_top)
        parts = stats.service_shift_parts(window)
        fused = rank_fusion(parts.max(axis=1), gnn)
        shape = stats.structure_parts(window)
        structure = shape[["calls", "errors"]].sum(axis=1)
        chosen = structure_changed(structure, stats.structure_noise, STRUCTURE_FLOOR, NOISE_FACTOR)
        decisions = {gate_name(floor, factor): (structure >= FIXED_BAR if floor is None
                                                else structure_changed(structure, stats.structure_noise, floor, factor))
                     for floor, factor in gates}
        decisions.update({f"{gate_name(STRUCTURE_FLOOR, NOISE_FACTOR)}|errors>{floor:g}":
                          chosen | errors_began(shape, stats.error_noise, floor) for floor in ERROR_FLOORS})
        session12 = chosen | errors_began(shape, stats.error_noise, ERROR_FLOOR)
        tests = stats.structure_tests(window)
        for alpha in ALPHAS:
            counted = structure_significant(tests, alpha).reindex(structure.index, fill_value=False)
            decisions[f"counts<{alpha:g}"] = counted
            decisions[f"0.1+2xnoise|errors>{ERROR_FLOOR:g}|counts<{alpha:g}"] = session12 | counted
        for name, changed in decisions.items():
            order = ranked_first(structure, fused, changed, decisive_shift(parts[["caller", "callee"]].max(axis=1)))
            rank = order.index(fault.service) + 1 if fault.service in order else None
            rows.append({"gate": name, "type": kind, "start_ns": fault.start_ns,
                         "rank": rank, "harness_bmeg_rank": ran["rank"]["bmeg"]})
    frame = pd.DataFrame(rows)
    frame["ac1"] = frame["rank"] == 1
    frame["avg5"] = frame["rank"].apply(lambda r: sum(r is not None and r <= k for k in range(1, 6)) / 5)
    half = frame.groupby("gate")["start_ns"].transform(lambda s: s.rank(method="first") > len(s) / 2)
    frame["half"] = np.where(half, "second half", "first half")
    frame["group"] = np.where(frame["type"].isin(LATENCY), "latency", frame["type"])
    summary = {}
    for gate, of_gate in frame.groupby("gate", sort=False):
        groups = {"latency": of_gate[of_gate["group"] == "latency"],
                  **{kind: g for kind, g in of_gate.groupby("type")}, "all": of_gate}
        summary[gate] = {name: {"n": len(g), "ac1": round(float(g["ac1"].mean()), 2),
                                "avg5": round(float(g["avg5"].mean()), 2)} for name, g in groups.items()}
        summary[gate]["halves_latency_ac1"] = {
            h: round(float(g["ac1"].mean()), 2) for h, g in of_gate[of_gate["group"] == "latency"].groupby("half")}
        summary[gate]["halves_exception_ac1"] = {
            h: round(float(g["ac1"].mean()), 2) for h, g in of_gate[of_gate["type"] == "exception"].groupby("half")}
    fixed = frame[frame["gate"] == "fixed"]
    summary["fixed_reproduces_harness_ac1"] = float(((fixed["rank"] == 1) == (fixed["harness_bmeg_rank"] == 1)).mean())
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    for gate, groups in summary.items():
        if gate == "fixed_reproduces_harness_ac1":
            print(f"the fixed bar reproduces the harness's bmeg hit or miss at 1 in {groups:.0%} of the windows")
            continue
        cells = " | ".join(f"{name} {v['ac1']:.2f}/{v['avg5']:.2f}" for name, v in groups.items() if "n" in v)
        print(f"{gate:14s} {cells} | latency AC@1 by half {groups['halves_latency_ac1']} "
              f"| exception AC@1 by half {groups['halves_exception_ac1']}")


if __name__ == "__main__":
    main()
