"""Traces the way platform teams send them: services instrumented with the real OpenTelemetry
Python SDK (defaults: the `BatchSpanProcessor`'s 5 s schedule), each in its own process with its
own `service.name`, export to the real OpenTelemetry Collector (`scripts/otelcol.sh`), whose
`kafka` exporter writes the topic `bmeg consume` reads. Every trace must come out as exactly
one whole diagnosis: 0 lost, 0 split, in both encodings (JSON carries no content-type header),
with and without `partition_traces_by_id`, and across a broker outage of 150 s.

The Collector binary comes from `BMEG_OTELCOL_BINARY` (scripts/test.sh builds it first) or
`scripts/otelcol.sh path`; each test writes its own config, ports and topics.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest_infra import Broker, Collector, free_port
from kafka import KafkaAdminClient, KafkaConsumer
from kafka.admin import NewTopic

from bmeg.diagnosis import Diagnosis
from bmeg.serving.consumer import ConsumerConfig, StreamConsumer
from serving_fixtures import traces_of

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SERVICE = Path(__file__).with_name("otel_sdk_service.py")
SERVICES = ["frontend", "search", "geo", "rate", "profile"]  # hotelreservation's, one process each


# -- the parts --------------------------------------------------------------------------------
def kafka_exporters(bootstrap: str, outputs: list[tuple[str, str, bool]]) -> dict:
    """One `kafka` exporter (v0.155.0 keys) per (topic, encoding, partition_traces_by_id)."""
    return {f"kafka/{i}": {"brokers": [bootstrap], "traces": {"topic": topic, "encoding": encoding},
                           "partition_traces_by_id": by_id}
            for i, (topic, encoding, by_id) in enumerate(outputs)}


def play(spans: pa.Table, work: Path, endpoint_of, rate: float, lead_s: float = 3.0) -> list[subprocess.Popen]:
    """Each service of `spans` in its own SDK process (gRPC and HTTP alternately), all on one
    schedule starting `lead_s` from now; `endpoint_of(protocol)` is where they export."""
    path = work / f"spans-{uuid.uuid4().hex[:6]}.parquet"
    pq.write_table(spans, path)
    start = time.time() + lead_s
    processes = []
    for i, service in enumerate(SERVICES):
        protocol = "grpc" if i % 2 else "http"
        processes.append(subprocess.Popen(
            [sys.executable, str(SERVICE), str(path), service, endpoint_of(protocol), "--protocol", protocol,
             "--rate", str(rate), "--start", str(start)],
            stdout=(work / f"{service}-{path.stem}.log").open("w"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}))
    return processes


def wait_all(processes: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        assert process.wait(max(1.0, deadline - time.monotonic())) == 0, process.args


def read_diagnoses(bootstrap: str, topic: str, expected: int, timeout_s: float) -> list[Diagnosis]:
    """Every diagnosis on `topic`, once `expected` distinct traces are in (or at the timeout) and
    two more seconds have brought no more (a split trace's second diagnosis would come then)."""
    reader = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    records: list = []
    deadline, quiet_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        batch = [r for part in reader.poll(timeout_ms=500).values() for r in part]
        records += batch
        if len({r.key for r in records}) >= expected:
            quiet_since = quiet_since if not batch and quiet_since else time.monotonic()
            if time.monotonic() - quiet_since >= 2:
                break
    reader.close()
    return [Diagnosis.model_validate_json(r.value) for r in records]


def lost_and_split(diagnoses: list[Diagnosis], spans: pa.Table) -> tuple[set[str], set[str]]:
    """Traces never diagnosed; traces diagnosed more than once, in part, or as partial."""
    expected = Counter(spans["trace_id"].to_pylist())
    seen = Counter(t.trace_id for d in diagnoses for t in d.traces)
    short = {t.trace_id for d in diagnoses for t in d.traces if t.spans != expected[t.trace_id] or t.partial}
    return set(expected) - set(seen), {t for t, n in seen.items() if n > 1} | short


def topic_name(label: str) -> str:
    return f"bmeg-otelcol-{label}-{uuid.uuid4().hex[:8]}"


# -- spans in, diagnoses out ------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["otlp_proto", "otlp_json"])
@pytest.mark.parametrize("by_id", [False, True], ids=["batches", "partition_traces_by_id"])
def test_sdk_services_through_the_collector_to_one_whole_diagnosis_per_trace(
        kafka_bootstrap, otelcol_binary, detector, hotel_dataset, tmp_path, encoding, by_id):
    """The Collector writes otlp_proto or otlp_json, with or without `partition_traces_by_id`; a
    consumer with the default assembly settings reads it. (One case per run: four consumers in
    one test process, on a loaded 2-core machine, once lost a whole topic to a group eviction.)"""
    trace_ids = hotel_dataset.traces["trace_id"].to_pylist()[300:550]
    spans = traces_of(hotel_dataset.spans, trace_ids)
    outputs = [(topic_name(f"{encoding}-{'byid' if by_id else 'batches'}"), encoding, by_id)]
    collector = Collector(otelcol_binary, tmp_path, kafka_exporters(kafka_bootstrap, outputs))
    consumers = [StreamConsumer(detector, ConsumerConfig(
        bootstrap=kafka_bootstrap, topic=topic, group_id=f"{topic}-group", diagnoses_topic=f"{topic}.diagnoses",
        mitigations_topic=f"{topic}.mitigations", dead_letter_topic=f"{topic}.dlq")) for topic, _, _ in outputs]
    stop = threading.Event()
    threads = [threading.Thread(target=consumer.run, args=(stop,)) for consumer in consumers]
    for thread in threads:
        thread.start()
    try:
        wait_all(play(spans, tmp_path, collector.endpoint, rate=25), timeout_s=120)
        results = {topic: read_diagnoses(kafka_bootstrap, f"{topic}.diagnoses", len(trace_ids), timeout_s=60)
                   for topic, _, _ in outputs}
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        collector.stop()
    for (topic, encoding, by_id), consumer in zip(outputs, consumers):
        lost, split = lost_and_split(results[topic], spans)
        assert (len(lost), len(split)) == (0, 0), (encoding, by_id, sorted(lost)[:5], sorted(split)[:5])
        late = consumer.metrics.registry.get_sample_value("bmeg_consumer_late_spans_total")
        assert late == 0, (encoding, by_id)  # no fragment came after its trace was diagnosed


def test_the_collectors_otlphttp_exporter_to_bmeg_serve(kafka_bootstrap, otelcol_binary, trained_run_dir,
                                                         hotel_dataset, tmp_path):
    """`bmeg serve` takes the spans on POST /v1/traces (protobuf, gzip: the exporter's defaults)
    and publishes one whole diagnosis per trace to Kafka."""
    topic = topic_name("otlphttp")
    port = free_port()
    env = {**os.environ, "BMEG_API_KEY": "collector-test-key", "BMEG_OTLP_BOOTSTRAP": kafka_bootstrap, "BMEG_OTLP_DIAGNOSES_TOPIC": f"{topic}.diagnoses",
           "BMEG_OTLP_MITIGATIONS_TOPIC": f"{topic}.mitigations", "BMEG_OTLP_DEAD_LETTER_TOPIC": f"{topic}.dlq"}
    log = tmp_path / "serve.log"
    server = subprocess.Popen([str(Path(sys.executable).parent / "bmeg"), "serve", "--model", str(trained_run_dir),
                               "--device", "cpu", "--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT,
                              env=env)
    collector = None
    try:
        deadline = time.monotonic() + 120
        while not _ready(port):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        collector = Collector(otelcol_binary, tmp_path, {"otlphttp": {"endpoint": f"http://127.0.0.1:{port}",
                                                                    "headers": {"X-API-Key": "collector-test-key"}}})
        trace_ids = hotel_dataset.traces["trace_id"].to_pylist()[950:1150]
        spans = traces_of(hotel_dataset.spans, trace_ids)
        wait_all(play(spans, tmp_path, collector.endpoint, rate=25), timeout_s=120)
        diagnoses = read_diagnoses(kafka_bootstrap, f"{topic}.diagnoses", len(trace_ids), timeout_s=60)
    finally:
        if collector is not None:
            collector.stop()
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    lost, split = lost_and_split(diagnoses, spans)
    assert (len(lost), len(split)) == (0, 0), (sorted(lost)[:5], sorted(split)[:5], log.read_text()[-2000:])


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_broker_outage_of_150_s_is_waited_out_and_sigterm_exits_promptly_during_it(
        otelcol_binary, trained_run_dir, hotel_dataset, tmp_path):
    """A broker of this test's own (never the shared one) is killed 8 s into the stream and
    started again 150 s later. The consumer (`bmeg consume`) stays live meanwhile (/healthz 200:
    its loop goes round), resumes by itself and loses no trace (a few are split: see the end); a
    second consumer, sent SIGTERM in the outage, exits promptly."""
    broker = Broker(tmp_path / "kafka")
    topic = topic_name("outage")
    # One sending-queue consumer: the batches queued in the outage leave in order once the
    # broker is back. With the default 10, each retries on its own backoff (up to 30 s, +-50%),
    # so a trace's pieces arrive further apart than the idle timeout and are split.
    exporters = kafka_exporters(broker.bootstrap, [(topic, "otlp_proto", True)])
    exporters["kafka/0"]["sending_queue"] = {"num_consumers": 1}
    collector = Collector(otelcol_binary, tmp_path, exporters)
    trace_ids = hotel_dataset.traces["trace_id"].to_pylist()[600:900]
    spans = traces_of(hotel_dataset.spans, trace_ids)
    # The topic exists before the consumers start (they join only once it does), so that both
    # hold partitions before the stream and the outage begin.
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])
    admin.close()
    metrics_port = free_port()
    consumer = _consume(trained_run_dir, broker.bootstrap, topic, "main", tmp_path / "consumer.log",
                        ["--metrics-port", str(metrics_port)])
    stopped_in_outage = _consume(trained_run_dir, broker.bootstrap, topic, "other", tmp_path / "other.log", [])
    services: list[subprocess.Popen] = []
    try:
        _wait_for_log(tmp_path / "consumer.log", "assigned partitions [", 120)
        _wait_for_log(tmp_path / "other.log", "assigned partitions [", 120)
        services = play(spans, tmp_path, collector.endpoint, rate=20)  # 15 s of traces from 3 s on
        time.sleep(11)
        broker.kill()
        outage_started = time.monotonic()
        time.sleep(30)
        stopped_in_outage.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        code = stopped_in_outage.wait(60)
        exit_s = time.monotonic() - sigterm_at
        health = httpx.get(f"http://127.0.0.1:{metrics_port}/healthz", timeout=5)
        assert health.status_code == 200, health.text  # waiting the outage out is not being stuck
        time.sleep(max(0.0, 150 - (time.monotonic() - outage_started)))
        broker.restart()
        wait_all(services, timeout_s=120)
        diagnoses = read_diagnoses(broker.bootstrap, f"{topic}.diagnoses.main", len(trace_ids), timeout_s=150)
    finally:
        for process in (*services, consumer, stopped_in_outage, collector.process):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        consumer_code = consumer.wait(60)
        collector.stop()
        broker.stop()
    assert code == 0 and exit_s < 30, (code, exit_s, (tmp_path / "other.log").read_text()[-3000:])
    assert consumer_code == 0, (tmp_path / "consumer.log").read_text()[-3000:]
    lost, split = lost_and_split(diagnoses, spans)
    print(f'outage of 150 s: {len(lost)} lost, {len(split)} split of {len(trace_ids)} traces')  # the README's figure (-s)
    assert not lost, sorted(lost)[:5]
    # Before the consumer waited out the Collector's retries after an outage, traces whose pieces
    # straddled it were split (0-15 of 300 a run; 169 with the Collector's default 10 queue
    # consumers); since, 0 in each of 4 runs (README). A little slack for a loaded machine.
    assert len(split) <= len(trace_ids) // 100, sorted(split)[:5]


def _consume(run_dir: Path, bootstrap: str, topic: str, name: str, log: Path, extra: list[str]) -> subprocess.Popen:
    command = [str(Path(sys.executable).parent / "bmeg"), "consume", "--model", str(run_dir), "--device", "cpu",
               "--bootstrap", bootstrap, "--topic", topic, "--group", f"{topic}-{name}",
               "--diagnoses-topic", f"{topic}.diagnoses.{name}", "--mitigations-topic", f"{topic}.mitigations.{name}",
               "--dead-letter-topic", f"{topic}.dlq.{name}", *extra]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for_log(log: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)
