"""Whether a testbed recording's CPU hogs slowed other services too:

    python bench/hog_neighbours.py ~/.cache/bmeg/testbed-dataset-single-s29b [...] [--faults]

The testbed pins its services to the two CPUs alternately and a hog to its target's CPU
(`bmeg.faultinject.testbed.deployment.service_cpu`), in the target's cgroup, where it should
starve the target alone. On session 29's two recordings a hog on a service that calls others
also raised the self time of a callee pinned to the same CPU 40-4000x, as a fault of the callee's
own would, and the GNN alone named that callee; on the later recordings no hog did
(docs/issue-12.md, session 36). For each interference fault of each recording (a folder with
`spans.parquet` and `faults.json`): the log2 shift of every other service's median server-span
self time, in the traces that began during the fault against those of the 20 s before it; the
service that moved most, by how much, and whether it shares the target's CPU. A recording with
many hogs whose top shift exceeds `--above` (log2) has CPU faults that are not single faults.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from bmeg.faultinject.testbed.deployment import SERVICES, service_cpu
from bmeg.graphs import assemble
from bmeg.graphs.rpc import span_roles

BEFORE_S = 20.0
#: the first second of a fault is left out (a hog starts; requests in flight began before it)
SETTLE_S = 1.0


def server_self_times(folder: Path) -> pd.DataFrame:
    """Every server span of the recording: its service, its trace's start and its self time."""
    forest = assemble(pq.read_table(folder / "spans.parquet"), on_bad_trace="drop")
    is_server, _ = span_roles(forest)
    spans = pd.DataFrame({"trace_id": forest.spans["trace_id"].to_numpy(zero_copy_only=False),
                          "service": forest.spans["service"].to_numpy(zero_copy_only=False),
                          "start_ns": forest.spans["start_ns"].to_numpy(), "self_ns": forest.self_time_ns})
    spans["trace_start_ns"] = spans.groupby("trace_id")["start_ns"].transform("min")
    return spans[is_server & spans["service"].isin(SERVICES).to_numpy()]


def neighbour_shifts(spans: pd.DataFrame, faults: list[dict]) -> pd.DataFrame:
    """Per interference fault: the other service whose self time moved most (log2 shift of the
    median), whether it shares the target's CPU, and the median shift of the rest on each CPU."""
    rows = []
    for fault in faults:
        if fault["source"] != "interference":
            continue
        start, end, target = fault["start_ns"], fault["end_ns"], fault["service"]
        during = spans[spans["trace_start_ns"].between(start + SETTLE_S * 1e9, end)]
        before = spans[spans["trace_start_ns"].between(start - BEFORE_S * 1e9, start)]
        shift = np.log2(during.groupby("service")["self_ns"].median() / before.groupby("service")["self_ns"].median())
        shift = shift.drop(target, errors="ignore").dropna()
        if shift.empty:  # no traces in the window or before it: nothing to compare
            rows.append({"target": target, "most_moved": None, "shift": np.nan, "same_cpu": False,
                         "same_cpu_median": np.nan, "other_cpu_median": np.nan})
            continue
        same = np.array([service_cpu(s) == service_cpu(target) for s in shift.index])
        rows.append({"target": target, "most_moved": shift.idxmax(), "shift": float(shift.max()),
                     "same_cpu": bool(same[np.argmax(shift.to_numpy())]),
                     "same_cpu_median": float(shift[same].median()), "other_cpu_median": float(shift[~same].median())})
    return pd.DataFrame(rows, columns=["target", "most_moved", "shift", "same_cpu", "same_cpu_median", "other_cpu_median"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recordings", nargs="+", type=Path)
    parser.add_argument("--above", type=float, default=3.0, help="a shift (log2) that reads as a fault's own")
    parser.add_argument("--faults", action="store_true", help="print every fault's row too")
    args = parser.parse_args()
    for folder in args.recordings:
        try:
            faults = json.loads((folder / "faults.json").read_text())
            spans = server_self_times(folder)
        except (OSError, ValueError) as error:  # a folder that is not a recording, a broken file
            parser.error(f"{folder} is not a readable testbed recording (spans.parquet, faults.json): {error}")
        table = neighbour_shifts(spans, faults)
        moved = table[table["shift"] > args.above]
        print(f"{folder.name}: {len(table)} hogs; another service's self time moved > x{2 ** args.above:g} under "
              f"{len(moved)} ({int(moved['same_cpu'].sum())} on the target's CPU); the rest's median shift: "
              f"same CPU {table['same_cpu_median'].median():+.2f}, other CPU {table['other_cpu_median'].median():+.2f}")
        if args.faults:
            print(table.round(2).to_string(index=False))


if __name__ == "__main__":
    main()
