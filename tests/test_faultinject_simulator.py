"""The simulator: structure of the spans, determinism, back-pressure, timeouts, caches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import chain_spec, chain_topology

from bmeg.faultinject import Fault, calibrate, episode_tables, label_episode, parse_topology, simulate, spans_of
from bmeg.graphs import assemble
from bmeg.graphs.features import self_time_ns
from bmeg.traces.schema import SPAN_SCHEMA


def _tables(topology, result):
    labels = label_episode(result, calibrate(topology, 0, duration_s=5))
    return episode_tables(result, labels, np.arange(len(result.trace_start)), 0, 0, np.random.default_rng(0))


def _durations(result, operation: str) -> np.ndarray:
    index = result.operations.index(operation)
    mask = result.span_operation == index
    return result.span_end[mask] - result.span_start[mask], result.span_start[mask]


def test_same_seed_gives_identical_spans():
    topology = chain_topology()
    first = simulate(topology, [], 2, 7)
    second = simulate(topology, [], 2, 7)
    other = simulate(topology, [], 2, 8)
    assert spans_of(first).equals(spans_of(second))
    assert _tables(topology, first).spans.equals(spans_of(first))
    assert not spans_of(first).equals(spans_of(other))


def test_spans_look_like_rpc_traces():
    topology = chain_topology()
    spans = _tables(topology, simulate(topology, [], 2, 1)).spans
    assert spans.schema.equals(SPAN_SCHEMA)
    rows = spans.to_pylist()
    by_id = {row["span_id"]: row for row in rows}
    for row in rows:
        if row["kind"] == "server" and row["parent_id"] is not None:
            parent = by_id[row["parent_id"]]
            # server spans hang under the caller's client span: work_server under work_client
            assert parent["kind"] == "client" and parent["trace_id"] == row["trace_id"]
            stem = row["operation"].removesuffix("_server")
            assert parent["operation"] == f"{stem}_client"
            assert parent["start_ns"] <= row["start_ns"]
        if row["peer_service"] is not None:
            assert row["kind"] == "client" and row["db_system"] in ("memcached", "mongodb")
    assert {row["peer_service"] for row in rows} >= {"cache", "db", None}
    assert all(len(row["span_id"]) == 16 and len(row["trace_id"]) == 32 for row in rows)


def test_saturated_leaf_slows_its_callers_back_pressure():
    topology = chain_topology()
    saturated = [Fault("leaf", "saturation", "single", 3.0, 6.0, {"capacity": 0.3})]
    result = simulate(topology, saturated, 6, 3)
    for operation in ("work_server", "get"):
        durations, starts = _durations(result, operation)
        before = np.median(durations[starts < 3e9])
        during = np.median(durations[(starts > 4e9) & (starts < 6e9)])
        assert during > 5 * before, operation
    # mid's worker pool is held while the leaf is slow: mid's callers queue for it
    mid = result.op_keys.index("mid:work_server")
    local = result.visit_local[result.visit_key == mid]
    assert np.percentile(local, 99) > 20 * np.median(local)
    # ... but only the leaf is labelled the bottleneck
    labels = label_episode(result, calibrate(topology, 0, duration_s=5))
    bottleneck_services = {result.services[s] for s in result.span_service[labels.span_bottleneck]}
    assert bottleneck_services == {"leaf"}


def test_timeout_ends_client_span_with_error():
    spec = chain_spec(rate=100)
    spec["services"]["front"]["operations"]["get"]["calls"][0]["timeout_ms"] = 5
    result = simulate(parse_topology(spec), [Fault("leaf", "interference", "single", 1.0, 2.0, {"factor": 20})], 2, 1)
    durations, starts = _durations(result, "work_client")
    index = result.operations.index("work_client")
    errors = result.span_error[result.span_operation == index]
    assert errors.any() and (durations[errors] == pytest.approx(5e6))
    assert not errors[starts < 1e9].any()


def test_small_cache_sends_lookups_to_the_database():
    topology = chain_topology()
    result = simulate(topology, [Fault("cache", "misconfiguration", "single", 1.0, 2.0, {"hit_ratio": 0.0})], 2, 1)
    find = result.operations.index("find_client")
    starts = result.span_start[result.span_operation == find]
    during = ((starts > 1e9) & (starts < 2e9)).sum()
    outside = (starts < 1e9).sum()
    assert during > 5 * outside
    assert result.visit_cache_fault.sum() > 0


def _call_gaps(result, client: str, server: str, from_s: float, to_s: float) -> tuple[float, float]:
    """Median (wait before the server span starts, wait after it ends) of the calls whose client
    span is `client` and server span `server`, opened between from_s and to_s."""
    clients = np.flatnonzero((result.span_operation == result.operations.index(client))
                             & (result.span_start > from_s * 1e9) & (result.span_start < to_s * 1e9))
    server_id = result.operations.index(server)
    child = {parent: span for span, parent in enumerate(result.span_parent)
             if parent >= 0 and result.span_operation[span] == server_id}
    pairs = [(c, child[c]) for c in clients if c in child]
    before = [result.span_start[s] - result.span_start[c] for c, s in pairs]
    after = [result.span_end[c] - result.span_end[s] for c, s in pairs]
    return float(np.median(before)), float(np.median(after))


@pytest.mark.parametrize("inbound", [0.0, 1.0])
def test_a_network_delay_shows_where_its_form_puts_it(inbound):
    """Outbound (tc netem): what mid sends is late, its answers to front and its calls to leaf;
    inbound (a proxy in front of mid): the requests into mid, and nothing mid sends. Either way
    the label names mid alone."""
    topology = chain_topology(rate=100)
    delay = {"delay_ms": 20.0, "inbound": inbound}
    result = simulate(topology, [Fault("mid", "network", "single", 1.0, 3.0, delay)], 3, 4)
    into_mid = _call_gaps(result, "work_client", "work_server", 1.2, 2.8)
    from_mid = _call_gaps(result, "compute_client", "compute", 1.2, 2.8)
    late = 20e6 * 0.9
    if inbound:
        assert into_mid[0] > late and into_mid[1] < 1e6 and from_mid[0] < 1e6
    else:
        assert into_mid[0] < 1e6 and into_mid[1] > late and from_mid[0] > late
    labels = label_episode(result, calibrate(topology, 0, duration_s=5))
    assert {result.services[s] for s in result.span_service[labels.span_bottleneck]} == {"mid"}


def test_gc_pauses_move_the_tail_not_the_median():
    topology = chain_topology()
    fault = Fault("leaf", "background", "single", 0.0, 10.0, {"pause_ms": 30, "every_ms": 1000})
    calm, paused = simulate(topology, [], 10, 4), simulate(topology, [fault], 10, 4)
    calm_d, _ = _durations(calm, "compute_client")
    paused_d, _ = _durations(paused, "compute_client")
    assert np.median(paused_d) < 1.5 * np.median(calm_d)
    assert np.percentile(paused_d, 99.9) > 3 * np.percentile(calm_d, 99.9)


def _mid_times(result) -> tuple[float, float, float]:
    """Medians (us) of mid's server self time, of its calls to the cache, and of the wait before
    its server spans start (from its caller's client span's start)."""
    forest = assemble(spans_of(result))
    spans = forest.spans.to_pandas().assign(self_ns=self_time_ns(forest))
    server = spans[(spans.service == "mid") & (spans.kind == "server")]
    calls = spans[(spans.service == "mid") & (spans.kind == "client") & (spans.peer_service == "cache")]
    wait = server.start_ns.to_numpy() - spans.set_index("span_id").start_ns.reindex(server.parent_id).to_numpy()
    return np.median(server.self_ns) / 1e3, np.median(calls.duration_ns) / 1e3, np.median(wait) / 1e3


def test_at_wakeup_a_cpu_backlog_lands_where_the_process_stamps_time():
    # a hog on mid: with `cpu_waits: at-wakeup` mid's self time stays, the wait before its server
    # spans and its calls to the cache (the answer read when it gets a core) take the backlog, as
    # on the testbed; without it the backlog lands in mid's self time
    hog = [Fault("mid", "interference", "single", 0.0, 4.0, {"factor": 20, "slice_ms": 3})]
    spec = chain_spec(rate=300)
    calm_self, calm_calls, calm_wait = _mid_times(simulate(parse_topology(spec), [], 4, 5))
    in_span = _mid_times(simulate(parse_topology(spec), hog, 4, 5))
    at_wakeup = _mid_times(simulate(parse_topology({**spec, "cpu_waits": "at-wakeup"}), hog, 4, 5))
    assert in_span[0] > 3 * calm_self and in_span[1] < 2 * calm_calls
    assert at_wakeup[0] < 1.2 * calm_self
    assert at_wakeup[1] > 5 * calm_calls and at_wakeup[2] > 20 * calm_wait
    # fault-free, the short FCFS waits leave the spans too: mid's self time is no longer than in-span
    assert _mid_times(simulate(parse_topology({**spec, "cpu_waits": "at-wakeup"}), [], 4, 5))[0] < calm_self


steps = st.recursive(
    st.sampled_from(["leaf", "db"]).map(lambda target: {"call": f"{target}:{'compute' if target == 'leaf' else 'find'}"}),
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3).map(lambda children: {"parallel": children}),
        st.lists(inner, min_size=1, max_size=3).map(lambda children: {"sequence": children}),
        st.lists(inner, min_size=2, max_size=2).map(lambda c: {"branch": [{"p": 0.5, "steps": [c[0]]}, {"p": 0.5, "steps": [c[1]]}]}),
    ),
    max_leaves=6,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(steps, min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_any_call_tree_gives_well_formed_traces(calls, seed):
    spec = chain_spec(rate=50)
    spec["services"]["mid"]["operations"]["work_server"]["calls"] = calls
    result = simulate(parse_topology(spec), [], 1, seed)
    roots = result.span_parent < 0
    assert roots.sum() == len(result.trace_start)
    parents = result.span_parent[~roots]
    assert (result.span_trace[parents] == result.span_trace[~roots]).all()
    assert (result.span_start[~roots] >= result.span_start[parents]).all()
    assert (result.span_end >= result.span_start).all()
    # without faults or timeouts, every child ends before its parent
    assert (result.span_end[~roots] <= result.span_end[parents] + 1e-6).all()


def test_constant_arrivals_are_evenly_spaced_and_the_mix_is_kept():
    spec = chain_spec(rate=200)
    spec["workload"]["arrivals"] = "constant"
    spec["services"]["front"]["operations"]["put"] = {"self_time": {"median_us": 100, "sigma": 0.1}}
    spec["requests"] = {"get": {"entry": "front:get", "weight": 3}, "put": {"entry": "front:put", "weight": 1}}
    result = simulate(parse_topology(spec), [], 5, 2)
    assert len(result.trace_start) == 1000
    assert np.allclose(np.diff(result.trace_start), 5e6)
    assert abs((result.trace_request == 1).mean() - 0.25) < 0.05
