"""Spans in, span tables out: the span schema, readers and writers."""

from bmeg.traces.errors import TraceInputError
from bmeg.traces.io import (
    ENCODINGS,
    FORMATS,
    WRITE_FORMATS,
    detect_encoding,
    read_spans,
    read_spans_bytes,
    write_spans,
)
from bmeg.traces.otlp import to_otlp_proto_bytes
from bmeg.traces.schema import SPAN_SCHEMA, conform, empty_span_table, span_table
from bmeg.traces.tables import MAPPINGS, ColumnMapping

__all__ = [
    "ENCODINGS",
    "FORMATS",
    "MAPPINGS",
    "SPAN_SCHEMA",
    "WRITE_FORMATS",
    "ColumnMapping",
    "TraceInputError",
    "conform",
    "detect_encoding",
    "empty_span_table",
    "read_spans",
    "read_spans_bytes",
    "span_table",
    "to_otlp_proto_bytes",
    "write_spans",
]
