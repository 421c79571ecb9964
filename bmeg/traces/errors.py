"""Errors for bad trace input: each names what is wrong and where (trace, span)."""

from __future__ import annotations

#: What protobuf's `json_format.ParseDict` raises on a hostile document besides its ParseError:
#: a wrong type, a nesting too deep, and a number it cannot convert (`"kind": Infinity` is an
#: OverflowError, found by hypothesis in CI).
PROTOBUF_JSON_ERRORS = (TypeError, ValueError, AttributeError, RecursionError, OverflowError)


class TraceInputError(ValueError):
    """Input that cannot be read as spans, or a trace that cannot be repaired.

    The message names the trace and span where known, so the caller can report it as is
    (HTTP 4xx, a dead-letter reason, a CLI error).
    """

    def __init__(self, message: str, *, trace_id: str | None = None, span_id: str | None = None):
        where = ", ".join(
            part
            for part in (
                f"trace {trace_id}" if trace_id else "",
                f"span {span_id}" if span_id else "",
            )
            if part
        )
        super().__init__(f"{where}: {message}" if where else message)
        self.trace_id = trace_id
        self.span_id = span_id
