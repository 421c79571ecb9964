"""Does each testbed fault slow the service it is injected into? Two ways of looking:

    nice -n 10 python bench/testbed_fault_strength.py dataset DIR
    nice -n 10 python bench/testbed_fault_strength.py live '[["post-storage-service", "saturation", {"capacity": 0.6}], ...]'
    nice -n 10 python bench/testbed_fault_strength.py simulated DIR/normal.parquet \
        --fault saturation:capacity=0.2 --fault saturation:quota=0.6 --fault interference:factor=20

`dataset DIR`: a labelled testbed dataset (`bmeg generate socialnet --backend testbed`); per
fault, the injected service's own server spans while the fault was applied against the same
service's spans in the campaign's fault-free calibration period; per source, the median over
its faults of the ratio of the local time's p50 and p95 (local time as the labels define it:
exclusive time plus the calling client span's), the share of faults whose p95 at least doubled,
and the share of error spans.

`live PLAN`: starts its own testbed (`--port-base`, `--rate`), prints each service's CPU use,
then for each (service, source, parameters) of PLAN runs 6 s without a fault, the fault for
`--fault-s`, and 2 s more; compares the target's spans during the fault with the 6 s just
before it (the shared machine's load moves between minutes, so the baseline is adjacent) and
the end-to-end p95 of the root spans; stops the testbed.

`simulated SPEC`: the same statistics for the simulator's faults. SPEC is a topology spec
(a file or a shipped name) or fault-free traces (`.parquet`), whose twin is fitted as
`bmeg bootstrap` fits it; after `--normal-s` without a fault, every service that serves
requests gets each `--fault` (`source:name=value,...`) in turn for `--fault-s`, `--gap-s`
apart; each fault's target is compared with its own spans in the fault-free start, as `dataset`
compares a testbed fault with the calibration period.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bmeg.faultinject.testbed import system
from bmeg.faultinject.testbed.collector import read_collector_spans
from bmeg.faultinject.testbed.deployment import SERVICES
from bmeg.faultinject.testbed.faults import apply_fault, undo_fault
from bmeg.faultinject.testbed.labels import NodeFrame, node_frame
from bmeg.faultinject.testbed.supervisor import Testbed, down, up


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else float("nan")


def _served(frame: NodeFrame, service: str) -> np.ndarray:
    kind = frame.forest.spans["kind"].to_numpy(zero_copy_only=False)
    return frame.is_node & (frame.node_service == service) & (kind == "server")


def compare(frame: NodeFrame, service: str, during: np.ndarray, before: np.ndarray) -> dict[str, float]:
    """The target's server spans in `during` against those in `before` (masks over spans)."""
    mine = _served(frame, service)
    now, then = mine & during, mine & before
    return {"spans": int(now.sum()),
            "local_p50_ratio": _quantile(frame.local_ns[now], 0.5) / _quantile(frame.local_ns[then], 0.5),
            "local_p95_ratio": _quantile(frame.local_ns[now], 0.95) / _quantile(frame.local_ns[then], 0.95),
            "error_share": float(frame.error[now].mean()) if now.any() else float("nan")}


def dataset(directory: Path) -> dict[str, dict[str, float]]:
    spans = pq.read_table(directory / "spans.parquet")
    boundary = int(np.min(spans["start_ns"].to_numpy()))  # the campaign's traces start after calibration
    frame = node_frame(pa.concat_tables([pq.read_table(directory / "normal.parquet"), spans]))
    faults = json.loads((directory / "faults.json").read_text())
    return summarise(frame, [(f["source"], f["service"], f["start_ns"], f["end_ns"]) for f in faults],
                     frame.start_ns < boundary)


def simulated(spec_or_traces: str, faults: list[tuple[str, dict[str, float]]], normal_s: float, fault_s: float,
              gap_s: float, seed: int) -> dict[str, dict[str, float]]:
    from bmeg.faultinject import load_topology
    from bmeg.faultinject.scenario import Fault
    from bmeg.faultinject.simulator import simulate
    from bmeg.faultinject.tables import spans_of
    from bmeg.faultinject.twin import fit_twin
    from bmeg.traces.io import read_spans

    spec = fit_twin(read_spans(spec_or_traces)) if spec_or_traces.endswith(".parquet") else load_topology(spec_or_traces)
    served = [name for name, service in spec.services.items() if service.storage is None]
    plan, start = [], normal_s
    for service in served:
        for source, parameters in faults:
            plan.append(Fault(service, source, "single", start, start + fault_s, parameters))
            start += fault_s + gap_s
    frame = node_frame(spans_of(simulate(spec, plan, start, seed)))
    label = {id(f): f"{f.source}:" + ",".join(f"{k}={v:g}" for k, v in f.parameters.items()) for f in plan}
    return summarise(frame, [(label[id(f)], f.service, int(f.start_s * 1e9), int(f.end_s * 1e9)) for f in plan],
                     frame.start_ns < normal_s * 1e9)


