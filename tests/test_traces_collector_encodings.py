"""The readers on bytes written by the real OpenTelemetry Collector's Kafka exporter.

One Collector (`scripts/otelcol.sh`, contrib v0.155.0) with one `kafka` exporter per encoding,
each to its own topic; an OTLP/HTTP protobuf request of a few traces goes in; every message of
every topic must be detected as its encoding and read back into the spans that went in (Zipkin
keeps microseconds and has no INTERNAL kind, so the traces here have neither finer times nor
internal spans; its JSON lowercases span names). The store call is sent with the current
conventions (`db.system.name`, `server.address`) and must come out as the `cart-redis` peer.
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from conftest_infra import Collector
from kafka import KafkaConsumer

from builders import sent_spans

from bmeg.traces import ENCODINGS, detect_encoding, read_spans_bytes, to_otlp_proto_bytes
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def otlp_request(table: pa.Table) -> bytes:
    """The table as an SDK sends it: the store call says db.system.name and server.address
    (the current conventions), not peer.service."""
    request = ExportTraceServiceRequest.FromString(to_otlp_proto_bytes(table))
    for resource_spans in request.resource_spans:
        for span in resource_spans.scope_spans[0].spans:
            if any(a.key == "db.system" for a in span.attributes):
                del span.attributes[:]
                span.attributes.add(key="db.system.name").value.string_value = "redis"
                span.attributes.add(key="server.address").value.string_value = "cart-redis.shop.svc.cluster.local"
    return request.SerializeToString()


def test_every_encoding_the_collector_writes_reads_back(otelcol_binary, kafka_bootstrap, tmp_path):
    run = uuid.uuid4().hex[:8]
    topics = {encoding: f"bmeg-14b-{encoding}-{run}" for encoding in ENCODINGS}
    exporters = {f"kafka/{encoding}": {"brokers": [kafka_bootstrap], "traces": {"topic": topic, "encoding": encoding}}
                 for encoding, topic in topics.items()}  # fmt: skip
    collector = Collector(otelcol_binary, tmp_path, exporters)
    try:
        sent = sent_spans(run)
        request = urllib.request.Request(collector.endpoint("http"), data=otlp_request(sent),
                                         headers={"Content-Type": "application/x-protobuf"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        for encoding, topic in topics.items():
            messages = read_topic(kafka_bootstrap, topic, sent.num_rows)
            assert messages, f"{encoding}: nothing on {topic}"
            parts = []
            for message in messages:
                assert detect_encoding(message) == encoding
                assert detect_encoding(message, expected=encoding) == encoding
                parts.append(read_spans_bytes(message, encoding=encoding))
            got, expected = pa.concat_tables(parts), sent
            if encoding == "zipkin_json":  # Zipkin's JSON model lowercases span names
                operation = expected.schema.get_field_index("operation")
                expected = expected.set_column(operation, expected.schema.field(operation),
                                               pc.utf8_lower(expected["operation"]))  # fmt: skip
            assert ordered(got).equals(ordered(expected)), f"{encoding}:\n{ordered(got).to_pylist()}"
    finally:
        collector.stop()


def read_topic(bootstrap: str, topic: str, spans: int, timeout_s: float = 45) -> list[bytes]:
    """The topic's distinct messages, once they hold `spans` spans (Jaeger: one span per
    message). Each offset is read once; a message written twice (the exporter is at least once:
    a send it retries under load can land twice, at another offset) counts once, since every
    reader downstream drops a repeated span id."""
    reader = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None,
                           consumer_timeout_ms=1000)  # fmt: skip
    by_offset: dict[tuple[int, int], bytes] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            by_offset.update({(record.partition, record.offset): record.value for record in reader})
            messages = list(dict.fromkeys(by_offset.values()))
            if messages and sum(read_spans_bytes(m).num_rows for m in messages) >= spans:
                break
    finally:
        reader.close()
    return list(dict.fromkeys(by_offset.values()))


def ordered(table: pa.Table) -> pa.Table:
    return table.sort_by([("trace_id", "ascending"), ("span_id", "ascending")])
