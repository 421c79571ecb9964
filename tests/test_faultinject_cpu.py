"""The CPU faults as the kernel's scheduler makes them (`bmeg.faultinject.cpu`), and in the simulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from builders import SHOP_SPEC, chain_topology

from bmeg.faultinject import Fault, simulate
from bmeg.faultinject.cpu import throttle, timeshare
from bmeg.faultinject.scenario import load_scenario, parse_scenario, plan_faults, store_callers
from bmeg.faultinject.spec import load_topology


def _throttled_by_ticks(bursts: list[tuple[int, int]], period: int, quota: int) -> list[int]:
    """Reference: one core, time in ticks; a tick of work runs only while its period has quota."""
    ends, t, spent = [], 0, {}
    for gap, run in bursts:
        t += gap
        while run:
            k = t // period
            if spent.get(k, 0) < quota:
                spent[k] = spent.get(k, 0) + 1
                run -= 1
            t += 1
        ends.append(t)
    return ends


@given(period=st.integers(2, 20), data=st.data(),
       bursts=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=12))
def test_throttle_runs_each_period_up_to_its_quota_then_waits_for_the_next(period, data, bursts):
    quota = data.draw(st.integers(1, period))
    expected = _throttled_by_ticks(bursts, period, quota)
    t, window, used, ends = 0.0, 0, 0.0, []
    for gap, run in bursts:  # bursts one after the other on one core, as the simulator asks for them
        end, window, used = throttle(t + gap, float(run), float(period), float(quota), window, used)
        ends.append(end)
        t = end
    assert ends == pytest.approx(expected)


def test_throttle_charges_a_burst_behind_the_ledger_to_the_ledgers_period():
    # another core spent period 3's quota: a burst asked for at time 10 (period 1) waits for period 4
    assert throttle(10.0, 1.0, 100.0, 20.0, 3, 20.0) == (401.0, 4, 1.0)


@pytest.mark.parametrize("quota, period", [(0.0, 100.0), (10.0, 0.0), (-1.0, 100.0)])
def test_throttle_refuses_a_quota_that_never_runs(quota, period):
    with pytest.raises(ValueError, match="positive quota"):
        throttle(0.0, 1.0, period, quota, 0, 0.0)


@given(cycle=st.integers(2, 20), data=st.data(), start=st.integers(0, 100), run=st.integers(1, 60))
def test_timeshare_runs_only_in_the_gaps_between_the_hogs_slices(cycle, data, start, run):
    hold, phase = data.draw(st.integers(0, cycle - 1)), data.draw(st.integers(0, 3 * cycle))
    t, left = start, run
    while left:  # reference, in ticks: the hog holds [phase + k cycle, phase + k cycle + hold)
        if (t - phase) % cycle >= hold:
            left -= 1
        t += 1
    assert timeshare(float(start), float(run), float(cycle), float(hold), float(phase)) == pytest.approx(t)


def test_timeshare_wakeup_waits_for_the_slice_to_end():
    assert timeshare(12.0, 0.0, 10.0, 6.0, 0.0) == 16.0  # in the hog's slice [10, 16)
    assert timeshare(17.0, 0.0, 10.0, 6.0, 0.0) == 17.0  # in the gap
    with pytest.raises(ValueError, match="holds a part"):
        timeshare(0.0, 1.0, 10.0, 10.0, 0.0)


def _leaf(result, since_s: float, until_s: float) -> tuple[np.ndarray, np.ndarray]:
    """The leaf's local times in a time range, and the gap from its caller's client span to its server span."""
    key = result.op_keys.index("leaf:compute")
    visits = result.visit_key == key
    spans = result.visit_span[visits]
    starts = result.span_start[spans]
    chosen = (starts >= since_s * 1e9) & (starts < until_s * 1e9)
    gap = starts - result.span_start[result.span_parent[spans]]
    return result.visit_local[visits][chosen], gap[chosen]


def test_a_cfs_quota_moves_the_tail_and_leaves_the_median():
    fault = Fault("leaf", "saturation", "single", 4.0, 10.0, {"quota": 0.6})  # 1.2 x its use
    result = simulate(chain_topology(), [fault], 10, 5)
    before, _ = _leaf(result, 0.5, 4)
    during, _ = _leaf(result, 4, 10)
    assert np.median(during) < 1.3 * np.median(before)
    # a few requests land after a burst spent the period's quota and wait for the next period
    assert 0.005 < np.mean(during > before.max()) < 0.2
    assert during.max() > 3 * before.max()


def test_a_fluid_capacity_cut_moves_the_median_as_much_as_the_tail():
    result = simulate(chain_topology(), [Fault("leaf", "saturation", "single", 4.0, 10.0, {"capacity": 0.5})], 10, 5)
    before, _ = _leaf(result, 0.5, 4)
    during, _ = _leaf(result, 4, 10)
    assert np.median(during) > 1.8 * np.median(before)


def test_a_cpu_hog_makes_requests_wait_before_the_server_span_starts():
    fault = Fault("leaf", "interference", "single", 3.0, 6.0, {"factor": 20, "slice_ms": 3})
    result = simulate(chain_topology(), [fault], 6, 2)
    before, gap_before = _leaf(result, 0.5, 3)
    during, gap_during = _leaf(result, 3.2, 6)
    assert np.median(during) > 3 * np.median(before)
    assert np.percentile(gap_during, 90) > np.percentile(gap_before, 90) + 1e6  # a slice's milliseconds
    after, _ = _leaf(simulate(chain_topology(), [fault], 8, 2), 7, 8)
    assert np.median(after) < 1.5 * np.median(before)  # the hog gone, the replica runs as before


def test_a_cpu_quota_or_hog_on_the_caller_makes_its_client_spans_end_late():
    """A throttled or hogged process reads a response only when it may run again: its client
    span to an unharmed callee outlasts the callee's server span by the wait (the testbed showed
    it: a CPU fault on a service slows its client spans to its stores, which no fault touched).
    A pause does not (kept out so that the data of the fluid campaigns stay as they were)."""
    def return_gaps(faults, since_s, until_s):
        result = simulate(chain_topology(), faults, 6, 2)
        key = result.op_keys.index("leaf:compute")
        spans = result.visit_span[result.visit_key == key]
        client = result.span_parent[spans]
        chosen = (result.span_start[spans] >= since_s * 1e9) & (result.span_start[spans] < until_s * 1e9)
        return (result.span_end[client] - result.span_end[spans])[chosen]

    quiet = return_gaps([], 3.2, 6)
    hogged = return_gaps([Fault("mid", "interference", "single", 3.0, 6.0, {"factor": 20, "slice_ms": 3})], 3.2, 6)
    throttled = return_gaps([Fault("mid", "saturation", "single", 3.0, 6.0, {"quota": 0.5})], 3.2, 6)
    paused = return_gaps([Fault("mid", "background", "single", 3.0, 6.0, {"pause_ms": 50, "every_ms": 200})], 3.2, 6)
    assert np.percentile(hogged, 90) > np.percentile(quiet, 90) + 1e6  # a slice's milliseconds
    # below its use, the quota runs out in some periods: a response landing then waits for the next
    assert (quiet > 1e6).sum() == 0 and (throttled > 1e6).sum() >= 0.05 * len(throttled)
    assert paused.max() < 1e6  # a pause stops the caller's calls, not its reads


def test_scheduler_campaigns_plan_quota_and_hog_faults():
    topology = load_topology("socialnet")
    for name in ("single-scheduler", "multiple-scheduler", "callers-scheduler"):
        faults = plan_faults(load_scenario(name), topology, np.random.default_rng(0))
        cpu = [f for f in faults if f.source in ("saturation", "interference")]
        assert cpu and all("quota" in f.parameters or "slice_ms" in f.parameters for f in cpu)


def test_a_bootstrap_shards_one_episode_holds_dozens_of_faults():
    """A bootstrap's latency shard keeps its traces from one episode: with ten faults the GNN's
    testbed ranking swung with which services drew them (docs/issue-12.md, session 27)."""
    topology = load_topology("socialnet")
    counts = {name: len(plan_faults(load_scenario(name), topology, np.random.default_rng(0)))
              for name in ("single-scheduler", "multiple-scheduler", "callers-scheduler")}
    assert counts["single-scheduler"] >= 20 and counts["multiple-scheduler"] >= 40 and counts["callers-scheduler"] >= 20


def test_the_callers_campaign_starves_only_services_that_call_stores():
    topology = load_topology("socialnet")
    callers = store_callers(topology)
    stores = {name for name, service in topology.services.items() if service.storage}
    assert "post-storage-service" in callers and not callers & stores and "nginx-web-server" not in callers
    faults = plan_faults(load_scenario("callers-scheduler"), topology, np.random.default_rng(0))
    assert {f.service for f in faults} <= callers and len({f.service for f in faults}) >= 4
    assert {f.source for f in faults} == {"interference", "saturation"}


def test_a_callers_campaign_plans_no_fault_where_no_service_calls_a_store():
    from bmeg.faultinject.spec import parse_topology

    shop = parse_topology(SHOP_SPEC)
    assert store_callers(shop) == set()
    assert plan_faults(load_scenario("callers-scheduler"), shop, np.random.default_rng(0)) == []
    assert store_callers(chain_topology()) == {"mid"}  # a cache lookup and a call on its miss


def test_a_negative_quota_is_refused():
    scenario = {"name": "bad", "kind": "single", "duration_s": 5,
                "faults": [{"service": "leaf", "source": "saturation", "start_s": 1, "duration_s": 1,
                            "parameters": {"quota": -0.5}}]}
    with pytest.raises(Exception, match="must not be negative"):
        parse_scenario(scenario)


def test_bootstrap_refuses_an_unknown_cpu_fault_model(tmp_path):
    from bmeg.evaluation.bootstrap import bootstrap

    with pytest.raises(ValueError, match="cpu_faults must be one of fluid, scheduler"):
        bootstrap(tmp_path / "none.parquet", tmp_path / "run", cpu_faults="slow")
