"""The controller on a cluster, fed by the consumer's diagnoses from Kafka.

Each message on the topic (default `bmeg.mitigations`) is one JSON `Diagnosis`. For each, the
controller first verifies earlier actions against the latencies the diagnosis carries (the
application's p95 over its traces, each service's p95), then plans and acts with telemetry
read from the Deployments. A message that is not a valid Diagnosis is audited as an error
and skipped; offsets are committed after a message is handled. With `stop` (set when this
controller is no longer the leader, `bmeg.mitigation.leader`), no message is handled once it
is set: the next leader reads the uncommitted ones again.

A controller acts on the cluster as it is now: a group new to the topic starts at its end
(not at diagnoses of long ago), and a diagnosis older than `max_age_s` (its newest trace's
start time, else the record's timestamp) is audited as stale and skipped, e.g. a backlog
left while the controller was down.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np
from pydantic import ValidationError

from bmeg.diagnosis import Diagnosis
from bmeg.mitigation.controller import Controller, Outcome
from bmeg.cluster.executor import ActionError
from bmeg.mitigation.planner import ServiceTelemetry, gather_evidence
from bmeg.mitigation.safety import Latencies

DEFAULT_TOPIC = "bmeg.mitigations"
#: Older diagnoses describe a cluster that has moved on (and the controller's verification windows are minutes).
DEFAULT_MAX_AGE_S = 300.0


def diagnosis_latencies(diagnosis: Diagnosis) -> Latencies | None:
    """p95 of the traces' end-to-end latency and of each service's latency, in ms."""
    if not diagnosis.traces:
        return None
    per_service: dict[str, list[float]] = {}
    for trace in diagnosis.traces:
        for latency in trace.latencies:
            per_service.setdefault(latency.service, []).append(latency.latency_us)
    return Latencies(
        float(np.quantile([t.total_us for t in diagnosis.traces], 0.95)) / 1e3,
        {service: float(np.quantile(values, 0.95)) / 1e3 for service, values in per_service.items()},
    )


def cluster_telemetry(controller: Controller, diagnosis: Diagnosis) -> dict[str, ServiceTelemetry]:
    """What the Deployments say about the services the diagnosis names (no utilization: that
    needs a metrics API the controller's Role does not read)."""
    telemetry = {}
    for evidence in gather_evidence(diagnosis):
        try:
            state = controller.executor.state(evidence.service)
        except ActionError:
            continue  # not a Deployment here (e.g. a store run elsewhere): plan without telemetry
        telemetry[evidence.service] = ServiceTelemetry(replicas=state.replicas, cpu_limit_cores=state.cpu_cores,
                                                       memory_limit_mb=state.memory_mb, parameters=state.parameters)
    return telemetry


def diagnosis_age_s(diagnosis: Diagnosis, now: float, published_at: float | None) -> float | None:
    """Seconds since the newest trace of the diagnosis started, else since it was published."""
    starts = [trace.start_time.timestamp() for trace in diagnosis.traces if trace.start_time is not None]
    if starts:
        return now - max(starts)
    return None if published_at is None else now - published_at


def handle_message(controller: Controller, payload: bytes, now: float, published_at: float | None = None,
                   max_age_s: float = DEFAULT_MAX_AGE_S) -> list[Outcome]:
    try:
        diagnosis = Diagnosis.model_validate_json(payload)
    except (ValidationError, ValueError) as error:
        controller.audit.append("error", "-", "read diagnosis", f"not a Diagnosis: {str(error)[:500]}",
                                dry_run=controller.policy.dry_run, at=now)
        return []
    age = diagnosis_age_s(diagnosis, now, published_at)
    if age is not None and age > max_age_s:
        controller.audit.append("refused", "-", "read diagnosis", f"stale: {age:.0f} s old (limit {max_age_s:.0f} s)",
                                dry_run=controller.policy.dry_run, at=now)
        return []
    latencies = diagnosis_latencies(diagnosis)
    if latencies is not None:
        controller.verify(now, latencies)
    return controller.handle(diagnosis, now, latencies, cluster_telemetry(controller, diagnosis))


def consume(controller: Controller, bootstrap: str, topic: str = DEFAULT_TOPIC, group: str = "bmeg-mitigation",
            max_messages: int | None = None, idle_timeout_s: float | None = None,
            max_age_s: float = DEFAULT_MAX_AGE_S, offset_reset: str = "latest",
            stop: threading.Event | None = None) -> Iterator[list[Outcome]]:
    """Handle messages until `max_messages` (or forever); yields each message's outcomes."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                             auto_offset_reset=offset_reset,
                             consumer_timeout_ms=int(idle_timeout_s * 1000) if idle_timeout_s else float("inf"))
    try:
        yield from _handle_all(controller, consumer, max_messages, max_age_s, stop)
    finally:
        consumer.close()


def _handle_all(controller: Controller, consumer: Iterable, max_messages: int | None,
                max_age_s: float, stop: threading.Event | None = None) -> Iterator[list[Outcome]]:
    for count, message in enumerate(consumer, start=1):
        if stop is not None and stop.is_set():
            return
        published_at = message.timestamp / 1e3 if getattr(message, "timestamp", -1) >= 0 else None
        yield handle_message(controller, message.value, time.time(), published_at, max_age_s)
        consumer.commit()
        if max_messages is not None and count >= max_messages:
            return


def encode(diagnosis: Diagnosis) -> bytes:
    return json.dumps(diagnosis.model_dump(mode="json")).encode()