def summarise(frame: NodeFrame, faults: list[tuple[str, str, int, int]], baseline: np.ndarray) -> dict[str, dict[str, float]]:
    """Per group of faults `(group, service, start_ns, end_ns)`: medians over its faults of the
    target's ratios against its own spans in `baseline` (faults with under 5 spans left out), and
    where the target's p95 ratio ranks among every service's in the same window (1: the largest)."""
    per_source: dict[str, list[dict[str, float]]] = {}
    services = sorted(set(frame.node_service[frame.is_node & (frame.forest.spans["kind"].to_numpy(zero_copy_only=False) == "server")]))
    for group, service, start_ns, end_ns in faults:
        during = (frame.start_ns >= start_ns) & (frame.start_ns < end_ns)
        row = compare(frame, service, during, baseline)
        if row["spans"] >= 5:
            others = [compare(frame, other, during, baseline) for other in services]
            ratios = [r["local_p95_ratio"] for r in others if r["spans"] >= 5]
            row["target_rank"] = 1 + sum(r > row["local_p95_ratio"] for r in ratios)
            per_source.setdefault(group, []).append(row)
    return {source: {"faults": len(rows),
                     "local_p50_ratio": round(float(np.median([r["local_p50_ratio"] for r in rows])), 2),
                     "local_p95_ratio": round(float(np.median([r["local_p95_ratio"] for r in rows])), 2),
                     "p95_doubled_share": round(float(np.mean([r["local_p95_ratio"] >= 2 for r in rows])), 2),
                     "target_p95_ratio_first": round(float(np.mean([r["target_rank"] == 1 for r in rows])), 2),
                     "target_p95_ratio_rank": float(np.median([r["target_rank"] for r in rows])),
                     "error_share": round(float(np.mean([r["error_share"] for r in rows])), 2)}
            for source, rows in sorted(per_source.items())}


def live(plan: list, rate: float, port_base: int, fault_s: float, before_s: float = 6.0) -> dict:
    run = Path(tempfile.mkdtemp(prefix="bmeg-fault-strength-"))
    bed = Testbed(port_base, run)
    try:
        state = up(bed, rate=rate)
        time.sleep(10)
        used = {s: system.cpu_usage_s(Path(str(state.processes[s].cgroup))) for s in SERVICES}
        time.sleep(8)
        cores = {s: round((system.cpu_usage_s(Path(str(state.processes[s].cgroup))) - used[s]) / 8, 4) for s in SERVICES}
        windows = []
        for index, (service, source, parameters) in enumerate(plan):
            before = time.time_ns()
            time.sleep(before_s)
            start = time.time_ns()
            apply_fault(bed, state, f"strength-{index}", service, source, parameters, time.time() + fault_s)
            time.sleep(fault_s)
            end = undo_fault(bed, state, f"strength-{index}") or time.time_ns()
            windows.append((service, source, parameters, before, start, end))
            time.sleep(2)
        time.sleep(7)  # the SDK's batches (5 s) and the Collector's file
        spans = read_collector_spans(Path(state.spans_file))
    finally:
        down(bed)
        shutil.rmtree(run, ignore_errors=True)
    frame = node_frame(spans)
    root = frame.forest.parent < 0
    rows = []
    for service, source, parameters, before, start, end in windows:
        then = (frame.start_ns >= before) & (frame.start_ns < start)
        now = (frame.start_ns >= start) & (frame.start_ns < end)
        row = {"service": service, "source": source, "parameters": parameters, **compare(frame, service, now, then),
               "e2e_p95_before_ms": _quantile(frame.inclusive_ns[root & then], 0.95) / 1e6,
               "e2e_p95_during_ms": _quantile(frame.inclusive_ns[root & now], 0.95) / 1e6}
        rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    return {"rate": rate, "cpu_cores_used": cores, "faults": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    one = sub.add_parser("dataset")
    one.add_argument("directory", type=Path)
    two = sub.add_parser("live")
    two.add_argument("plan", help='JSON: [[service, source, {parameters}], ...]')
    two.add_argument("--rate", type=float, default=100.0)
    two.add_argument("--port-base", type=int, default=21000)
    two.add_argument("--fault-s", type=float, default=8.0)
    three = sub.add_parser("simulated")
    three.add_argument("spec", help="a topology spec (file or shipped name), or fault-free traces (.parquet) to fit a twin")
    three.add_argument("--fault", action="append", required=True, help="source:name=value,... (repeat)")
    three.add_argument("--normal-s", type=float, default=30.0)
    three.add_argument("--fault-s", type=float, default=6.0)
    three.add_argument("--gap-s", type=float, default=2.0)
    three.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.mode == "dataset":
        print(json.dumps(dataset(args.directory), indent=1))
        return
    if args.mode == "simulated":
        try:
            faults = [_fault_argument(given) for given in args.fault]
        except ValueError as error:
            parser.error(str(error))
        print(json.dumps(simulated(args.spec, faults, args.normal_s, args.fault_s, args.gap_s, args.seed), indent=1))
        return
    try:
        plan = json.loads(args.plan)
    except json.JSONDecodeError as error:
        parser.error(f"PLAN is not JSON: {error}")
    if not isinstance(plan, list) or not all(isinstance(p, list) and len(p) == 3 for p in plan):
        parser.error("PLAN must be a JSON list of [service, source, {parameters}]")
    print(json.dumps(live(plan, args.rate, args.port_base, args.fault_s), indent=1))


def _fault_argument(given: str) -> tuple[str, dict[str, float]]:
    source, _, rest = given.partition(":")
    try:
        parameters = {name: float(value) for name, _, value in (item.partition("=") for item in rest.split(",") if item)}
    except ValueError:
        raise ValueError(f"--fault {given!r}: parameters are name=number, comma-separated") from None
    if not source or not parameters:
        raise ValueError(f"--fault {given!r}: give source:name=value,...")
    return source, parameters


if __name__ == "__main__":
    main()
