"""Blame from traces still in flight (`bmeg.mitigation.inflight`) and verification against a
before-window measured again: span tables built by hand, no testbed."""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.diagnosis import Diagnosis, ServiceScore
from bmeg.mitigation import AuditLog, SafetyPolicy, load_catalogue
from bmeg.mitigation.closed_loop import controller_step
from bmeg.mitigation.inflight import (
    THROTTLED_SHARE,
    InFlightRule,
    censored_latency_ms,
    in_slow_traces,
    open_traces,
    saturation_diagnosis,
    stalled_beyond,
)
from bmeg.mitigation.planner import ServiceTelemetry, plan
from bmeg.mitigation.safety import Latencies
from bmeg.mitigation.simulated import Window
from bmeg.traces.schema import empty_span_table, span_table
from builders import SLOW, FakeExecutor, service_diagnosis

CATALOGUE = load_catalogue()

MS = 1_000_000
#: nginx -> home-timeline (-> redis, -> post-storage (-> memcached)); nginx -> compose
EDGES = {("nginx", "home-timeline"), ("home-timeline", "redis"), ("home-timeline", "post-storage"),
         ("post-storage", "memcached"), ("nginx", "compose")}
SERVICES = frozenset({"nginx", "home-timeline", "post-storage", "compose"})


def _spans(rows: list[tuple[str, str, str | None, str, str, int]]):
    """(trace, span, parent, service, kind, start ms) rows; every span lasts 1 ms."""
    return span_table({"trace_id": [r[0] for r in rows], "span_id": [r[1] for r in rows],
                       "parent_id": [r[2] for r in rows], "service": [r[3] for r in rows],
                       "operation": ["op"] * len(rows), "kind": [r[4] for r in rows],
                       "start_ns": [r[5] * MS for r in rows], "duration_ns": [MS] * len(rows)})


def test_open_traces_name_the_services_whose_spans_are_still_open() -> None:
    spans = _spans([
        # finished: its root arrived
        ("done", "r", None, "nginx", "server", 0), ("done", "c", "r", "nginx", "client", 1),
        # open: home-timeline's redis call ended, its server span (h) did not arrive; post-storage's
        # server span (p) arrived, its caller's client span did not (says nothing of the caller);
        # its memcached call arrived while p is here: not open
        ("open", "rc", "h", "home-timeline", "client", 12), ("open", "p", "hc", "post-storage", "server", 15),
        ("open", "mc", "p", "post-storage", "client", 16),
        # open, stuck below compose: compose's own client span's parent is compose's server span
        ("open2", "x", "cs", "compose", "client", 30),
    ])
    found = open_traces(spans).set_index("trace_id")
    assert sorted(found.index) == ["open", "open2"]
    assert found.loc["open", "first_ns"] == 12 * MS and found.loc["open", "stalled"] == ("home-timeline",)
    assert found.loc["open2", "stalled"] == ("compose",)
    assert open_traces(empty_span_table()).empty


def test_slow_finished_traces_name_their_services() -> None:
    spans = span_table({"trace_id": ["a", "a", "b", "b"], "span_id": ["r", "c", "r", "c"], "parent_id": [None, "r", None, "r"],
                        "service": ["nginx", "post-storage", "nginx", "compose"], "operation": ["op"] * 4,
                        "start_ns": [0] * 4, "duration_ns": [900 * MS, 800 * MS, 5 * MS, 4 * MS]})
    assert in_slow_traces(spans, slo_ms=30.0) == {"nginx", "post-storage"}
    assert in_slow_traces(empty_span_table(), slo_ms=30.0) == set()


def test_censored_latencies_are_lower_bounds_never_negative() -> None:
    assert censored_latency_ms(np.array([0, 500 * MS, 2000 * MS]), 1000 * MS).tolist() == [1000.0, 500.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 9000), st.floats(0.0, 0.9)), min_size=1, max_size=30),
       st.integers(0, 15000))
