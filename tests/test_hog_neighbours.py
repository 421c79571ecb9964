"""`bench/hog_neighbours.py`: which other service a hog's window slowed, and on which CPU."""

from __future__ import annotations

import pyarrow.parquet as pq

from builders import bench_module

from bmeg.faultinject import Fault, simulate
from bmeg.faultinject.spec import load_topology
from bmeg.faultinject.tables import spans_of


def test_a_callee_slowed_beside_the_hog_is_named_with_its_cpu(tmp_path):
    bench = bench_module("hog_neighbours")
    hog = Fault("text-service", "interference", "single", 25.0, 35.0, {"factor": 20, "slice_ms": 3})
    # the testbed's session 29 recordings: a callee on the hog's CPU slowed too (here by a fault of its own)
    beside = Fault("user-mention-service", "interference", "single", 25.0, 35.0, {"factor": 30})
    pq.write_table(spans_of(simulate(load_topology("socialnet"), [hog, beside], 36, 0)), tmp_path / "spans.parquet")
    listed = [{"source": "interference", "service": "text-service", "start_ns": 25e9, "end_ns": 35e9},
              {"source": "network", "service": "media-service", "start_ns": 5e9, "end_ns": 9e9}]
    table = bench.neighbour_shifts(bench.server_self_times(tmp_path), listed)
    assert len(table) == 1  # hogs only
    row = table.iloc[0]
    assert row["most_moved"] == "user-mention-service" and row["same_cpu"]  # both pinned to CPU 0
    assert row["shift"] > 3 and abs(row["other_cpu_median"]) < 1


def test_a_hog_whose_window_holds_no_traces_is_reported_not_a_crash(tmp_path):
    bench = bench_module("hog_neighbours")
    pq.write_table(spans_of(simulate(load_topology("socialnet"), [], 3, 0)), tmp_path / "spans.parquet")
    far = [{"source": "interference", "service": "text-service", "start_ns": 1e12, "end_ns": 1.1e12}]
    row = bench.neighbour_shifts(bench.server_self_times(tmp_path), far).iloc[0]
    assert row["most_moved"] is None and row["shift"] != row["shift"]  # NaN: nothing to compare
