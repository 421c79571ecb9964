"""Where a labelled dataset's CPU faults land, and how far they stretch the target's calls:

    python bench/cpu_fault_targets.py RUN/data/single-scheduler RUN/data/multiple-scheduler D

Each argument is a dataset folder (`spans.parquet` and `traces.parquet` with the fault labels:
a bootstrap's training shard, or a testbed recording). Per CPU fault source (interference,
saturation) it counts the anomalous traces whose faulty service is a store, a service that calls
stores, or another service; and, over the faulty services, the p50 of their store calls and of
their call gaps to services (a client span less its callee's server span) in those traces over
the p50 in the fault-free ones (median and range over the services). The testbed hogs services
only, and on it a starved service's time lands in its client spans, to its stores (docs/issue-12.md,
sessions 25 and 33) and to services alike (session 35); this says how far the twin shows the GNN
that case.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

CPU_SOURCES = ("interference", "saturation")


def call_gaps(spans: pd.DataFrame) -> pd.DataFrame:
    """Each client span to a service, with its gap: its duration less its callee's server span's."""
    callee = spans.loc[spans["kind"] == "server", ["parent_id", "duration_ns"]]
    calls = spans[spans["kind"] == "client"].merge(callee, left_on="span_id", right_on="parent_id", suffixes=("", "_callee"))
    return calls.assign(duration_ns=calls["duration_ns"] - calls["duration_ns_callee"])


def stretch(calls: pd.DataFrame, hit: dict[tuple[str, str], set[str]], normal: set[str]) -> dict[str, list[float]]:
    """Per CPU source, over the faulty services that make such calls: p50 in their faulty traces
    over p50 in the fault-free ones."""
    ratios: dict[str, list[float]] = {}
    for (cpu, service), faulty in hit.items():
        own = calls[calls["service"] == service]
        base = own.loc[own["trace_id"].isin(normal), "duration_ns"].median()
        slow = own.loc[own["trace_id"].isin(faulty), "duration_ns"].median()
        if base > 0 and not np.isnan(slow):
            ratios.setdefault(cpu, []).append(float(slow / base))
    return ratios


def targets(folder: Path) -> tuple[Counter, dict[str, dict[str, list[float]]]]:
    """(anomalous traces per (source, kind of target), per kind of call the p50 ratios per source)."""
    spans = pd.read_parquet(folder / "spans.parquet", columns=["trace_id", "span_id", "parent_id", "service", "kind",
                                                                "peer_service", "db_system", "duration_ns"])
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
                if kind != "store":
                    hit.setdefault((cpu, service), set()).add(trace)
    return counts, {"store calls": stretch(store_calls, hit, normal), "call gaps to services": stretch(call_gaps(spans), hit, normal)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+", help="dataset folders (spans.parquet, traces.parquet)")
    for folder in parser.parse_args().folders:
        counts, stretches = targets(folder)
        print(folder)
        for cpu in CPU_SOURCES:
            kinds = ", ".join(f"{kind} {counts[(cpu, kind)]}" for kind in ("store", "calls stores", "other"))
            line = "".join(f"; {calls} p50 x{np.median(ratios[cpu]):.1f} (x{min(ratios[cpu]):.1f}-x{max(ratios[cpu]):.1f}, "
                           f"{len(ratios[cpu])} services)" for calls, ratios in stretches.items() if ratios.get(cpu))
            print(f"  {cpu}: anomalous traces by target: {kinds}{line}")


if __name__ == "__main__":
    main()
