"""`bench/contention_spans.py`: where a CPU hog's time lands in the hogged service's spans."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from builders import bench_module

from bmeg.datasets.generate import generate_dataset
from bmeg.graphs import assemble
from bmeg.models.features import FeatureEncoder

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
    return bench_module("contention_spans")


@pytest.fixture(scope="module")
def hogged(tmp_path_factory) -> Path:
    """A simulated socialnet whose user-timeline-service a CPU hog starves for 10 s."""
    folder = tmp_path_factory.mktemp("hog")
    (folder / "hog.yaml").write_text(HOG)
    generate_dataset(folder / "data", scenario=folder / "hog.yaml", traces=3000, imbalance=0.3, seed=0, progress=False)
    return folder / "data"


def test_a_hog_on_a_service_stretches_its_store_calls_and_not_its_callees(hogged, bench):
    table = bench.shifts(hogged, "interference").set_index("service")
    assert list(table.index) == ["user-timeline-service"] and table.loc["user-timeline-service", "traces"] > 100
    row = table.loc["user-timeline-service"]
    # it reads its stores' answers late (a slice's milliseconds on sub-ms calls); its callee is untouched
    assert row["store_calls"] > 2 and row["service_calls"] > 1 and abs(row["callee_servers"]) < 1
    assert row["calls_in"] > 1  # and its callers wait on it (the requests it takes in late)
    assert bench.shifts(hogged, "network").empty  # no such faults: an empty table


def test_with_a_model_it_reads_the_z_scores_the_model_sees_there(hogged, bench):
    traces = pq.read_table(hogged / "traces.parquet")
    normal_ids = traces.filter(pc.equal(traces["fault_source"], "none"))["trace_id"]
    spans = pq.read_table(hogged / "spans.parquet")
    encoder = FeatureEncoder("relative-siblings").fit(assemble(spans.filter(pc.is_in(spans["trace_id"], normal_ids))))
    row = bench.shifts(hogged, "interference", SimpleNamespace(encoder=encoder)).set_index("service").iloc[0]
    assert row["store:z_log_duration_us"] > 2  # its stretched store calls sit far above their normal
    assert np.isfinite(row[["server:z_log_self_time_us", "server:z_log_wait_us", "store:z_duration_beyond_siblings"]]).all()
