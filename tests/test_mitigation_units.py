"""Planner, catalogue, tuner, safety guard and audit log, without a cluster."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.diagnosis import CriticalPathStep, Diagnosis, ServiceLatency, ServiceScore, TraceDiagnosis
from bmeg.mitigation import (
    AuditLog, CatalogueError, Controller, Guard, HybridBandit, Latencies, SafetyPolicy, ServiceTelemetry, judge, load_catalogue, plan, tune, with_hints,
)
from bmeg.cluster.catalogue import Parameter, parse_catalogue
from bmeg.mitigation.planner import Decision, gather_evidence, quantile_of_sorted
from bmeg.mitigation.safety import improved
from bmeg.mitigation.tuning import search_around
from builders import SLOW, FakeExecutor, service_diagnosis

CATALOGUE = load_catalogue()





# ---- catalogue -------------------------------------------------------------------------------
def test_catalogue_holds_the_design_parameters() -> None:
    assert CATALOGUE.parameter("nginx-web-server", "worker_processes").max == 48
    pool = CATALOGUE.parameter("social-graph-service", "io_threadpool_size")
    assert (pool.min, pool.max, pool.default, pool.change) == (1, 48, 13, "restart")
    memory = CATALOGUE.parameter("post-storage-memcached", "memory_mb")
    assert (memory.min, memory.max, memory.default, memory.scale) == (32, 20480, 64, "log")
    assert CATALOGUE.parameter("user-timeline-redis", "hz").default == 10
    assert CATALOGUE.parameter("social-graph-redis", "zset-max-ziplist-entries").default == 128
    assert CATALOGUE.parameter("post-storage-mongodb", "block_compressor").downtime_s == 8


def test_bad_catalogue_names_the_field() -> None:
    bad = {"kinds": {"x": {"match": ["*"], "parameters": {"p": {
        "type": "integer", "min": 5, "max": 1, "default": 3, "change": "reload", "downtime_s": 0, "env": "P"}}}}}
    with pytest.raises(CatalogueError, match="kinds.x.parameters.p"):
        parse_catalogue(bad, "test.yaml")


@given(st.floats(0, 1))
def test_unit_mapping_round_trips(unit: float) -> None:
    memory = CATALOGUE.parameter("post-storage-memcached", "memory_mb")
    value = memory.from_unit(unit)
    assert 32 <= value <= 20480
    assert memory.from_unit(memory.to_unit(value)) == value


# ---- planner ---------------------------------------------------------------------------------
def test_saturation_scales_out_a_stateless_service() -> None:
    [decision] = plan(service_diagnosis("compose-post-service", SLOW), CATALOGUE,
                      {"compose-post-service": ServiceTelemetry(cpu_utilization=0.95, replicas=2)})
    assert (decision.source, decision.action, decision.target) == ("saturation", "scale_out", {"replicas": 4})
    assert "95%" in decision.reason


def test_saturation_scales_up_a_store() -> None:
    [decision] = plan(service_diagnosis("social-graph-redis", SLOW), CATALOGUE,
                      {"social-graph-redis": ServiceTelemetry(cpu_utilization=0.9, replicas=1, cpu_limit_cores=1)})
    assert (decision.source, decision.action) == ("saturation", "scale_up")
    assert decision.target["cpu_cores"] == pytest.approx(1.5)


def test_a_well_used_limit_under_one_core_is_raised() -> None:
    telemetry = ServiceTelemetry(cpu_utilization=0.55, replicas=4, cpu_limit_cores=0.12)
    [decision] = plan(service_diagnosis("post-storage-service", SLOW), CATALOGUE, {"post-storage-service": telemetry})
    assert (decision.source, decision.action, decision.target) == ("saturation", "scale_up", {"cpu_cores": 1.0})
    assert "throttles" in decision.reason


def test_idle_service_with_a_tiny_pool_is_retuned() -> None:
    telemetry = ServiceTelemetry(cpu_utilization=0.2, replicas=1, parameters={"io_threadpool_size": 1})
    [decision] = plan(service_diagnosis("social-graph-service", SLOW), CATALOGUE, {"social-graph-service": telemetry})
    assert (decision.source, decision.action, decision.target) == ("misconfiguration", "retune", {"io_threadpool_size": 13})
    assert "io_threadpool_size = 1" in decision.reason


def test_idle_service_with_one_slow_replica_is_moved() -> None:
    telemetry = ServiceTelemetry(cpu_utilization=0.3, replicas=3, parameters={"io_threadpool_size": 13},
                                 replica_p95_ms=[5, 5.5, 20])
    [decision] = plan(service_diagnosis("user-service", SLOW), CATALOGUE, {"user-service": telemetry})
    assert (decision.source, decision.action) == ("interference", "migrate")
    assert "noisy neighbour" in decision.reason


def test_tail_without_median_is_a_background_task() -> None:
    ratios = [1.0] * 300 + [12.0, 15.0]  # two GC-hit traces out of 302
    [decision] = plan(service_diagnosis("user-timeline-service", ratios), CATALOGUE)
    assert (decision.source, decision.action) == ("background", "shed")


def test_without_telemetry_the_source_is_unknown_and_confidence_lower() -> None:
    [unknown] = plan(service_diagnosis("text-service", SLOW), CATALOGUE)
    [known] = plan(service_diagnosis("text-service", SLOW), CATALOGUE, {"text-service": ServiceTelemetry(cpu_utilization=0.95)})
    assert unknown.source == "unknown" and unknown.action == "scale_out"
    assert unknown.confidence < known.confidence


def test_hints_land_on_the_anomalous_traces() -> None:
    diagnosis = service_diagnosis("text-service", [3.0, 1.0])
    hinted = with_hints(diagnosis, plan(diagnosis, CATALOGUE))
    assert [h.action for h in hinted.traces[0].mitigations] == ["scale_out"]
    assert hinted.traces[1].mitigations == []


# ---- tuner -----------------------------------------------------------------------------------
def _noisy_objective(pool: Parameter, hz: Parameter, rng: np.random.Generator):
    def measure(config) -> list[float]:  # p95 ms on 3 replicas, 5% noise; best at pool 0.6, hz 0.3
        base = 10 + 400 * (pool.to_unit(config["pool"]) - 0.6) ** 2 + 300 * (hz.to_unit(config["hz"]) - 0.3) ** 2
        base += 0 if config["compression"] == "zstd" else 5
        return list(base * (1 + 0.05 * rng.standard_normal(3)))
    return measure


def test_hybrid_bandit_improves_a_noisy_objective() -> None:
    pool = Parameter(name="pool", type="integer", min=1, max=48, default=13, change="restart", downtime_s=1, env="P")
    hz = Parameter(name="hz", type="integer", min=1, max=100, default=10, change="reload", downtime_s=0, env="H")
    compression = Parameter(name="compression", type="categorical", choices=["none", "snappy", "zstd"], default="none",
                            change="restart", downtime_s=8, env="C")
    start = {"pool": 1, "hz": 90, "compression": "none"}
    measure = _noisy_objective(pool, hz, np.random.default_rng(3))
    start_worst = judge(measure(start)).worst
    bandit = HybridBandit([pool, hz, compression], start, seed=1)
    best = tune(bandit, measure, steps=120)
    assert best is not None and best.judgement.worst < 0.25 * start_worst
    centre = bandit.centre_configuration()
    assert abs(pool.to_unit(centre["pool"]) - 0.6) < abs(pool.to_unit(1) - 0.6)


def test_judge_scores_the_worst_replica_and_flags_instability() -> None:
    stable = judge([10, 11, 12])
    assert stable.worst == 12 and not stable.unstable
    assert judge([10, 10, 20]).unstable  # relative range 10/13.3 > 0.3
    with pytest.raises(ValueError):
        judge([])


# ---- safety ----------------------------------------------------------------------------------
def _decision(confidence: float = 0.9, service: str = "a", replicas: int = 50) -> Decision:
    return Decision(service, "saturation", "scale_out", confidence, "why", {"replicas": replicas})


def test_guard_threshold_cooldown_budget_and_limits() -> None:
    guard = Guard(SafetyPolicy(confidence_threshold=0.5, cooldown_s=100, actions_per_hour=2, max_replicas=6))
    assert "below the threshold" in guard.refusal(_decision(0.3), 0)
    assert guard.clamp(_decision()) == {"replicas": 6}
    guard.record("a", 0)
    assert "cooling down" in guard.refusal(_decision(), 50)
    assert guard.refusal(_decision(), 150) is None
    guard.record("b", 10)
    assert "budget" in guard.refusal(_decision(service="c"), 200)
    assert guard.refusal(_decision(service="c"), 3601) is None


def test_improvement_needs_service_and_application() -> None:
    before = Latencies(100, {"a": 50})
    assert improved("a", before, Latencies(80, {"a": 30}), 0.05)[0]
    assert not improved("a", before, Latencies(99, {"a": 30}), 0.05)[0]


def test_controller_rolls_back_an_action_that_did_not_help() -> None:
    executor, audit = FakeExecutor(), AuditLog()
    controller = Controller(executor, CATALOGUE, SafetyPolicy(dry_run=False, verify_after_s=30, confidence_threshold=0.1), audit)
    diagnosis = service_diagnosis("a", SLOW)
    [outcome] = controller.handle(diagnosis, now=0, latencies=Latencies(100, {"a": 60}),
                                  telemetry={"a": ServiceTelemetry(cpu_utilization=0.9, replicas=2)})
    assert outcome.status == "applied" and executor.replicas["a"] == 3
    assert controller.verify(10, Latencies(100, {"a": 60})) == []  # not due yet
    [(_, good, _)] = controller.verify(40, Latencies(98, {"a": 59}))
    assert not good and executor.replicas["a"] == 2
    assert [r.kind for r in audit.records()] == ["decision", "action", "verification", "rollback"]


def test_dry_run_changes_nothing() -> None:
    executor, audit = FakeExecutor(), AuditLog()
    controller = Controller(executor, CATALOGUE, SafetyPolicy(confidence_threshold=0.1), audit)
    [outcome] = controller.handle(service_diagnosis("a", SLOW), now=0, telemetry={"a": ServiceTelemetry(cpu_utilization=0.9, replicas=2)})
    assert outcome.status == "dry-run" and executor.replicas["a"] == 2
    assert audit.records(kind="action")[0].dry_run


def test_shedding_is_advice_not_an_action() -> None:
    executor, audit = FakeExecutor(), AuditLog()
    controller = Controller(executor, CATALOGUE, SafetyPolicy(dry_run=False, confidence_threshold=0.1), audit)
    [outcome] = controller.handle(service_diagnosis("a", [1.0] * 990 + [6.0] * 10), now=0,
                                  telemetry={"a": ServiceTelemetry(cpu_utilization=0.3, replicas=2)})
    assert (outcome.decision.action, outcome.status) == ("shed", "advice") and executor.replicas["a"] == 2
    assert [(r.kind, r.outcome) for r in audit.records()][-1] == ("refused", "advice for an operator")


# ---- audit -----------------------------------------------------------------------------------
@settings(max_examples=20)
@given(st.lists(st.sampled_from(["decision", "action", "refused"]), min_size=1, max_size=10))
def test_audit_keeps_every_record_in_order(kinds: list[str]) -> None:
    audit = AuditLog()
    for i, kind in enumerate(kinds):
        audit.append(kind, "svc", "scale_out", f"o{i}", dry_run=True, details={"i": i})
    records = audit.records()
    assert [r.kind for r in records] == kinds and [r.details["i"] for r in records] == list(range(len(kinds)))
    assert len(audit.records(limit=1)) == 1 and audit.records(limit=1)[0].details["i"] == len(kinds) - 1


def test_audit_is_append_only(tmp_path) -> None:
    audit = AuditLog(tmp_path / "audit.sqlite")
    audit.append("action", "svc", "scale_out", "applied", dry_run=False)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        audit._db.execute("DELETE FROM audit")
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        audit._db.execute("UPDATE audit SET outcome = 'x'")
    assert len(AuditLog(tmp_path / "audit.sqlite").records()) == 1


# ---- evidence from the critical path ---------------------------------------------------------
def _path_trace(i: int, steps: list[tuple[str, str, float]], scores: dict[str, float],
                baselines: dict[str, float]) -> TraceDiagnosis:
    """An anomalous trace with a critical path of (service, operation, exclusive µs) steps."""
    return TraceDiagnosis(
        trace_id=f"p{i}", spans=len(steps), total_us=sum(us for *_, us in steps), anomalous=True, anomaly_score=0.9,
        threshold=0.5, model="gnn",
        bottlenecks=[ServiceScore(service=s, score=v, bottleneck=v >= 0.5) for s, v in scores.items()],
        critical_path=[CriticalPathStep(service=s, operation=o, exclusive_us=us) for s, o, us in steps],
        latencies=[ServiceLatency(service=s, latency_us=b, baseline_us=b, ratio=1.0) for s, b in baselines.items()],
    )


BASELINES = {"nginx-web-server": 900, "home-timeline-service": 400, "home-timeline-redis": 200}


def test_a_callers_wait_is_blamed_on_the_callee_with_the_callers_score() -> None:
    # nginx's client span waits 5 ms in home-timeline's queue: the model flags nginx, the wait is home-timeline's
    steps = [("nginx-web-server", "/read", 800), ("nginx-web-server", "read_client", 5000),
             ("home-timeline-service", "read_server", 400), ("home-timeline-redis", "find_client", 210)]
    traces = [_path_trace(i, steps, {"nginx-web-server": 0.95, "home-timeline-service": 0.2}, BASELINES) for i in range(10)]
    [evidence] = gather_evidence(Diagnosis(model_version="t", application="socialnet", traces=traces))
    assert (evidence.service, evidence.share) == ("home-timeline-service", 1.0)
    assert evidence.score == pytest.approx(0.95)
    assert evidence.median_ratio == pytest.approx(5400 / 400)  # the wait counts in its ratio too


def test_a_slow_store_below_takes_the_blame_but_a_store_at_its_baseline_does_not() -> None:
    slow_store = [("nginx-web-server", "/read", 800), ("nginx-web-server", "read_client", 50),
                  ("home-timeline-service", "read_server", 3000), ("home-timeline-redis", "find_client", 2000)]
    [evidence] = gather_evidence(Diagnosis(model_version="t", application="socialnet", traces=[
        _path_trace(0, slow_store, {"home-timeline-redis": 0.9}, BASELINES)]))
    assert evidence.service == "home-timeline-redis"  # 10x its baseline and a third of its caller's growth
    quiet_store = slow_store[:3] + [("home-timeline-redis", "find_client", 250)]
    [evidence] = gather_evidence(Diagnosis(model_version="t", application="socialnet", traces=[
        _path_trace(0, quiet_store, {"home-timeline-service": 0.9}, BASELINES)]))
    assert evidence.service == "home-timeline-service"


def test_requests_queued_at_the_entry_are_blamed_on_the_slow_service_below() -> None:
    below = [("nginx-web-server", "/read", 800), ("nginx-web-server", "read_client", 5000),
             ("home-timeline-service", "read_server", 400)]
    queued = [("nginx-web-server", "/read", 9000), ("nginx-web-server", "read_client", 50),
              ("home-timeline-service", "read_server", 400)]
    traces = [_path_trace(i, below, {"nginx-web-server": 0.9}, BASELINES) for i in range(4)] \
        + [_path_trace(10 + i, queued, {"nginx-web-server": 0.3}, BASELINES) for i in range(6)]
    [evidence] = gather_evidence(Diagnosis(model_version="t", application="socialnet", traces=traces))
    assert (evidence.service, evidence.share, evidence.via_callers) == ("home-timeline-service", 1.0, 0.6)
    assert evidence.score == pytest.approx(0.9)  # the model's score where the cause is visible
    assert "60% of them through callers queueing on it" in plan(
        Diagnosis(model_version="t", application="socialnet", traces=traces), CATALOGUE)[0].reason


def test_a_service_at_its_baseline_gets_no_action() -> None:
    [decision] = plan(service_diagnosis("social-graph-service", [1.1] * 18 + [2.0] * 2), CATALOGUE,
                      {"social-graph-service": ServiceTelemetry(cpu_utilization=0.2, replicas=1)})
    assert (decision.action, decision.confidence) == ("none", 0.0)
    assert "near its baseline" in decision.reason


def test_one_slow_replica_of_two_is_moved() -> None:
    telemetry = ServiceTelemetry(cpu_utilization=0.2, replicas=2, replica_p95_ms=[2.0, 16.0])
    [decision] = plan(service_diagnosis("post-storage-service", SLOW), CATALOGUE, {"post-storage-service": telemetry})
    assert (decision.source, decision.action) == ("interference", "migrate")
    assert "8.0x slower than the others" in decision.reason


def test_online_search_moves_a_bad_pool_size_to_a_good_one() -> None:
    pool = CATALOGUE.parameter("home-timeline-service", "io_threadpool_size")
    rng = np.random.default_rng(0)

    def measure(value: float) -> list[float]:  # three replicas
        return list(8 + 40 / value + rng.normal(0, 0.2, 3))

    best = search_around(pool, 1, measure)
    assert best is not None and best.values["io_threadpool_size"] >= 8
    assert best.judgement.worst < 14 and not best.judgement.unstable
    with pytest.raises(ValueError, match="categorical"):
        search_around(CATALOGUE.parameter("post-storage-mongodb", "block_compressor"), 0, measure)


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=50), st.sampled_from([0.0, 0.5, 0.9, 0.999, 1.0]))
def test_the_hints_quantile_is_numpys(values, q):
    assert quantile_of_sorted(sorted(values), q) == pytest.approx(float(np.quantile(values, q)), rel=1e-12, abs=1e-9)
