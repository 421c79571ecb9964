"""Where a labelled dataset's CPU faults land, and how far they stretch the target's store calls:

    python bench/cpu_fault_targets.py RUN/data/single-scheduler RUN/data/multiple-scheduler D

Each argument is a dataset folder (`spans.parquet` and `traces.parquet` with the fault labels:
a bootstrap's training shard, or a testbed recording). Per CPU fault source (interference,
saturation) it counts the anomalous traces whose faulty service is a store, a service that calls
stores, or another service; and, for the faulty services that call stores, the p50 of their store
calls in those traces over the p50 in the fault-free ones (median and range over the services).
The testbed hogs services only, and on it a starved service's time lands in its store calls
(README, issue 12, sessions 25 and 33); this says how often the twin shows the GNN that case.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

CPU_SOURCES = ("interference", "saturation")


def targets(folder: Path) -> tuple[Counter, dict[str, list[float]]]:
    """(anomalous traces per (source, kind of target), store-call p50 ratios per source)."""
    spans = pd.read_parquet(folder / "spans.parquet", columns=["trace_id", "service", "peer_service", "db_system",
                                                                "duration_ns"])
    traces = pd.read_parquet(folder / "traces.parquet", columns=["trace_id", "anomalous", "fault_kind",
                                                                  "fault_source", "fault_services"])
    store_calls = spans[spans["db_system"].fillna("").ne("")]
    stores, callers = set(store_calls["peer_service"].dropna()), set(store_calls["service"])
    normal = set(traces.loc[traces["fault_kind"] == "none", "trace_id"])
    counts: Counter = Counter()
    hit: dict[tuple[str, str], set[str]] = {}
    for trace, source, services in traces.loc[traces["anomalous"], ["trace_id", "fault_source", "fault_services"]].itertuples(index=False):
        for cpu in set(source.split("+")) & set(CPU_SOURCES):
            for service in services:
                kind = "store" if service in stores else "calls stores" if service in callers else "other"
                counts[(cpu, kind)] += 1
                if kind == "calls stores":
                    hit.setdefault((cpu, service), set()).add(trace)
    ratios: dict[str, list[float]] = {}
    for (cpu, service), faulty in hit.items():
        calls = store_calls[store_calls["service"] == service]
        base = calls.loc[calls["trace_id"].isin(normal), "duration_ns"].median()
        slow = calls.loc[calls["trace_id"].isin(faulty), "duration_ns"].median()
        if base > 0 and not np.isnan(slow):
            ratios.setdefault(cpu, []).append(float(slow / base))
    return counts, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+", help="dataset folders (spans.parquet, traces.parquet)")
    for folder in parser.parse_args().folders:
        counts, ratios = targets(folder)
        print(folder)
        for cpu in CPU_SOURCES:
            kinds = ", ".join(f"{kind} {counts[(cpu, kind)]}" for kind in ("store", "calls stores", "other"))
            stretch = ratios.get(cpu)
            line = "" if not stretch else (f"; store calls p50 x{np.median(stretch):.1f} "
                                           f"(x{min(stretch):.1f}-x{max(stretch):.1f}, {len(stretch)} services)")
            print(f"  {cpu}: anomalous traces by target: {kinds}{line}")


if __name__ == "__main__":
    main()
