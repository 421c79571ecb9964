"""Lean views of the OTLP trace messages, for fast decoding.

`SpansView` reads the bytes of an `ExportTraceServiceRequest` or `TracesData` (same layout)
but declares only what a span table needs. Undeclared fields (events, links,
trace state, the scope) are skipped by the parser without building Python objects; the status
stays raw bytes (empty for the usual unset status), and so does the resource (a run of
messages repeats the same few resources: each distinct one is decoded once). A span's
attributes are declared as a map (a repeated KeyValue is wire-compatible with
`map<string, AnyValue>`): upb parses them in C and a key is looked up in C, so finding the
spans that hold a peer or database key costs a few lookups per span, and only those spans'
values become Python objects. The field numbers are
those of `opentelemetry/proto/trace/v1/trace.proto`; the views are built once at import.
"""

from __future__ import annotations

from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from bmeg.traces.descriptors import F, message_classes

_views = message_classes(
    "bmeg/traces/otlp_view.proto",
    "bmeg.otlp_view",
    {
        "Request": [("resource_spans", 1, F.TYPE_MESSAGE, "ResourceSpans", "repeated")],
        "ResourceSpans": [
            ("resource", 1, F.TYPE_BYTES, "", "optional"),  # a serialized Resource, decoded once per distinct one
            ("scope_spans", 2, F.TYPE_MESSAGE, "ScopeSpans", "repeated"),
        ],
        "ScopeSpans": [("spans", 2, F.TYPE_MESSAGE, "Span", "repeated")],
        "Span": [
            ("trace_id", 1, F.TYPE_BYTES, "", "optional"),
            ("span_id", 2, F.TYPE_BYTES, "", "optional"),
            ("parent_span_id", 4, F.TYPE_BYTES, "", "optional"),
            ("name", 5, F.TYPE_STRING, "", "optional"),
            ("kind", 6, F.TYPE_INT32, "", "optional"),  # an open enum: a varint on the wire
            ("start_time_unix_nano", 7, F.TYPE_FIXED64, "", "optional"),
            ("end_time_unix_nano", 8, F.TYPE_FIXED64, "", "optional"),
            ("status", 15, F.TYPE_BYTES, "", "optional"),  # a serialized Status
            ("attributes", 9, F.TYPE_MESSAGE, "." + AnyValue.DESCRIPTOR.full_name, "map"),
        ],
    },
    dependencies=(Resource.DESCRIPTOR.file.name, AnyValue.DESCRIPTOR.file.name),
)
SpansView = _views["Request"]
