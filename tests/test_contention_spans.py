"""`bench/contention_spans.py`: where a CPU hog's time lands in the hogged service's spans."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from bmeg.datasets.generate import generate_dataset

HOG = """name: hog
kind: single
duration_s: 30
warmup_s: 1
faults:
  - {service: user-timeline-service, source: interference, start_s: 10, duration_s: 10,
     parameters: {factor: 20, slice_ms: 12}}
"""


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).parents[1] / "bench" / "contention_spans.py"
    spec = importlib.util.spec_from_file_location("bench_contention_spans", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_hog_on_a_service_stretches_its_store_calls_and_not_its_callees(tmp_path, bench):
    scenario = tmp_path / "hog.yaml"
    scenario.write_text(HOG)
    generate_dataset(tmp_path / "data", scenario=scenario, traces=3000, imbalance=0.3, seed=0, progress=False)
    table = bench.shifts(tmp_path / "data", "interference").set_index("service")
    assert list(table.index) == ["user-timeline-service"] and table.loc["user-timeline-service", "traces"] > 100
    row = table.loc["user-timeline-service"]
    # it reads its stores' answers late (a slice's milliseconds on sub-ms calls); its callee is untouched
    assert row["store_calls"] > 2 and row["service_calls"] > 1 and abs(row["callee_servers"]) < 1
    assert row["calls_in"] > 1  # and its callers wait on it (the requests it takes in late)
    assert bench.shifts(tmp_path / "data", "network").empty  # no such faults: an empty table
