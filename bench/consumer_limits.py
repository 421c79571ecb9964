"""The streaming consumer at its limits: peak memory against the real broker.

    python bench/consumer_limits.py --model RUN_DIR [--bootstrap 127.0.0.1:19092] [--record FILE]

Starts `bmeg consume` (its default limits, `bmeg.serving.consumer.ConsumerConfig`) on fresh
topics and samples the resident memory of its process every 20 ms while it is driven, step by
step, to each limit:

1. idle: the model loaded, subscribed, nothing on the topic;
2. the stream history at its cap: normal traces over the model's services until every service
   holds its `visits` latest observations;
3. full polls: `max_poll_records` messages at once, each one trace, together about
   `fetch_max_bytes` (what one fetch may bring);
4. the largest message: one gzip-compressed value that inflates to just under
   `max_message_bytes` (the topic allows it: `max.message.bytes` is raised for it);
5. the assembler at `max_open_traces`: 10% more traces than the cap whose root never comes
   (they stay open for the idle timeout, set long here), so the oldest are finished early;
6. a stop (SIGTERM) at that cap: the consumer diagnoses open traces until its shutdown timeout,
   then exits (the rest stay uncommitted, read again by the next owner).

Each step prints the RSS now and the peak so far; the end prints idle against the peak.
`--record FILE` writes both (MiB) and this command as JSON, for the manifest test
(`tests/test_serving_manifests.py` checks the consumer's memory limit against it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import psutil
import pyarrow as pa
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from bmeg.models.detector import Detector
from bmeg.serving.consumer import ConsumerConfig
from bmeg.traces import span_table, to_otlp_proto_bytes
from bmeg.serving.assembler import split_by_trace
from limits import PeakRss  # bench/limits.py, beside this file
from serve import free_port  # bench/serve.py
from stream import SERVICES, instrumented_traces  # bench/stream.py

MIB = 2**20
#: The consumer's settings the figures hold for (recorded with them; the manifest test compares).
MEASURED_LIMITS = ("max_poll_records", "fetch_max_bytes", "max_partition_fetch_bytes", "max_message_bytes",
                   "max_open_traces", "max_trace_spans", "batch_traces", "max_unsent_traces")
LARGEST_TOPIC_BYTES = 80 * MIB  # the topic's max.message.bytes, above any compressed largest message


def on_services(spans: pa.Table, services: list[str]) -> pa.Table:
    """The bench's socialnet-shaped traces renamed onto the model's services (the history keeps
    only those)."""
    mapping = {name: services[i % len(services)] for i, name in enumerate(SERVICES)}
    column = pa.array([mapping.get(name, name) for name in spans["service"].to_pylist()])
    return spans.set_column(spans.schema.get_field_index("service"), "service", column)


def rootless(count: int, seed: int) -> pa.Table:
    """`count` one-span traces whose parent never arrives: each stays open until the idle timeout."""
    rng = np.random.default_rng(seed)
    ids = [f"{int(a):016x}{int(b):016x}" for a, b in rng.integers(1, 2**63, size=(count, 2))]
    start = 1_700_000_000_000_000_000 + rng.integers(0, 10**12, size=count)
    return span_table({
        "trace_id": ids, "span_id": [f"{int(a):016x}" for a in rng.integers(1, 2**63, size=count)],
        "parent_id": [f"{int(a):016x}" for a in rng.integers(1, 2**63, size=count)],
        "service": [SERVICES[1]] * count, "operation": ["text_server"] * count,
        "start_ns": start.tolist(), "duration_ns": rng.integers(10**5, 10**7, size=count).tolist(),
        "kind": ["server"] * count, "db_system": [None] * count,
    })


class Consumer:
    """`bmeg consume` in its own process, its metrics read from its metrics port."""

    def __init__(self, model: Path, bootstrap: str, topic: str, idle_timeout_s: float):
        self.port = free_port()
        command = [str(Path(sys.executable).parent / "bmeg"), "consume", "--model", str(model), "--device", "cpu",
                   "--bootstrap", bootstrap, "--topic", topic, "--group", f"{topic}-group",
                   "--diagnoses-topic", f"{topic}.diagnoses", "--mitigations-topic", f"{topic}.mitigations",
                   "--dead-letter-topic", f"{topic}.dlq", "--idle-timeout", str(idle_timeout_s),
                   "--metrics-port", str(self.port)]
        self.process = subprocess.Popen(command, env={**os.environ, "BMEG_TORCH_THREADS": "1"},
                                        stderr=subprocess.DEVNULL)
        self.rss = PeakRss(self.process.pid)
        deadline = time.monotonic() + 180
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("bmeg consume did not start")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def metric(self, name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics").text
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name)

    def wait(self, name: str, at_least: float, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while (value := self.metric(name)) < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} reached {value}, not {at_least}, in {timeout_s} s")
            time.sleep(0.5)

    def now_mib(self) -> float:
        """The RSS now (0 once the process has exited)."""
        try:
            return self.rss.process.memory_info().rss / MIB
        except psutil.NoSuchProcess:
            return 0.0

    def stop(self) -> float:
        """SIGTERM, then wait for the exit; the seconds it took."""
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        self.rss.stop()
        return time.monotonic() - started


def report(consumer: Consumer, name: str, started: float) -> None:
    print(f"{name:<66} {time.monotonic() - started:5.1f} s   RSS now {consumer.now_mib():6.0f} MiB   "
          f"peak {consumer.rss.peak / MIB:6.0f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="Run directory of `bmeg train`.")
    parser.add_argument("--bootstrap", default=os.environ.get("BMEG_KAFKA_BOOTSTRAP", "127.0.0.1:19092"))
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--idle-timeout", type=float, default=120.0,
                        help="Long, so the rootless traces stay open until the cap finishes them.")
    parser.add_argument("--record", type=Path, help="Write the figures and this command as JSON here.")
    args = parser.parse_args()
    limits = ConsumerConfig(bootstrap=args.bootstrap)
    detector = Detector.load(args.model, device="cpu")
    services, visits = list(detector.services), detector.encoder.history
    del detector

    topic = f"bmeg-bench-limits-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=args.bootstrap)
    admin.create_topics([NewTopic(topic, args.partitions, 1, topic_configs={"max.message.bytes": str(LARGEST_TOPIC_BYTES)})])
    producer = KafkaProducer(bootstrap_servers=args.bootstrap, max_request_size=LARGEST_TOPIC_BYTES, linger_ms=20)

    def send(messages: list[tuple[bytes | None, bytes]]) -> None:
        for key, value in messages:
            producer.send(topic, value=value, key=key)
        producer.flush()

    # Everything sent is made before the consumer starts: the bench's own work is not sampled.
    history = [(k.encode(), to_otlp_proto_bytes(t)) for k, t in
               split_by_trace(on_services(instrumented_traces(2 * visits * len(services), 20, seed=1), services))]
    sample = len(to_otlp_proto_bytes(instrumented_traces(200, 30, seed=3))) / 200  # bytes of a 30-span trace
    per_message = limits.fetch_max_bytes // limits.max_poll_records  # bytes of one message of a full poll
    spans_per_trace = max(2, int(per_message / (sample / 30)))
    full_poll = [(k.encode(), to_otlp_proto_bytes(t))
                 for k, t in split_by_trace(instrumented_traces(limits.max_poll_records, spans_per_trace, seed=2))]
    big_traces = int(limits.max_message_bytes * 0.97 / sample)
    largest_raw = to_otlp_proto_bytes(instrumented_traces(big_traces, 30, seed=4))
    while len(largest_raw) >= limits.max_message_bytes:  # the estimate was high: trim to fit under the limit
        big_traces = int(big_traces * 0.95)
        largest_raw = to_otlp_proto_bytes(instrumented_traces(big_traces, 30, seed=4))
    largest, inflated = gzip.compress(largest_raw, 6), len(largest_raw)
    open_traces = rootless(int(limits.max_open_traces * 1.1), seed=5)
    open_messages = [(None, to_otlp_proto_bytes(open_traces.slice(i, 500))) for i in range(0, open_traces.num_rows, 500)]
    del largest_raw

    print(f"limits: max_poll_records {limits.max_poll_records}, fetch_max_bytes {limits.fetch_max_bytes / MIB:.0f} MiB, "
          f"max_message_bytes {limits.max_message_bytes / MIB:.0f} MiB, max_open_traces {limits.max_open_traces}, "
          f"max_trace_spans {limits.max_trace_spans}, history {visits} visits x {len(services)} services; "
          f"topic {topic}, {args.partitions} partitions", flush=True)
    consumer = Consumer(args.model, args.bootstrap, topic, args.idle_timeout)
    figures: dict[str, float] = {}
    try:
        started = time.monotonic()
        time.sleep(3)
        figures["idle_mib"] = consumer.rss.peak / MIB
        report(consumer, "1. idle: model loaded, subscribed", started)

        started, diagnosed = time.monotonic(), len(history)
        send(history)
        consumer.wait("bmeg_consumer_traces_diagnosed_total", diagnosed)
        report(consumer, f"2. history at its cap: {len(history)} traces of 20 spans", started)

        started, diagnosed = time.monotonic(), diagnosed + len(full_poll)
        send(full_poll)
        consumer.wait("bmeg_consumer_traces_diagnosed_total", diagnosed)
        size = sum(len(v) for _, v in full_poll) / MIB
        report(consumer, f"3. full polls: {len(full_poll)} messages of {spans_per_trace} spans, {size:.0f} MiB", started)

        started, diagnosed = time.monotonic(), diagnosed + big_traces
        send([(None, largest)])
        consumer.wait("bmeg_consumer_traces_diagnosed_total", diagnosed)
        report(consumer, f"4. largest message: {len(largest) / MIB:.0f} MiB gzip, {inflated / MIB:.0f} MiB "
               f"inflated, {big_traces} traces", started)

        started = time.monotonic()
        send(open_messages)
        sent_spans = len(history) * 20 + len(full_poll) * spans_per_trace + big_traces * 30 + open_traces.num_rows
        consumer.wait("bmeg_consumer_spans_total", sent_spans, timeout_s=600)
        consumer.wait("bmeg_consumer_partial_traces_total", open_traces.num_rows - limits.max_open_traces)
        pending = consumer.metric("bmeg_consumer_pending_traces")
        report(consumer, f"5. {open_traces.num_rows} rootless traces: {pending:.0f} open (cap {limits.max_open_traces}), the "
               f"oldest {open_traces.num_rows - limits.max_open_traces} finished early",
               started)
        stop_s = consumer.stop()
        report(consumer, f"6. stopped at the cap (SIGTERM to exit: {stop_s:.0f} s)", started)
    finally:
        consumer.stop()
        producer.close()
        ours = [t for t in (topic, f"{topic}.diagnoses", f"{topic}.mitigations", f"{topic}.dlq") if t in admin.list_topics()]
        admin.delete_topics(ours)
        admin.close()
    figures["peak_mib"] = consumer.rss.peak / MIB
    print(f"consumer RSS: idle {figures['idle_mib']:.0f} MiB, peak at its limits {figures['peak_mib']:.0f} MiB "
          f"(+{figures['peak_mib'] - figures['idle_mib']:.0f} MiB)")
    if args.record:
        args.record.write_text(json.dumps({
            "command": "python bench/consumer_limits.py --model RUN --record " + str(args.record),
            "model": f"{len(services)} services, history {visits}", **{k: round(v) for k, v in figures.items()},
            "limits": {name: getattr(limits, name) for name in MEASURED_LIMITS},
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
