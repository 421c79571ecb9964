"""The window ranker's "nothing changed" answer (`bmeg.models.window.HealthBound`) on healthy
and fault windows, in one run:

    python bench/window_health.py --traces D/spans.parquet --faults D/fault_list.json \
        --normal D/normal.parquet [--model RUN] [--window-minutes 0.1]   # the testbed dataset D
    python bench/window_health.py --simulated TOPOLOGY [--model RUN] [--window-seconds 10]

The bound is calibrated on the normal period's own latest half (`HealthBound.of`). Healthy
windows: on the testbed, the traces that start between two fault rounds (from `--margin-s`
after the last fault of a round ends to the next fault's start); simulated, fresh fault-free
episodes of the topology as long as its fault episodes. Fault windows: the root-cause
harness's (`bmeg evaluate rca`), one per injected fault. Prints the share of healthy windows
called healthy and the share of fault windows still ranked, per fault type; with `--model`,
bmeg's AC@1 on the fault windows (the ranking's order does not depend on the answer) and
counting a fault window called healthy as a miss. With `--compare`, the healthy and fault
windows' answers also under the gates of earlier sessions, on the same windows: without the
errors' own gate (`ERROR_MIN_SPANS` out of reach: before session 12) and with the structure
noise on slices of equal trace counts for every service (`min_visits=1`: before session 13).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import pyarrow as pa

import bmeg.models.normal as normal_module
import bmeg.models.window as window_module
from bmeg.evaluation.faults import read_fault_list
from bmeg.evaluation.windows import TraceFiles
from bmeg.graphs import SpanForest
from bmeg.graphs.rpc import rpc_view
from bmeg.models.detector import Detector
from bmeg.models.normal import NormalStats
from bmeg.models.window import HealthBound, WindowRanker
from bmeg.traces.io import read_spans


def healthy_gaps(fault_list: Path, margin_s: float, min_s: float) -> list[tuple[int, int]]:
    """[start, end) ns of the fault-free stretches between fault rounds of a fault list; none
    when the list gives no end times (published lists such as Nezha's give the injection only)."""
    entries = [entry for day in json.loads(fault_list.read_text()).values() for entry in day]
    if not all("end_timestamp" in entry for entry in entries):
        print("the fault list gives no end times: no healthy windows between faults")
        return []
    spans = sorted((int(float(e["inject_timestamp"]) * 1e9), int(float(e["end_timestamp"]) * 1e9)) for e in entries)
    gaps, reach = [], spans[0][1]
    for start, end in spans[1:]:
        if start - reach >= (margin_s + min_s) * 1e9:
            gaps.append((reach + int(margin_s * 1e9), start))
        reach = max(reach, end)
    return gaps


def testbed(args: argparse.Namespace) -> tuple[pa.Table, list[SpanForest], list[tuple[str, str, SpanForest]]]:
    files = TraceFiles(args.traces)
    healthy = [rpc_view(files.window(lo, hi)) for lo, hi in healthy_gaps(args.faults, args.margin_s, args.min_s)]
    length = int(args.window_minutes * 60e9)
    faults = [(f.service, f.kind, rpc_view(files.window(f.start_ns, f.start_ns + length)))
              for f in read_fault_list(args.faults, args.pod_suffix_parts)]
    return read_spans(args.normal), healthy, faults


def simulated(args: argparse.Namespace, out: Path) -> tuple[pa.Table, list[SpanForest], list[tuple[str, str, SpanForest]]]:
    from bmeg.evaluation.simulated import EPOCH_NS, simulated_faults
    from bmeg.faultinject import load_topology
    from bmeg.faultinject.twin import simulated_spans

    spec = load_topology(args.simulated)
    sim = simulated_faults(spec, out, normal_s=20.0, window_s=args.window_seconds, seed=0)
    files = TraceFiles(sim.traces)
    length = int(args.window_seconds * 1e9)
    faults = [(f.service, f.kind, rpc_view(files.window(f.start_ns, f.start_ns + length)))
              for f in read_fault_list(sim.fault_list, 0)]
    healthy = [rpc_view(simulated_spans(spec, args.window_seconds, seed=50_000 + i, epoch_ns=EPOCH_NS))
               for i in range(args.healthy_windows)]
    return sim.normal, healthy, faults


#: Earlier sessions' gates (`--compare`): name, `ERROR_MIN_SPANS`, `structure_noise`'s `min_visits`.
ERROR_MIN_SPANS = window_module.ERROR_MIN_SPANS
EARLIER_GATES = [("before session 12 (no errors' gate, noise on trace slices)", 2**62, 1),
                 ("session 12 (errors' gate, noise on trace slices)", ERROR_MIN_SPANS, 1)]


def answers(normal: pa.Table, healthy: list[SpanForest], faults: list[tuple[str, str, SpanForest]]) -> str:
    """Healthy windows called healthy and fault windows still ranked, per fault type, under the
    gates the modules hold now."""
    forest = rpc_view(normal)
    stats, bound = NormalStats.from_forest(forest), HealthBound.of(forest)
    if bound is None:
        return "no health bound"
    calm = sum(bound.check(stats, w).healthy for w in healthy if w.num_traces)
    ranked: dict[str, list[bool]] = defaultdict(list)
    for _, kind, window in faults:
        if window.num_traces:
            ranked[kind].append(not bound.check(stats, window).healthy)
    return (f"healthy windows called healthy {calm}/{sum(1 for w in healthy if w.num_traces)}; still ranked: "
            + ", ".join(f"{kind} {sum(r) / len(r):.2f}" for kind, r in sorted(ranked.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--traces", type=Path)
    parser.add_argument("--faults", type=Path)
    parser.add_argument("--normal", type=Path)
    parser.add_argument("--window-minutes", type=float, default=0.1)
    parser.add_argument("--pod-suffix-parts", type=int, default=2)
    parser.add_argument("--margin-s", type=float, default=1.0, help="testbed: healthy windows start this long after a round")
    parser.add_argument("--min-s", type=float, default=2.0, help="testbed: shortest healthy window")
    parser.add_argument("--simulated", type=Path, help="a topology (a twin): simulated faults instead")
    parser.add_argument("--window-seconds", type=float, default=10.0)
    parser.add_argument("--healthy-windows", type=int, default=40, help="simulated: fault-free episodes")
    parser.add_argument("--splits", type=int, default=window_module.CALIBRATION_SPLITS,
                        help="held-back windows at most this share of the held-back part (compare choices)")
    parser.add_argument("--compare", action="store_true", help="also the answers under earlier sessions' gates")
    args = parser.parse_args()
    window_module.CALIBRATION_SPLITS = args.splits
    with tempfile.TemporaryDirectory() as out:
        normal, healthy, faults = simulated(args, Path(out)) if args.simulated else testbed(args)
    if args.compare:
        for name, error_min_spans, min_visits in EARLIER_GATES:
            window_module.ERROR_MIN_SPANS, defaults = error_min_spans, normal_module.structure_noise.__defaults__
            normal_module.structure_noise.__defaults__ = (*defaults[:-1], min_visits)
            print(f"-- {name}: {answers(normal, healthy, faults)}")
            window_module.ERROR_MIN_SPANS, normal_module.structure_noise.__defaults__ = ERROR_MIN_SPANS, defaults
    normal_forest = rpc_view(normal)
    stats = NormalStats.from_forest(normal_forest)
    bound = HealthBound.of(normal_forest)
    if bound is None:
        raise SystemExit(f"the normal period ({normal_forest.num_traces} traces) is too short for a health bound: "
                         f"its held-back part needs {window_module.CALIBRATION_SPLITS} windows of "
                         f"{window_module.MIN_CALIBRATION_TRACES} traces; the ranker gives no health answer there")
    healthy = [w for w in healthy if w.num_traces]
    calm = [bound.check(stats, w) for w in healthy]
    if calm:
        print(f"healthy windows called healthy: {sum(h.healthy for h in calm)}/{len(calm)} "
              f"(traces per window: median {sorted(w.num_traces for w in healthy)[len(healthy) // 2]}; over the bound: "
              f"time {sum(h.time_shift > h.time_bound for h in calm)}, gap {sum(h.gap_lead > h.gap_bound for h in calm)}, "
              f"structure {sum(h.structure_excess > h.structure_bound for h in calm)}; held-back windows of "
              f"{sorted({h.calibration_traces for h in calm})} traces)")
    ranker = None if args.model is None else WindowRanker(Detector.load(args.model, device="cpu"), normal)
    groups: dict[str, list[tuple[bool, bool | None]]] = defaultdict(list)
    for service, kind, window in faults:
        if not window.num_traces:
            continue
        ranked = bound.check(stats, window).healthy is False
        first = None if ranker is None else ranker.rank(window)[0][0] == service
        groups[kind].append((ranked, first))
        groups["all"].append((ranked, first))
    print("fault type | windows | still ranked | AC@1 | AC@1, called healthy = miss")
    for kind, rows in sorted(groups.items()):
        line = f"{kind} | {len(rows)} | {sum(r for r, _ in rows) / len(rows):.2f}"
        if ranker is not None:
            line += (f" | {sum(bool(f) for _, f in rows) / len(rows):.2f}"
                     f" | {sum(bool(f and r) for r, f in rows) / len(rows):.2f}")
        print(line)


if __name__ == "__main__":
    main()
