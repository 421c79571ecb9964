"""The testbed closed loop's pure parts: settings checked, the report's windows and recovery,
and the CLI's errors for bad options (no testbed needed)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st

from bmeg.cli import main
from bmeg.faultinject.testbed.faults import hog_quota
from bmeg.mitigation.safety import SafetyPolicy
from bmeg.mitigation.testbed import (
    ArmRun,
    SCENARIOS,
    TestbedLoopSettings,
    _buckets,
    _recovery,
    _report,
    scenario_fault,
)

S = 1_000_000_000


def test_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="arms"):
        TestbedLoopSettings(arms=("bmeg", "vpa"))
    with pytest.raises(ValueError, match="arms"):
        TestbedLoopSettings(arms=())
    with pytest.raises(ValueError, match="no time to act"):
        TestbedLoopSettings(fault_s=15.0, window_s=4.0, history_s=8.0, lag_s=6.5)
    with pytest.raises(ValueError, match="history_s"):
        TestbedLoopSettings(window_s=4.0, history_s=2.0)
    with pytest.raises(ValueError, match="positive"):
        TestbedLoopSettings(window_s=0)


def test_policy_waits_for_a_window_of_traces_begun_after_the_action():
    policy = TestbedLoopSettings(window_s=4.0, history_s=8.0, lag_s=6.5).policy(SafetyPolicy())
    assert not policy.dry_run
    assert policy.verify_after_s == pytest.approx(14.5)
    assert policy.cooldown_s > policy.verify_after_s
    assert policy.one_change_at_a_time  # no new action while one is being verified


def test_a_hog_in_the_targets_cgroup_adds_its_core_to_the_quota():
    assert hog_quota(0.5) == pytest.approx(1.5)
    assert hog_quota(None) is None  # no limit stays no limit
    assert SCENARIOS["interference"].parameters.get("shared_cgroup") == 1.0
    # a pool of 1 where requests hold the worker across downstream calls (see SCENARIOS)
    assert SCENARIOS["misconfiguration"].service == "home-timeline-service"


def test_unknown_scenario_names_the_known_ones():
    with pytest.raises(ValueError, match="saturation"):
        scenario_fault("nope")
    assert {f.service for f in SCENARIOS.values()} and all(f.parameters for f in SCENARIOS.values())


def test_recovery_is_where_every_later_window_is_within_the_slo():
    windows = [(0.0, 50.0, 60.0), (4.0, 9.0, 9.0), (8.0, 30.0, 40.0), (12.0, 8.0, 9.0), (16.0, 7.0, 8.0)]
    assert _recovery(windows, 10.0) == 12.0
    assert _recovery(windows[:3], 10.0) is None
    assert _recovery([(0.0, 1.0, 1.0)], 10.0) == 0.0
    # an empty window (nan) is not within the SLO
    assert _recovery([(0.0, 1.0, 1.0), (4.0, float("nan"), float("nan"))], 10.0) is None


@hsettings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20 * S - 1), st.floats(0.1, 1e4)), min_size=1, max_size=200))
def test_buckets_cover_the_period_and_hold_their_traces(traces):
    start = np.array([t for t, _ in traces], dtype=np.int64)
    latency = np.array([ms for _, ms in traces])
    buckets = _buckets(start, latency, 0, 20 * S, 4.0)
    assert [at for at, _, _ in buckets] == [0.0, 4.0, 8.0, 12.0, 16.0]
    for at, p95, p99 in buckets:
        chosen = latency[(start >= at * S) & (start < (at + 4) * S)]
        assert np.isnan(p95) if len(chosen) == 0 else chosen.min() - 0.01 <= p95 <= p99 <= chosen.max() + 0.01


def test_report_compares_the_arms_on_the_same_seconds():
    # two arms: 10 s normal at 10 ms, 20 s of fault at 100 ms, the second arm back to 10 ms after 8 s
    rows, runs = [], []
    for index, arm in enumerate(("none", "bmeg")):
        base = index * 40 * S
        runs.append(ArmRun(arm, base, base + 10 * S, base + 30 * S, actions=[]))
        for tenth in range(300):
            at = base + tenth * S // 10
            slow = at >= base + 10 * S and (arm == "none" or at < base + 18 * S)
            rows.append((f"{arm}{tenth}", at, int((100 if slow else 10) * 1e6), "unset"))
    roots = pa.table({"trace_id": [r[0] for r in rows], "start_ns": [r[1] for r in rows],
                      "duration_ns": [r[2] for r in rows], "status": [r[3] for r in rows]})
    report = _report("saturation", SCENARIOS["saturation"], 10.0, TestbedLoopSettings(window_s=4.0), None, roots, runs)
    none, bmeg = report.arm("none"), report.arm("bmeg")
    assert none.p95_normal_ms == bmeg.p95_normal_ms == 10.0 and report.slo_ms == 15.0
    assert none.p95_late_ms == 100.0 and bmeg.p95_late_ms == 10.0
    assert none.p95_late_median_ms == 100.0 and bmeg.p95_late_median_ms == 10.0
    assert none.late_over_normal == 10.0 and bmeg.late_over_normal == 1.0
    assert none.slo_violation_s == 20 and bmeg.slo_violation_s == 8
    assert none.recovery_s is None and bmeg.recovery_s == 8.0
    assert none.traces == bmeg.traces == 200 and none.error_share == 0.0


@pytest.mark.parametrize("options, words", [
    (["--testbed", "socialnet", "--scenario", "nope"], "saturation"),
    (["--testbed", "socialnet", "--scenario", "saturation", "--arms", "none,vpa"], "arms"),
    (["--testbed", "socialnet", "--sim", "socialnet", "--scenario", "saturation"], "one of"),
])
def test_cli_bad_options_are_usage_errors(options, words):
    result = CliRunner().invoke(main, ["mitigate", *options])
    assert result.exit_code == 2, result.output
    assert words in result.output


def test_rule_on_a_real_machine_scores_excess_among_candidates():
    """A store slowed by the machine (10x, +20 ms) must not shrink the saturated service's score
    (3x, +8 ms) when only services can be acted on; a service seen in a handful of traces is left out."""
    import pandas as pd

    from bmeg.mitigation.closed_loop import SlowestLeafDetector
    from bmeg.mitigation.safety import Latencies
    from bmeg.mitigation.simulated import Window

    rows = [(t, "home-timeline-redis", 22_000.0) for t in range(40)] + [(t, "post-storage-service", 12_000.0) for t in range(40)]
    rows += [(t, "compose-post-service", 50_000.0) for t in range(5)]
    latency = pd.DataFrame(rows, columns=["trace", "service", "us"])
    window = Window(0.0, 8.0, pa.table({}), np.zeros(0), np.zeros(0, dtype=bool), Latencies(0.0, {}), {}, latency)
    baseline = {"home-timeline-redis": 2_000.0, "post-storage-service": 4_000.0, "compose-post-service": 5_000.0}
    rule = SlowestLeafDetector("socialnet", baseline, min_excess_us=5000.0, by_excess=True, min_samples=30,
                               candidates=frozenset({"post-storage-service", "compose-post-service"}))
    ranking = {s.service: s for s in rule.diagnose_window(window, set()).ranking}
    assert ranking["post-storage-service"].bottleneck and ranking["post-storage-service"].score == 1.0
    assert not ranking["home-timeline-redis"].bottleneck
    assert "compose-post-service" not in ranking
    plain = {s.service: s for s in SlowestLeafDetector("socialnet", baseline).diagnose_window(window, set()).ranking}
    assert plain["home-timeline-redis"].score == 1.0 and plain["post-storage-service"].score < 1.0


def test_a_store_that_cannot_be_acted_on_does_not_explain_its_caller_away():
    """A service short of CPU stretches its store calls (its client spans, the store's node) as
    much as its own time: with candidates, the service is blamed; without, the store."""
    import pandas as pd

    from bmeg.mitigation.closed_loop import SlowestLeafDetector
    from bmeg.mitigation.safety import Latencies
    from bmeg.mitigation.simulated import Window

    rows = [(t, "post-storage-memcached", 30_000.0) for t in range(40)] + [(t, "post-storage-service", 20_000.0) for t in range(40)]
    latency = pd.DataFrame(rows, columns=["trace", "service", "us"])
    window = Window(0.0, 8.0, pa.table({}), np.zeros(0), np.zeros(0, dtype=bool), Latencies(0.0, {}), {}, latency)
    baseline = {"post-storage-memcached": 500.0, "post-storage-service": 1_000.0}
    edges = {("post-storage-service", "post-storage-memcached")}
    rule = SlowestLeafDetector("socialnet", baseline, min_excess_us=5000.0, by_excess=True, min_samples=30,
                               candidates=frozenset({"post-storage-service"}))
    ranking = {s.service: s for s in rule.diagnose_window(window, edges).ranking}
    assert ranking["post-storage-service"].bottleneck and ranking["post-storage-service"].score == 1.0
    plain = {s.service: s for s in SlowestLeafDetector("socialnet", baseline).diagnose_window(window, edges).ranking}
    assert plain["post-storage-memcached"].bottleneck and not plain["post-storage-service"].bottleneck
