"""Twin fitting: structure recovered from traces of a known spec, internal spans folded, and
fidelity on the real Online Boutique traces."""

from __future__ import annotations

import json

import pytest

from bmeg.faultinject import parse_topology
from bmeg.faultinject.spec import BranchStep, CallStep, ParallelStep, walk_calls
from bmeg.faultinject.twin import fit_twin, simulated_spans, twin_fidelity
from bmeg.graphs.rpc import rpc_view
from bmeg.traces.schema import span_table

KNOWN = {
    "name": "known",
    "workload": {"rate": 200},
    "requests": {"get": {"entry": "front:get", "weight": 1}},
    "services": {
        "front": {"replicas": 2, "cores": 4, "workers": 64, "operations": {"get": {
            "self_time": {"median_us": 300, "sigma": 0.3},
            "calls": [
                {"parallel": [{"call": "left:a"}, {"call": "right:b"}]},
                {"branch": [{"p": 0.3, "steps": [{"call": "tail:c"}]}, {"p": 0.7, "steps": []}]},
            ]}}},
        "left": {"cores": 4, "workers": 64, "operations": {"a": {"self_time": {"median_us": 2000, "sigma": 0.2}}}},
        "right": {"cores": 4, "workers": 64, "operations": {"b": {"self_time": {"median_us": 500, "sigma": 0.2}}}},
        "tail": {"cores": 4, "workers": 64, "operations": {"c": {"self_time": {"median_us": 800, "sigma": 0.2}}}},
    },
}


@pytest.fixture(scope="module")
def known_traces():
    return simulated_spans(parse_topology(KNOWN), seconds=5, seed=1)


def test_twin_recovers_structure_of_a_known_spec(known_traces):
    twin = fit_twin(known_traces)
    assert set(twin.services) == {"front", "left", "right", "tail"}
    assert twin.services["front"].replicas == 2
    assert list(twin.requests.values())[0].entry == "front:get"
    assert twin.workload.rate == pytest.approx(200, rel=0.15)
    assert twin.cpu_waits == "at-wakeup"  # a CPU backlog lands where a real process stamps time
    (branch,) = twin.services["front"].operations["get"].calls
    assert isinstance(branch, BranchStep)
    shares = {tuple(type(s).__name__ for s in option.steps): option.p for option in branch.branch}
    # both options start with left and right in parallel; 30% then call tail
    assert shares == {("ParallelStep", "CallStep"): pytest.approx(0.3, abs=0.06),
                      ("ParallelStep",): pytest.approx(0.7, abs=0.06)}
    for option in branch.branch:
        first = option.steps[0]
        assert isinstance(first, ParallelStep)
        assert sorted(step.call for step in first.parallel) == ["left:a", "right:b"]
    calls = {step.call for _, step in walk_calls(branch.branch[0].steps, "") if isinstance(step, CallStep)}
    assert calls <= {"left:a", "right:b", "tail:c"}
    for service, median in (("left", 2000), ("right", 500), ("tail", 800)):
        (operation,) = twin.services[service].operations.values()
        assert operation.self_time.median_us == pytest.approx(median, rel=0.1)


def test_twin_of_a_twin_reproduces_its_traces(known_traces):
    fidelity = twin_fidelity(known_traces, fit_twin(known_traces), seconds=5, seed=2)
    assert fidelity.p50_error < 0.1
    assert fidelity.p95_error < 0.2
    assert fidelity.same_shape > 0.9


def test_rpc_view_folds_internal_spans_into_their_rpc():
    # a: root of svc1, b: internal to svc1 (two children), c: client span of svc1 -> d: server of svc2
    table = span_table({
        "trace_id": ["t"] * 5, "span_id": ["a", "b", "c", "d", "e"], "parent_id": [None, "a", "b", "c", "b"],
        "service": ["svc1", "svc1", "svc1", "svc2", "svc1"], "operation": ["root", "helper", "call", "serve", "sql"],
        "start_ns": [0, 10, 20, 30, 80], "duration_ns": [100, 80, 50, 30, 5],
    })
    forest = rpc_view(table)
    kept = forest.spans["span_id"].to_pylist()
    assert kept == ["a", "c", "d"]
    parents = dict(zip(kept, forest.spans["parent_id"].to_pylist()))
    assert parents == {"a": None, "c": "a", "d": "c"}


@pytest.mark.integration
def test_twin_of_online_boutique_matches_real_latencies_and_shapes(shared_dir):
    from bmeg.traces.io import read_spans

    real = read_spans(shared_dir / "data/nezha-ob-2022-08-23/normal/17_00_trace.csv.gz")
    twin = fit_twin(real)
    assert len(twin.services) == 10
    fidelity = twin_fidelity(real, twin, seconds=60, seed=0)
    # measured: p50 0.10, p95 0.18, shapes 0.93
    assert fidelity.p50_error < 0.2
    assert fidelity.p95_error < 0.3
    assert fidelity.same_shape > 0.85
    assert fidelity.depth["max_real"] == fidelity.depth["max_sim"]


def test_twin_fit_cli_writes_a_spec_that_generation_accepts(known_traces, tmp_path):
    from click.testing import CliRunner

    from bmeg.cli import main
    from bmeg.datasets.generate import generate_dataset
    from bmeg.faultinject import load_topology
    from bmeg.traces.io import write_spans

    write_spans(known_traces, tmp_path / "normal.parquet", "parquet")
    result = CliRunner().invoke(main, ["twin", "fit", str(tmp_path / "normal.parquet"), "-o", str(tmp_path / "twin.yaml"),
                                       "--check-seconds", "2", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["services"] == 4 and summary["same_shape_share"] > 0.8
    assert set(load_topology(tmp_path / "twin.yaml").services) == {"front", "left", "right", "tail"}
    card = generate_dataset(tmp_path / "data", topology=tmp_path / "twin.yaml", traces=200, imbalance=0.2,
                            scenario="single", progress=False)
    assert card["traces"] == 200
