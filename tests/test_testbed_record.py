"""`bmeg testbed record`: the running testbed's fault-free traffic for a fixed time, as whole
traces (fast checks without processes; the recording itself on the real testbed, integration)."""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from builders import running_testbed
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.cli import main
from bmeg.faultinject.testbed.campaign import record_healthy
from bmeg.traces.schema import traces_begun_between
from bmeg.faultinject.testbed.state import Testbed, TestbedState
from bmeg.faultinject.testbed import system
from bmeg.faultinject.testbed.system import SOURCE_ROOT
from bmeg.traces.io import read_spans

needs_testbed = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (cgroups, namespaces)"),
    pytest.mark.skipif(not (SOURCE_ROOT / "testbed" / "build.sh").is_file(), reason="no testbed/build.sh"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="bash scripts/apt-install.sh redis-server ..."),
]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 100)), max_size=40),
       st.integers(0, 100), st.integers(0, 100))
def test_keeps_whole_traces_that_begin_in_the_window(rows, began, ended):
    spans = pa.table({"trace_id": pa.array([f"t{t}" for t, _ in rows], pa.string()),
                      "start_ns": pa.array([s for _, s in rows], pa.int64())})
    kept = traces_begun_between(spans, began, ended)
    first: dict[str, int] = {}
    for trace, start in rows:
        first[f"t{trace}"] = min(start, first.get(f"t{trace}", start))
    inside = {trace for trace, start in first.items() if began <= start < ended}
    assert set(kept["trace_id"].to_pylist()) == inside
    assert kept.num_rows == sum(1 for t, _ in rows if f"t{t}" in inside)  # every span of those traces


def test_refuses_a_testbed_that_is_not_running(tmp_path):
    with pytest.raises(system.TestbedError, match="not running"):
        record_healthy(tmp_path / "out.parquet", 1.0, Testbed(23990, tmp_path))
    result = CliRunner().invoke(main, ["testbed", "record", "--seconds", "1", "--out", str(tmp_path / "x.parquet")],
                                env={"BMEG_TESTBED_RUN_DIR": str(tmp_path), "BMEG_TESTBED_PORT_BASE": "23990"})
    assert result.exit_code == 1 and "bmeg testbed up" in result.output
    assert not (tmp_path / "x.parquet").exists()


def test_refuses_traffic_with_a_fault_in_force(tmp_path):
    TestbedState(base=23990, run_dir=str(tmp_path), faults={"e0-1": {"source": "network"}}).save()
    with pytest.raises(system.TestbedError, match="faults in force"):
        record_healthy(tmp_path / "out.parquet", 1.0, Testbed(23990, tmp_path))


@pytest.mark.parametrize("seconds", [0.0, -1.0])
def test_needs_a_positive_time(tmp_path, seconds):
    with pytest.raises(ValueError, match="positive"):
        record_healthy(tmp_path / "out.parquet", seconds, Testbed(23990, tmp_path))


@pytest.mark.integration
@needs_testbed[0]
@needs_testbed[1]
@needs_testbed[2]
def test_records_the_real_testbeds_traffic(tmp_path):
    with running_testbed(23200 + os.getpid() % 5 * 100, "bmeg-testbed-record-", rate=50.0) as bed:
        card = record_healthy(tmp_path / "healthy.parquet", 6.0, bed)
    spans = read_spans(tmp_path / "healthy.parquet")
    assert card["traces"] == pc.count_distinct(spans["trace_id"]).as_py() > 100  # ~50 req/s for 6 s
    assert card["spans"] == spans.num_rows
    starts = spans.group_by("trace_id").aggregate([("start_ns", "min")])["start_ns_min"]
    assert card["began_ns"] <= pc.min(starts).as_py() and pc.max(starts).as_py() < card["ended_ns"]
    services = set(spans["service"].to_pylist())
    assert "nginx-web-server" in services and len(services) >= 10
