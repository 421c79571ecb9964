"""Spans in, span tables out: the span schema, readers and writers."""

from bmeg.traces.errors import TraceInputError
from bmeg.traces.schema import SPAN_SCHEMA, conform, empty_span_table, span_table

__all__ = ["SPAN_SCHEMA", "TraceInputError", "conform", "empty_span_table", "span_table"]
