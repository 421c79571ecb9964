"""Labels follow the injected faults: every source and kind makes anomalous traces, and only
injected services are bottlenecks."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest
from builders import chain_spec

from bmeg.faultinject import (
    Fault,
    calibrate,
    episode_tables,
    label_episode,
    load_scenario,
    parse_topology,
    plan_faults,
    simulate,
)

SOURCES = {  # case: (source, service, parameters)
    "interference": ("interference", "leaf", {"factor": 4}),
    "saturation-cpu": ("saturation", "leaf", {"capacity": 0.3}),
    "saturation-replicas": ("saturation", "leaf", {"replicas": 1}),
    "network-delay": ("network", "mid", {"delay_ms": 10}),
    "network-bandwidth": ("network", "mid", {"bandwidth_kbit": 1024}),
    "misconfiguration-pool": ("misconfiguration", "mid", {"pool_size": 1}),
    "background": ("background", "leaf", {"pause_ms": 40, "every_ms": 300}),
}


def two_leaves():
    """The chain with two leaf replicas, so that replica-level faults have something to cut."""
    spec = chain_spec()
    spec["services"]["leaf"]["replicas"] = 2
    return parse_topology(spec)


@pytest.fixture(scope="module")
def thresholds():
    return calibrate(two_leaves(), 0, duration_s=5)


def _episode(faults, thresholds, duration=4, seed=1):
    result = simulate(two_leaves(), faults, duration, seed)
    labels = label_episode(result, thresholds)
    keep = np.arange(len(result.trace_start))
    return result, episode_tables(result, labels, keep, 0, 0, np.random.default_rng(seed))


@pytest.mark.parametrize("case", sorted(SOURCES))
def test_every_source_makes_anomalous_traces_labelled_with_it(case, thresholds):
    source, service, parameters = SOURCES[case]
    _, tables = _episode([Fault(service, source, "single", 1.0, 3.0, parameters)], thresholds)
    traces = tables.traces.to_pylist()
    anomalous = [t for t in traces if t["anomalous"]]
    assert len(anomalous) > 20
    assert {t["fault_source"] for t in anomalous} == {source}
    assert {tuple(t["fault_services"]) for t in anomalous} == {(service,)}
    assert all(t["fault_kind"] == "none" and not t["fault_services"] for t in traces if not t["anomalous"])
    # nothing is anomalous before the fault starts (start_ns counts from the episode start)
    assert not any(t["anomalous"] for t in traces if t["start_ns"] + t["duration_ns"] < 1e9)


def _cache_episode(normal_hit_ratio: float):
    """The chain (two leaves) whose cache hits `normal_hit_ratio` of its lookups when healthy, its
    cache misconfigured to hit none from 1 s to 3 s."""
    spec = chain_spec()
    spec["services"]["leaf"]["replicas"] = 2
    spec["services"]["mid"]["operations"]["work_server"]["calls"][1]["hit_ratio"] = normal_hit_ratio
    topology = parse_topology(spec)
    thresholds = calibrate(topology, 0, duration_s=5)
    result = simulate(topology, [Fault("cache", "misconfiguration", "single", 1.0, 3.0, {"hit_ratio": 0.0})], 4, 1)
    labels = label_episode(result, thresholds)
    return result, labels, episode_tables(result, labels, np.arange(len(result.trace_start)), 0, 0,
                                          np.random.default_rng(1))


def test_a_misconfigured_cache_shows_where_the_healthy_cache_misses_as_rarely_as_a_p99():
    result, labels, tables = _cache_episode(0.995)
    traces = tables.traces.to_pylist()
    anomalous = [t for t in traces if t["anomalous"]]
    assert len(anomalous) > 20
    assert {t["fault_source"] for t in anomalous} == {"misconfiguration"}
    assert {tuple(t["fault_services"]) for t in anomalous} == {("cache",)}
    assert labels.span_bottleneck[result.visit_span[result.visit_cache_fault]].all()


def test_a_faulted_miss_that_the_healthy_cache_makes_often_does_not_show():
    """A cache that misses 10% of its lookups when healthy: under the fault most lookups miss
    where it would have hit, but each such trace has the spans of a normal miss (one uniform draw
    decides both), so none of them shows; only a lookup slower than its p99 can."""
    result, labels, tables = _cache_episode(0.9)
    assert result.visit_cache_fault.sum() > 100
    assert labels.span_bottleneck[result.visit_span[result.visit_cache_fault]].mean() < 0.03
    assert pc.sum(tables.traces["anomalous"]).as_py() < 0.03 * tables.traces.num_rows


def test_bottleneck_nodes_only_on_injected_services(thresholds):
    faults = [
        Fault("leaf", "saturation", "multiple", 1.0, 3.0, {"capacity": 0.3}),
        Fault("db", "interference", "multiple", 1.0, 3.0, {"factor": 5}),
    ]
    _, tables = _episode(faults, thresholds)
    nodes = tables.nodes.to_pylist()
    faulty_services = {row["trace_id"]: set(row["fault_services"]) for row in tables.traces.to_pylist()}
    anomalous = {row["trace_id"] for row in tables.traces.to_pylist() if row["anomalous"]}
    bottlenecks = [row for row in nodes if row["bottleneck"]]
    assert {row["service"] for row in bottlenecks} == {"leaf", "db"}
    # callers slowed by back-pressure (front, mid) are never bottlenecks
    assert all(row["service"] in faulty_services[row["trace_id"]] for row in bottlenecks)
    assert {row["trace_id"] for row in bottlenecks} == anomalous


def test_mild_fault_that_does_not_show_leaves_traces_normal(thresholds):
    _, tables = _episode([Fault("leaf", "interference", "single", 1.0, 3.0, {"factor": 1.0})], thresholds)
    anomalous = pc.sum(tables.traces["anomalous"]).as_py()
    # a factor of 1 changes nothing: only the ~1% of visits above the normal p99 count
    assert anomalous < 0.03 * tables.traces.num_rows


@pytest.mark.parametrize("kind", ["single", "multiple", "cascading"])
def test_every_kind_makes_anomalous_traces(kind, thresholds):
    scenario = load_scenario(kind)
    faults = plan_faults(scenario, two_leaves(), np.random.default_rng(2))
    result, tables = _episode(faults, thresholds, duration=scenario.duration_s, seed=2)
    kinds = set(pc.unique(tables.traces["fault_kind"]).to_pylist())
    assert kind in kinds and kinds <= {kind, "none"}
    assert pc.sum(tables.traces["anomalous"]).as_py() > 50


def test_a_visit_that_waited_at_the_faulted_replica_during_the_fault_is_under_it():
    """Requests that reach the slowed leaf during the fault, wait for a worker and start after its
    end were slowed by it: they count as under the fault (and are bottlenecks where their local
    time, the wait included, is above the p99), not as normal visits."""
    spec = chain_spec()
    spec["services"]["mid"]["workers"] = 64  # the queue forms at the leaf, not at its caller
    spec["services"]["leaf"]["workers"] = 2
    topology = parse_topology(spec)
    result = simulate(topology, [Fault("leaf", "interference", "single", 1.0, 2.0, {"factor": 5})], 3, 1)
    labels = label_episode(result, calibrate(topology, 0, duration_s=5))
    leaf = np.flatnonzero(result.span_service[result.visit_span] == result.services.index("leaf"))
    span = result.visit_span[leaf]
    call_start = result.span_start[result.span_parent[span]]  # the caller's client span: sent then
    late = leaf[(result.span_start[span] > 2e9) & (call_start < 2e9 - 1e6)]
    assert len(late) > 5
    assert (result.visit_fault[late] == 0).all()
    assert labels.span_bottleneck[result.visit_span[late]].mean() > 0.5
