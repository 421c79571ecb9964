"""Code faults applied to simulated spans, and the labelled dataset `bmeg bootstrap` trains on."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest

from bmeg.datasets.loader import read_dataset
from bmeg.faultinject import parse_topology, simulate, spans_of
from bmeg.faultinject.codefaults import apply_code_fault, code_fault_dataset
from bmeg.graphs import assemble

SPEC = {
    "name": "shop",
    "workload": {"rate": 200},
    "requests": {"buy": {"entry": "web:buy", "weight": 1}},
    "services": {
        "web": {"cores": 4, "workers": 64, "operations": {"buy": {
            "self_time": {"median_us": 300, "sigma": 0.3},
            "calls": [{"call": "cart:get"}, {"call": "pay:charge"}]}}},
        "cart": {"cores": 2, "operations": {"get": {
            "self_time": {"median_us": 800, "sigma": 0.3}, "calls": [{"call": "stock:check"}]}}},
        "stock": {"cores": 2, "operations": {"check": {"self_time": {"median_us": 200, "sigma": 0.3}}}},
        "pay": {"cores": 2, "operations": {"charge": {"self_time": {"median_us": 1500, "sigma": 0.3}}}},
    },
}


@pytest.fixture(scope="module")
def topology():
    return parse_topology(SPEC)


def test_a_hit_span_is_a_bottleneck_only_where_the_trace_shows_the_fault(topology):
    healthy = spans_of(simulate(topology, [], 2, 1))
    for service, kind, shows in (("cart", "return", True), ("cart", "exception", True),
                                 ("pay", "return", False), ("pay", "exception", True)):
        fault = apply_code_fault(healthy, service, kind, 0.5, np.random.default_rng(0))
        forest = assemble(fault.spans)
        names = fault.spans["service"].to_numpy(zero_copy_only=False)
        marked = fault.bottleneck
        assert len(marked) == fault.spans.num_rows
        # only the faulty service's server spans are marked, about half of them when it shows
        assert set(names[marked]) <= {service}
        share = marked.sum() / (names == service).sum()
        assert (0.3 < share < 0.7) if shows else share == 0.0
        if kind == "exception":  # each marked span is where an error begins: no child has one
            errors = pc.equal(fault.spans["status"], "error").to_numpy(zero_copy_only=False)
            assert errors[marked].all()
        assert forest.num_traces > 0


def test_code_fault_dataset_loads_as_a_labelled_dataset_with_every_service_and_kind(topology, tmp_path):
    card = code_fault_dataset(topology, tmp_path / "code", traces=600, seed=3)
    data = read_dataset(tmp_path / "code")
    assert card["traces"] == data.traces.num_rows >= 600
    assert data.nodes.num_rows == data.spans.num_rows
    anomalous = data.traces["anomalous"].to_numpy(zero_copy_only=False)
    assert 0 < anomalous.sum() < len(anomalous) and card["anomalous_traces"] == anomalous.sum()
    # an anomalous trace has a bottleneck node, a normal one none; its source is `code`
    flagged = set(data.nodes.filter(data.nodes["bottleneck"])["trace_id"].to_pylist())
    ids = np.asarray(data.traces["trace_id"].to_pylist())
    assert flagged == set(ids[anomalous])
    assert set(data.traces.filter(data.traces["anomalous"])["fault_source"].to_pylist()) == {"code"}
    # every service that makes calls or can throw was faulted: all four appear as a cause
    causes = {s for services in data.traces["fault_services"].to_pylist() for s in services}
    assert causes == {"web", "cart", "stock", "pay"}
    with pytest.raises(ValueError, match="at least one trace"):
        code_fault_dataset(topology, tmp_path / "none", traces=0)
    with pytest.raises(ValueError, match="share"):
        apply_code_fault(spans_of(simulate(topology, [], 1, 1)), "cart", "return", 1.5, np.random.default_rng(0))


@pytest.mark.integration
def test_bootstrap_trains_on_latency_and_code_faults_and_returns_a_calibrated_detector(topology, tmp_path):
    """`bmeg bootstrap` end to end on a small application (it once failed at its last step,
    writing metrics into the frozen Detector)."""
    from bmeg.datasets.family import CPU_FAULT_SCENARIOS, DEFAULT_CPU_FAULTS
    from bmeg.evaluation.bootstrap import bootstrap
    from bmeg.models.detector import Detector
    from bmeg.traces.io import write_spans

    normal = tmp_path / "normal.parquet"
    write_spans(spans_of(simulate(topology, [], 8, 5)), normal, "parquet")
    detector, metrics = bootstrap(normal, tmp_path / "run", traces=900, epochs=2, progress=False, window_gcn_windows=8)
    # no service of the shop calls a store: no shard of CPU faults on store callers
    shards = {*CPU_FAULT_SCENARIOS[DEFAULT_CPU_FAULTS]} - {"callers-scheduler"}
    assert {p.name for p in (tmp_path / "run" / "data").iterdir()} == {*shards, "code"}
    calibration = metrics["calibration"]
    assert calibration["healthy_traces"] > 300 and calibration["bound_met"]
    assert calibration["flagged_after"] <= 0.01
    assert detector.thresholds["graph"] >= calibration["thresholds_before"]["graph"]
    loaded = Detector.load(tmp_path / "run")
    assert loaded.thresholds == detector.thresholds and loaded.metrics["calibration"] == calibration
