"""Does each testbed fault slow the service it is injected into? Two ways of looking:

    nice -n 10 python bench/testbed_fault_strength.py dataset DIR
    nice -n 10 python bench/testbed_fault_strength.py live '[["post-storage-service", "saturation", {"capacity": 0.6}], ...]'

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
    calibration = frame.start_ns < boundary
    per_source: dict[str, list[dict[str, float]]] = {}
    for fault in json.loads((directory / "faults.json").read_text()):
        during = (frame.start_ns >= fault["start_ns"]) & (frame.start_ns < fault["end_ns"])
        row = compare(frame, fault["service"], during, calibration)
        if row["spans"] >= 5:
            per_source.setdefault(fault["source"], []).append(row)
    return {source: {"faults": len(rows),
                     "local_p50_ratio": round(float(np.median([r["local_p50_ratio"] for r in rows])), 2),
                     "local_p95_ratio": round(float(np.median([r["local_p95_ratio"] for r in rows])), 2),
                     "p95_doubled_share": round(float(np.mean([r["local_p95_ratio"] >= 2 for r in rows])), 2),
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
    args = parser.parse_args()
    if args.mode == "dataset":
        print(json.dumps(dataset(args.directory), indent=1))
        return
    try:
        plan = json.loads(args.plan)
    except json.JSONDecodeError as error:
        parser.error(f"PLAN is not JSON: {error}")
    if not isinstance(plan, list) or not all(isinstance(p, list) and len(p) == 3 for p in plan):
        parser.error("PLAN must be a JSON list of [service, source, {parameters}]")
    print(json.dumps(live(plan, args.rate, args.port_base, args.fault_s), indent=1))


if __name__ == "__main__":
    main()
