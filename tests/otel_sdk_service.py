"""One service of a traced application, as the OpenTelemetry Python SDK sends it: run as its own
process by the Collector tests (`python tests/otel_sdk_service.py SPANS SERVICE ENDPOINT ...`).

It replays its own service's spans of recorded traces (a Parquet span table) through the real
SDK with its default settings: a `TracerProvider` whose resource names the service, the
`BatchSpanProcessor` (export every 5 s or at 512 spans, queue of 2048) and the OTLP exporter
(`http/protobuf` or `grpc`). Trace `i` is played at `start + i / rate`: its spans of this
service end then, children first, with their recorded ids, kinds, times and attributes (an
`IdGenerator` hands the SDK the recorded ids; a parent in another process is a remote parent
context, as propagation would make it). Every service process runs the same schedule, so one
trace's spans leave in several exports, seconds apart, from as many processes. Exits after
`provider.shutdown()` has flushed what is left.
"""

from __future__ import annotations

import argparse
import time

import pyarrow.compute as pc
import pyarrow.parquet as pq
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from bmeg.traces.semconv import DB_SYSTEM, PEER_SERVICE

KINDS = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL,
         "producer": SpanKind.PRODUCER, "consumer": SpanKind.CONSUMER}
STATUSES = {"ok": StatusCode.OK, "error": StatusCode.ERROR}


class RecordedIds(IdGenerator):
    """The ids of the span about to start (the SDK asks for a trace id only for a root span)."""

    trace_id = 0
    span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


def exporter(protocol: str, endpoint: str):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=endpoint, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=endpoint)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spans")
    parser.add_argument("service")
    parser.add_argument("endpoint", help="http://HOST:PORT/v1/traces (http) or HOST:PORT (grpc)")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http")
    parser.add_argument("--rate", type=float, default=25.0, help="traces per second")
    parser.add_argument("--start", type=float, required=True, help="Unix time of the first trace")
    args = parser.parse_args()

    spans = pq.read_table(args.spans)
    order = spans["trace_id"].unique().to_pylist()  # the schedule: the same in every service
    mine = spans.filter(pc.equal(spans["service"], args.service)).to_pylist()
    by_trace: dict[str, list[dict]] = {}
    for row in sorted(mine, key=lambda row: row["start_ns"] + row["duration_ns"]):  # children end first
        by_trace.setdefault(row["trace_id"], []).append(row)

    ids = RecordedIds()
    instance = mine[0]["instance"] if mine and mine[0]["instance"] else f"{args.service}-0"
    provider = TracerProvider(resource=Resource.create({"service.name": args.service, "service.instance.id": instance}),
                              id_generator=ids)
    provider.add_span_processor(BatchSpanProcessor(exporter(args.protocol, args.endpoint)))
    tracer = provider.get_tracer("bmeg-tests")
    for i, trace_id in enumerate(order):
        time.sleep(max(0.0, args.start + i / args.rate - time.time()))
        for row in by_trace.get(trace_id, []):
            ids.trace_id, ids.span_id = int(trace_id, 16), int(row["span_id"], 16)
            parent = Context() if row["parent_id"] is None else trace.set_span_in_context(NonRecordingSpan(SpanContext(
                int(trace_id, 16), int(row["parent_id"], 16), is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))
            attributes = {key: row[column] for key, column in ((PEER_SERVICE, "peer_service"), (DB_SYSTEM, "db_system"))
                          if row[column] is not None}
            span = tracer.start_span(row["operation"], context=parent, kind=KINDS[row["kind"]], attributes=attributes,
                                     start_time=row["start_ns"])
            if row["status"] in STATUSES:
                span.set_status(Status(STATUSES[row["status"]]))
            span.end(end_time=row["start_ns"] + row["duration_ns"])
    provider.shutdown()


if __name__ == "__main__":
    main()
