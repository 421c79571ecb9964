"""How much CPU the testbed's services use per request, against the self time their spans show:

    bmeg testbed up --rate 100 && python bench/testbed_cpu_demand.py --seconds 60; bmeg testbed down

Over a recording of fault-free traffic (`bmeg testbed record`'s), per code service: requests/s,
calls per request, the mean server span and its self time, the CPU per request (the user +
system time of its cgroup's processes, `bmeg testbed status`'s `cpu_used_s`, read before and
after and taken as a rate) and the ratio of that CPU to the self time. A twin charges a service
only its spans' self time; under a CPU hog or quota what counts is the CPU its process needs,
serialisation, the runtime and the exporter included (docs/issue-12.md, session 36).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from bmeg.faultinject.testbed.campaign import record_healthy
from bmeg.faultinject.testbed.supervisor import Testbed, status
from bmeg.graphs.rpc import rpc_view, span_roles


def cpu_seconds() -> tuple[float, dict[str, float]]:
    """(time.monotonic(), CPU seconds used so far per testbed process with a cgroup)."""
    report = status(Testbed.default())
    if "processes" not in report:
        raise SystemExit("the testbed is not running: `bmeg testbed up --rate 100` first")
    return time.monotonic(), {p["name"]: p["cpu_used_s"] for p in report["processes"] if "cpu_used_s" in p}


def per_service(spans_file: Path, seconds: float, cores: dict[str, float]) -> pd.DataFrame:
    """Requests, calls and self time per service from the spans; CPU from `cores` (CPU s per s)."""
    forest = rpc_view(pq.read_table(spans_file))
    is_server, is_client = span_roles(forest)
    spans = pd.DataFrame({"service": forest.spans["service"].to_numpy(zero_copy_only=False),
                          "duration_ms": forest.spans["duration_ns"].to_numpy() / 1e6,
                          "self_ms": forest.self_time_ns / 1e6, "server": is_server, "client": is_client})
    servers = spans[spans["server"]].groupby("service")
    requests = servers.size()
    table = pd.DataFrame({"requests_s": requests / seconds, "span_ms": servers["duration_ms"].mean(),
                          "self_ms": servers["self_ms"].mean()})
    table["calls"] = spans[spans["client"]].groupby("service").size().reindex(table.index, fill_value=0) / requests
    table["cpu_ms"] = pd.Series(cores).reindex(table.index) * 1e3 / table["requests_s"]
    table["cpu_over_self"] = table["cpu_ms"] / table["self_ms"]
    return table.dropna(subset=["cpu_ms"])


def cpu_fit(table: pd.DataFrame) -> np.ndarray:
    """(a, b, c) of CPU ms a request ~ a + b x calls a request + c x self time ms, over the services."""
    design = np.c_[np.ones(len(table)), table["calls"], table["self_ms"]]
    return np.linalg.lstsq(design, table["cpu_ms"], rcond=None)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to record")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        before_t, before = cpu_seconds()
        card = record_healthy(Path(scratch) / "spans.parquet", args.seconds)
        after_t, after = cpu_seconds()
        cores = {name: (after[name] - before[name]) / (after_t - before_t) for name in before.keys() & after.keys()}
        table = per_service(Path(card["out"]), card["seconds"], cores)
    pd.set_option("display.width", 200)
    print(f"{card['seconds']} s at {card['rate']:g} req/s, {card['traces']} traces, load {card['load_average_1_5_15']}")
    print(table.round(3).sort_values("requests_s", ascending=False).to_string())
    overall = np.sum(table["cpu_ms"] * table["requests_s"]) / np.sum(table["self_ms"] * table["requests_s"])
    print(f"all code services: CPU / self time {overall:.2f}; CPU per request ~ a + b calls + c self time "
          f"(least squares, ms): {np.round(cpu_fit(table), 3).tolist()}")


if __name__ == "__main__":
    main()
