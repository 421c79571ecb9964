"""The closed loop on the simulator: the simulated executor, the fallback detector, the
Kafka feed's message handling, and the CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from builders import ReadOnlyDeployments, one_diagnosis

from bmeg.cli import main
from bmeg.faultinject import Fault, calibrate, load_topology, parse_scenario
from bmeg.mitigation import AuditLog, Controller, SafetyPolicy, load_catalogue, load_policy
from bmeg.mitigation.closed_loop import LoopSettings, SlowestLeafDetector, _last_kept_action_s, run_closed_loop
from bmeg.mitigation.feed import consume, diagnosis_latencies, encode, handle_message
from bmeg.mitigation.planner import Decision
from bmeg.mitigation.simulated import SimulatedApp

CATALOGUE = load_catalogue()
SCENARIOS = ["saturation", "interference", "misconfiguration", "cascading"]


@pytest.fixture(scope="module")
def socialnet():
    topology = load_topology("socialnet")
    return topology, calibrate(topology, 0, duration_s=5.0)


def test_a_change_overrides_the_fault_and_rollback_restores_it(socialnet) -> None:
    topology, thresholds = socialnet
    fault = Fault("home-timeline-service", "misconfiguration", "single", 0.0, 20.0, {"pool_size": 1})
    app = SimulatedApp(topology, [fault], CATALOGUE, thresholds)
    broken = app.run_window(0, 2)
    assert broken.telemetry["home-timeline-service"].parameters == {"io_threadpool_size": 1.0}
    pool = CATALOGUE.parameter("home-timeline-service", "io_threadpool_size")
    applied = app.set_parameter("home-timeline-service", pool, 13)
    assert applied.previous == {"io_threadpool_size": 1.0}
    fixed = app.run_window(2, 4)
    assert fixed.telemetry["home-timeline-service"].parameters == {"io_threadpool_size": 13.0}
    assert fixed.latencies.service_p95_ms["home-timeline-service"] < broken.latencies.service_p95_ms["home-timeline-service"] / 3
    app.rollback(applied)
    assert app.run_window(4, 6).telemetry["home-timeline-service"].parameters == {"io_threadpool_size": 1.0}


def test_interference_does_not_raise_utilization_but_skews_replicas(socialnet) -> None:
    topology, thresholds = socialnet
    fault = Fault("post-storage-service", "interference", "single", 0.0, 10.0, {"factor": 8, "replicas": 1})
    normal = SimulatedApp(topology, [], CATALOGUE, thresholds).run_window(0, 2).telemetry["post-storage-service"]
    noisy = SimulatedApp(topology, [fault], CATALOGUE, thresholds).run_window(0, 2).telemetry["post-storage-service"]
    assert noisy.cpu_utilization == pytest.approx(normal.cpu_utilization, rel=0.2)
    slow, fast = sorted(noisy.replica_p95_ms, reverse=True)
    assert slow > 3 * fast


@dataclass
class _Window:
    service_latency: pd.DataFrame


def test_slowest_leaf_blames_the_deepest_slow_service() -> None:
    rows = [(t, "nginx", 900.0) for t in range(50)] + [(t, "timeline", 400.0) for t in range(50)] \
        + [(t, "cache", 1.0) for t in range(50)]
    window = _Window(pd.DataFrame(rows, columns=["trace", "service", "us"]).assign(us=lambda f: f.us * 1e3))
    detector = SlowestLeafDetector("app", {"nginx": 2000.0, "timeline": 700.0, "cache": 1000.0})
    ranking = detector.diagnose_window(window, {("nginx", "timeline"), ("timeline", "cache")}).ranking
    assert [(r.service, r.bottleneck) for r in ranking] == [("timeline", True), ("nginx", False), ("cache", False)]


def test_short_closed_loop_retunes_and_recovers() -> None:
    scenario = parse_scenario({"name": "pool", "kind": "single", "duration_s": 12, "faults": [
        {"service": "home-timeline-service", "source": "misconfiguration", "start_s": 1, "duration_s": 11,
         "parameters": {"pool_size": 1}}]})
    policy = load_policy(dry_run=False, cooldown_s=5, verify_after_s=2.5, actions_per_hour=100)
    report = run_closed_loop(load_topology("socialnet"), scenario, CATALOGUE, policy,
                             LoopSettings(window_s=2.5, normal_s=5.0))
    applied = [a for a in report.actions if a["status"] == "applied"]
    assert applied[0]["service"] == "home-timeline-service" and applied[0]["action"] == "retune"
    assert report.p95_mitigated_ms < report.p95_fault_ms
    assert report.p95_hpa_ms == pytest.approx(report.p95_fault_ms)  # CPU is idle: the HPA does nothing
    assert report.recovery_s is not None


@pytest.mark.integration
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cli_closed_loop_beats_no_mitigation(scenario: str) -> None:
    result = CliRunner().invoke(main, ["mitigate", "--sim", "socialnet", "--scenario", scenario, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {"p95_normal_ms", "p95_fault_ms", "p95_mitigated_ms", "p95_hpa_ms", "recovery_s", "actions"} <= set(report)
    assert report["p95_mitigated_ms"] < 0.7 * report["p95_fault_ms"]
    assert report["p95_mitigated_ms"] <= report["p95_hpa_ms"] * 1.05
    assert report["recovery_s"] is not None
    assert any(a["status"] == "applied" for a in report["actions"])


# ---- the Kafka feed, without a broker ---------------------------------------------------------
def test_feed_handles_a_diagnosis_and_audits_a_bad_message() -> None:
    audit = AuditLog()
    controller = Controller(ReadOnlyDeployments(), CATALOGUE, SafetyPolicy(confidence_threshold=0.3), audit)
    [outcome] = handle_message(controller, encode(one_diagnosis()), now=1.0)
    assert outcome.status == "dry-run" and outcome.decision.target == {"replicas": 3}
    assert handle_message(controller, b"{not json", now=2.0) == []
    assert audit.records(kind="error")[0].outcome.startswith("not a Diagnosis")
    assert diagnosis_latencies(one_diagnosis()).app_p95_ms == pytest.approx(40.0)


def test_feed_skips_a_stale_diagnosis() -> None:
    audit = AuditLog()
    controller = Controller(ReadOnlyDeployments(), CATALOGUE, SafetyPolicy(confidence_threshold=0.3), audit)
    old = one_diagnosis()
    old.traces[0].start_time = datetime.fromtimestamp(1_000.0, tz=UTC)
    assert handle_message(controller, encode(old), now=1_000.0 + 301) == []  # the default limit: 300 s
    assert audit.records(kind="refused")[0].outcome.startswith("stale: 301 s old")
    assert handle_message(controller, encode(one_diagnosis()), now=5_000.0, published_at=4_000.0) == []  # by the record's time
    [outcome] = handle_message(controller, encode(old), now=1_010.0)
    assert outcome.decision.target == {"replicas": 3}


def test_cli_log_and_plan(tmp_path) -> None:
    audit_path = tmp_path / "audit.sqlite"
    AuditLog(audit_path).append("action", "text-service", "scale_out", "dry-run", dry_run=True, details={"x": 1})
    runner = CliRunner()
    result = runner.invoke(main, ["mitigate", "log", "--audit", str(audit_path), "--json"])
    assert result.exit_code == 0, result.output
    [record] = json.loads(result.output)
    assert (record["service"], record["outcome"], record["dry_run"]) == ("text-service", "dry-run", True)
    missing = runner.invoke(main, ["mitigate", "log", "--audit", str(tmp_path / "none.sqlite")])
    assert missing.exit_code != 0 and "no audit log" in missing.output
    diagnosis_file = tmp_path / "d.json"
    diagnosis_file.write_text(one_diagnosis().model_dump_json())
    planned = runner.invoke(main, ["mitigate", "plan", str(diagnosis_file), "--json"])
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.output)[0]["action"] == "scale_out"
    diagnosis_file.write_text("[]")
    assert "bad input" in runner.invoke(main, ["mitigate", "plan", str(diagnosis_file)]).output


@pytest.mark.integration
def test_feed_consumes_diagnoses_from_kafka(kafka_bootstrap: str) -> None:
    from kafka import KafkaProducer

    topic = f"bmeg.mitigations.test-{np.random.default_rng().integers(1 << 30)}"
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    producer.send(topic, b"not a diagnosis", key=b"socialnet")  # one key: one partition, in order
    producer.send(topic, encode(one_diagnosis()), key=b"socialnet")
    producer.flush()
    producer.close()
    audit = AuditLog()
    controller = Controller(ReadOnlyDeployments(), CATALOGUE, SafetyPolicy(confidence_threshold=0.3), audit)
    handled = list(consume(controller, kafka_bootstrap, topic, group=topic, max_messages=2, idle_timeout_s=30,
                           offset_reset="earliest"))  # a new group starts at the end by default
    assert [len(outcomes) for outcomes in handled] == [0, 1]
    assert [r.kind for r in audit.records()] == ["error", "decision", "action"]


def test_tuner_driven_retune_removes_the_pool_bottleneck(socialnet) -> None:
    topology, thresholds = socialnet
    pool_of_one = Fault("home-timeline-service", "misconfiguration", "single", 1.0, 20.0, {"pool_size": 1})
    app = SimulatedApp(topology, [pool_of_one], CATALOGUE, thresholds)
    normal = app.run_window(0.0, 1.0).p95_ms
    faulty = app.run_window(2.0, 4.0)
    controller = Controller(app, CATALOGUE, SafetyPolicy(dry_run=False), AuditLog())
    decision = Decision("home-timeline-service", "misconfiguration", "retune", 0.9, "a pool of one", {"io_threadpool_size": 13})
    outcome = controller._act(decision, 4.0, faulty.latencies)
    assert outcome.status == "applied" and "online search" in outcome.detail
    [record] = controller.audit.records(kind="action")
    tried = record.details["search"]
    assert len(tried) == 6 and all(len(t["p95_ms"]) == 3 for t in tried)  # bounded, each on three replicas
    pool = outcome.applied.new["io_threadpool_size"]
    assert pool >= 4 and pool in {t["value"] for t in tried}
    after = app.run_window(4.0, 6.0).p95_ms
    assert after < 0.75 * faulty.p95_ms and after <= 1.2 * normal


def test_mitigated_p95_counts_from_the_last_kept_action() -> None:
    actions = [{"time_s": 20.0, "status": "applied", "rolled_back_s": 25.0}, {"time_s": 25.0, "status": "applied"},
               {"time_s": 30.0, "status": "refused"}]
    assert _last_kept_action_s(actions) == 25.0
    assert _last_kept_action_s([{"time_s": 20.0, "status": "refused"}]) is None
