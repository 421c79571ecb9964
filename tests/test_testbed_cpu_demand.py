"""`bench/testbed_cpu_demand.py`: CPU per request and its ratio to self time, from a span table
(the testbed's part, `bmeg testbed status` and `record`, runs only on a running testbed)."""

from __future__ import annotations


import pandas as pd
import pyarrow.parquet as pq
import pytest

from builders import bench_module, chain_topology

from bmeg.faultinject.twin import simulated_spans


@pytest.fixture(scope="module")
def bench():
    return bench_module("testbed_cpu_demand")


def test_cpu_per_request_is_the_cgroups_rate_over_the_requests(bench, tmp_path):
    spans = simulated_spans(chain_topology(rate=100), seconds=4, seed=0)
    pq.write_table(spans, tmp_path / "spans.parquet")
    cores = {service: 0.05 for service in set(spans["service"].to_pylist())}
    table = bench.per_service(tmp_path / "spans.parquet", 4.0, cores)
    assert set(table.index) <= set(cores) and len(table) >= 2
    for service, row in table.iterrows():
        assert row["cpu_ms"] == pytest.approx(0.05 * 1e3 / row["requests_s"])
        assert row["cpu_over_self"] == pytest.approx(row["cpu_ms"] / row["self_ms"])
        assert 0 < row["self_ms"] <= row["span_ms"]
    assert table["calls"].max() >= 1  # the chain's services call the next one


def test_a_service_without_a_cpu_figure_is_left_out(bench, tmp_path):
    spans = simulated_spans(chain_topology(rate=100), seconds=2, seed=1)
    pq.write_table(spans, tmp_path / "spans.parquet")
    some = sorted(set(spans["service"].to_pylist()))[:1]
    assert list(bench.per_service(tmp_path / "spans.parquet", 2.0, {s: 0.01 for s in some}).index) == some


def test_the_fit_recovers_a_per_call_and_a_self_time_cost(bench):
    table = pd.DataFrame({"calls": [0.0, 1.0, 2.0, 7.0, 1.0], "self_ms": [0.2, 0.1, 0.3, 0.2, 0.5]})
    table["cpu_ms"] = 0.15 + 0.2 * table["calls"] + 0.35 * table["self_ms"]
    assert bench.cpu_fit(table) == pytest.approx([0.15, 0.2, 0.35])