def test_an_open_traces_lower_bound_never_exceeds_its_latency(traces, visible_ms) -> None:
    """Spans that ended by `visible` have arrived (the lag assumption); then every open trace's
    lower bound is at most its true latency, and finished traces are not open."""
    rows, latency = [], {}
    for i, (start, length, at) in enumerate(traces):
        child_start, child_end = start + int(at * length), start + int(at * length) + max(1, length // 10)
        latency[f"t{i}"] = length
        for span, parent, kind, begin, end in (("r", None, "server", start, start + length),
                                               ("c", "r", "client", child_start, min(child_end, start + length))):
            if end <= visible_ms:
                rows.append({"trace_id": f"t{i}", "span_id": span, "parent_id": parent, "service": "svc",
                             "operation": "op", "kind": kind, "start_ns": begin * MS, "duration_ns": (end - begin) * MS})
    spans = span_table({k: [r[k] for r in rows] for k in rows[0]}) if rows else empty_span_table()
    found = open_traces(spans)
    for trace_id, first in zip(found["trace_id"], found["first_ns"]):
        assert censored_latency_ms(np.array([first]), visible_ms * MS)[0] <= latency[trace_id]
        assert traces[int(trace_id[1:])][0] + latency[trace_id] > visible_ms  # its root had not ended


def _open(stalled: list[tuple[str, ...]], latency_ms: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"trace_id": [f"t{i}" for i in range(len(stalled))], "first_ns": [0] * len(stalled),
                         "stalled": stalled, "latency_ms": latency_ms})


def test_a_throttled_callee_of_a_stalled_service_is_blamed() -> None:
    stalled = stalled_beyond(_open([("home-timeline",), ("compose",)], [900.0, 5.0]), slo_ms=30.0)
    assert stalled == {"home-timeline"}  # compose's open trace is still within the SLO
    throttled = {"post-storage": 0.9, "compose": 0.6, "home-timeline": 0.0}
    found = saturation_diagnosis("socialnet", 400.0, 30.0, stalled, EDGES, throttled, {}, SERVICES)
    assert found is not None and found.ranking is not None
    # compose is throttled too, but the slow traces do not wait on it
    assert [(s.service, s.score, s.bottleneck) for s in found.ranking] == [("post-storage", 1.0, True)]


def test_no_blame_while_the_slo_holds_or_when_throttling_is_normal() -> None:
    throttled = {"post-storage": 0.9}
    assert saturation_diagnosis("socialnet", 20.0, 30.0, {"home-timeline"}, EDGES, throttled, {}, SERVICES) is None
    # as throttled in the normal phase: its usual state, not the fault
    assert saturation_diagnosis("socialnet", 400.0, 30.0, {"home-timeline"}, EDGES, throttled,
                                {"post-storage": 0.9}, SERVICES) is None
    below = {"post-storage": THROTTLED_SHARE / 2}
    assert saturation_diagnosis("socialnet", 400.0, 30.0, {"home-timeline"}, EDGES, below, {}, SERVICES) is None
    # a store is not a candidate (not acted on) even when it is below the stalled service
    assert saturation_diagnosis("socialnet", 400.0, 30.0, {"post-storage"}, EDGES, {"memcached": 1.0}, {},
                                SERVICES) is None


class _Rule:
    """The finished-trace rule: blames `service` (None: nobody)."""

    def __init__(self, service: str | None):
        self.service, self.calls = service, 0

    def diagnose_window(self, window: Window, edges: set[tuple[str, str]]) -> Diagnosis:
        self.calls += 1
        ranking = [ServiceScore(service=self.service, score=1.0, bottleneck=True)] if self.service else []
        return Diagnosis(model_version="rule", application="socialnet", traces=[], ranking=ranking)


