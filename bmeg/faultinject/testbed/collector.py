"""The testbed's OpenTelemetry Collector: OTLP receiver -> batch -> Kafka exporter + file exporter.

The binary is the project's Collector build (`scripts/otelcol.sh`, from the Go module proxy
with the OpenTelemetry Collector Builder). The testbed runs its own instance, with the config
below, on ports of its own (base + 90 gRPC, + 91 HTTP), so it never collides with a Collector
another user runs on 4317: the services export to it, it publishes OTLP protobuf to Kafka
(`BMEG_TESTBED_TOPIC`, default `otlp_spans`, as a platform team runs it) and writes the same
spans to `<run dir>/spans.otlp`, where campaigns read them back (`read_collector_spans`): the
file exporter's `proto` format, each `TracesData` message after its length (4 bytes, big
endian); a third of the JSON's size, and decoded by bmeg's OTLP reader without a JSON pass.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from bmeg.faultinject.testbed.stores import wait_port
from bmeg.faultinject.testbed.system import SOURCE_ROOT, ProcessRecord, TestbedError, spawn
from bmeg.traces.otlp import read_otlp_proto
from bmeg.traces.schema import conform

CONFIG = """\
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:{grpc}"}}
      http: {{endpoint: "127.0.0.1:{http}"}}
processors:
  batch: {{timeout: 200ms, send_batch_size: 512}}
exporters:
  kafka:
    brokers: ["{bootstrap}"]
    traces: {{topic: "{topic}", encoding: otlp_proto}}
  file:
    path: "{spans}"
    format: proto
    flush_interval: 500ms
service:
  telemetry:
    logs: {{level: warn}}
    metrics: {{level: none}}
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [kafka, file]
"""


@dataclass
class Collector:
    record: ProcessRecord
    otlp_endpoint: str
    spans_file: Path


def collector_binary() -> str:
    """The Collector built by `scripts/otelcol.sh` (cached; built on first use)."""
    script = SOURCE_ROOT / "scripts" / "otelcol.sh"
    if not script.is_file():
        raise TestbedError(f"{script} is missing: the Collector build script is not in this checkout")
    result = subprocess.run(["bash", str(script), "build"], capture_output=True, text=True)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        raise TestbedError(f"scripts/otelcol.sh build failed (exit {result.returncode}): {result.stderr.strip()[-800:]}")
    return lines[-1]


def start_collector(testbed, cgroup: Path) -> Collector:
    grpc, http = testbed.base + 90, testbed.base + 91
    spans = testbed.run / "spans.otlp"
    spans.unlink(missing_ok=True)
    config = testbed.run / "otelcol.yaml"
    config.write_text(CONFIG.format(grpc=grpc, http=http, spans=spans,
                                    bootstrap=os.environ.get("BMEG_KAFKA_BOOTSTRAP", "127.0.0.1:19092"),
                                    topic=os.environ.get("BMEG_TESTBED_TOPIC", "otlp_spans")))
    record = spawn("collector", "collector", [collector_binary(), "--config", str(config)],
                   testbed.run / "logs" / "collector.log", cgroup=cgroup)
    wait_port(grpc, 30, "the OpenTelemetry Collector", record.alive)
    return Collector(record, f"127.0.0.1:{grpc}", spans)


def read_collector_spans(path: Path) -> pa.Table:
    """The spans in the file exporter's `proto` file. `TracesData` messages concatenated are one
    `TracesData` (its one field is repeated), so the messages are joined and decoded at once; a
    message the Collector is still writing (the file's last, cut short) is left out."""
    parts, _ = _messages(path.read_bytes())
    return conform(read_otlp_proto(b"".join(parts), str(path)))


class SpanTail:
    """Reads the spans the Collector appended to its file since the last call (a live loop
    reads as the spans come, without decoding the whole file again)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def read(self) -> pa.Table:
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        parts, used = _messages(data)
        self.offset += used
        return conform(read_otlp_proto(b"".join(parts), str(self.path)))


def _messages(data: bytes) -> tuple[list[bytes], int]:
    """The whole length-prefixed messages in `data`, and how many bytes they take."""
    parts, at = [], 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        if at + 4 + size > len(data):
            break
        parts.append(data[at + 4:at + 4 + size])
        at += 4 + size
    return parts, at
