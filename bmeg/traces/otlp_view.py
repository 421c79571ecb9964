"""Lean views of the OTLP trace messages, for fast decoding.

`SpansView` reads the bytes of an `ExportTraceServiceRequest` or `TracesData` (same layout)
but declares only what a span table needs. Undeclared fields (attributes, events, links,
trace state, the scope) are skipped by the parser without building Python objects; the status
stays raw bytes (empty for the usual unset status). `RawSpansView` reads the same bytes with
each span left whole as bytes, so one byte search finds the spans whose attributes may hold a
key, and `SpanAttributesView` decodes just those spans' attributes as a map (a repeated
KeyValue is wire-compatible with `map<string, AnyValue>`), so a key is looked up in C rather
than found by iterating over attributes in Python. The field numbers are
those of `opentelemetry/proto/trace/v1/trace.proto`; the views are built once at import.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

_PACKAGE = "bmeg.otlp_view"
_F = descriptor_pb2.FieldDescriptorProto

# message -> fields (name, number, type, message type or "", repeated)
_MESSAGES = {
    "Request": [("resource_spans", 1, _F.TYPE_MESSAGE, "ResourceSpans", True)],
    "ResourceSpans": [
        ("resource", 1, _F.TYPE_MESSAGE, "." + Resource.DESCRIPTOR.full_name, False),
        ("scope_spans", 2, _F.TYPE_MESSAGE, "ScopeSpans", True),
    ],
    "ScopeSpans": [("spans", 2, _F.TYPE_MESSAGE, "Span", True)],
    "Span": [
        ("trace_id", 1, _F.TYPE_BYTES, "", False),
        ("span_id", 2, _F.TYPE_BYTES, "", False),
        ("parent_span_id", 4, _F.TYPE_BYTES, "", False),
        ("name", 5, _F.TYPE_STRING, "", False),
        ("kind", 6, _F.TYPE_INT32, "", False),  # an open enum: a varint on the wire
        ("start_time_unix_nano", 7, _F.TYPE_FIXED64, "", False),
        ("end_time_unix_nano", 8, _F.TYPE_FIXED64, "", False),
        ("status", 15, _F.TYPE_BYTES, "", False),  # a serialized Status
    ],
    "RawRequest": [("resource_spans", 1, _F.TYPE_MESSAGE, "RawResourceSpans", True)],
    "RawResourceSpans": [("scope_spans", 2, _F.TYPE_MESSAGE, "RawScopeSpans", True)],
    "RawScopeSpans": [("spans", 2, _F.TYPE_BYTES, "", True)],  # each a serialized Span
    "SpanAttributes": [("attributes", 9, _F.TYPE_MESSAGE, "SpanAttributes.AttributesEntry", True)],
}


def _build_views() -> descriptor_pool.DescriptorPool:
    file = descriptor_pb2.FileDescriptorProto(
        name="bmeg/traces/otlp_view.proto",
        package=_PACKAGE,
        syntax="proto3",
        dependency=[Resource.DESCRIPTOR.file.name, AnyValue.DESCRIPTOR.file.name],
    )
    for message_name, fields in _MESSAGES.items():
        message = file.message_type.add(name=message_name)
        for name, number, field_type, type_name, repeated in fields:
            field = message.field.add(
                name=name,
                number=number,
                type=field_type,
                label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL,
            )
            if type_name:
                field.type_name = type_name if type_name.startswith(".") else f".{_PACKAGE}.{type_name}"
    _add_attributes_map_entry(next(m for m in file.message_type if m.name == "SpanAttributes"))
    pool = descriptor_pool.Default()
    pool.Add(file)
    return pool


def _add_attributes_map_entry(message: descriptor_pb2.DescriptorProto) -> None:
    entry = message.nested_type.add(name="AttributesEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    entry.field.add(
        name="value",
        number=2,
        type=_F.TYPE_MESSAGE,
        label=_F.LABEL_OPTIONAL,
        type_name="." + AnyValue.DESCRIPTOR.full_name,
    )


_pool = _build_views()
SpansView = message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{_PACKAGE}.Request"))
RawSpansView = message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{_PACKAGE}.RawRequest"))
SpanAttributesView = message_factory.GetMessageClass(
    _pool.FindMessageTypeByName(f"{_PACKAGE}.SpanAttributes")
)