def _window(end_s: float, app_p95_ms: float, open_: pd.DataFrame | None = None,
            telemetry: dict[str, ServiceTelemetry] | None = None) -> Window:
    return Window(end_s - 4, end_s, empty_span_table(), np.zeros(0), np.zeros(0, dtype=bool),
                  Latencies(app_p95_ms, {"a": app_p95_ms / 2}), telemetry or {},
                  pd.DataFrame({"trace": [], "service": [], "us": []}), open_traces=open_)


def test_the_in_flight_rule_goes_first_and_the_finished_trace_rule_otherwise() -> None:
    rule = _Rule("compose")
    in_flight = InFlightRule("socialnet", rule, 30.0, EDGES, {}, SERVICES)
    telemetry = {"post-storage": ServiceTelemetry(cpu_throttled=0.8), "compose": ServiceTelemetry(cpu_throttled=0.0)}
    stuck = _window(8, 500.0, _open([("home-timeline",)], [2000.0]), telemetry)
    assert [s.service for s in in_flight.diagnose_window(stuck, set()).ranking or []] == ["post-storage"]
    assert rule.calls == 0
    for quiet in (_window(8, 500.0, None, telemetry), _window(8, 10.0, _open([("home-timeline",)], [2000.0]), telemetry)):
        assert [s.service for s in in_flight.diagnose_window(quiet, set()).ranking or []] == ["compose"]
    assert rule.calls == 2


def _verified(remeasure) -> str:
    """An action decided when its window's slow traces had not arrived (p95 50 ms seen), verified
    against a window after it whose p95 is 90 ms: what became of it."""
    executor = FakeExecutor()
    policy = SafetyPolicy(dry_run=False, verify_after_s=8, cooldown_s=8, confidence_threshold=0.1)
    step = controller_step(executor, CATALOGUE, policy, None, _Rule("a"), AuditLog(), remeasure=remeasure)
    busy = {"a": ServiceTelemetry(cpu_utilization=0.95, replicas=2)}
    [applied] = [r for r in step(_window(4, 50.0, telemetry=busy)) if r["status"] == "applied"]
    assert executor.replicas["a"] > 2
    [verdict] = [r for r in step(_window(12, 90.0, telemetry=busy)) if r["action"].startswith("verify")]
    return verdict["status"]


def test_verification_compares_with_the_before_window_as_known_at_verification() -> None:
    assert _verified(None) == "rolled back"  # 50 ms before, as first seen, against 90 after
    seen: list[float] = []

    def remeasure(window: Window) -> Latencies:
        seen.append(window.end_s)
        return Latencies(2000.0, {"a": 1000.0})  # its slow traces have arrived since

    assert _verified(remeasure) == "kept" and seen == [4]


def test_a_throttled_limit_under_one_core_is_raised_however_busy() -> None:
    """At its limit a stateless service is scaled out, unless its sub-core quota throttles it:
    then replicas with the same quota would stall alike, and the quota is raised."""
    service = "post-storage-service"
    busy = ServiceTelemetry(cpu_utilization=1.1, replicas=1, cpu_limit_cores=0.02)
    [decision] = plan(service_diagnosis(service, SLOW), CATALOGUE, {service: busy})
    assert decision.action == "scale_out"  # no throttling known: as before
    for throttled, action in ((0.6, "scale_up"), (THROTTLED_SHARE / 2, "scale_out")):
        [decision] = plan(service_diagnosis(service, SLOW), CATALOGUE,
                          {service: busy.model_copy(update={"cpu_throttled": throttled})})
        assert decision.action == action
    [decision] = plan(service_diagnosis(service, SLOW), CATALOGUE,
                      {service: busy.model_copy(update={"cpu_throttled": 0.6, "cpu_limit_cores": 2.0})})
    assert decision.action == "scale_out"  # a limit of cores: more replicas, as the HPA would
    [decision] = plan(service_diagnosis(service, SLOW), CATALOGUE, {service: busy.model_copy(update={"cpu_throttled": 0.6})})
    assert decision.target == {"cpu_cores": 1.0} and "60% of the CFS periods" in decision.reason
