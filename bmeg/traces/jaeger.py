"""Jaeger JSON: the query API's `{"data": [trace, ...]}` and single trace objects.

A Jaeger trace is `{"traceID", "spans", "processes"}`; a span names its process by
`processID` (or embeds it as `process`). Times are microseconds (converted exactly to
nanoseconds; writing back rounds nanoseconds down to microseconds). The parent is the span's
CHILD_OF reference within the same trace, else its FOLLOWS_FROM one; a reference to another
trace is not a parent, so a span with only such references stays a root (logged).
"""

from __future__ import annotations

import logging

import pyarrow as pa

from bmeg.traces.build import RAW_COLUMNS, table_from_columns
from bmeg.traces.errors import TraceInputError
from bmeg.traces.otlp import DB_SYSTEM, INSTANCE_KEYS, PEER_SERVICE
from bmeg.traces.schema import SPAN_KINDS

log = logging.getLogger(__name__)

#: Process tags naming the replica, most specific first (Jaeger clients set `hostname`, `ip`).
JAEGER_INSTANCE_KEYS = (*INSTANCE_KEYS, "hostname", "ip")
PARENT_REFERENCES = ("CHILD_OF", "FOLLOWS_FROM")  # in order of preference
_NS_PER_US = 1000


# --- Jaeger JSON -> span table ---------------------------------------------------------------


def jaeger_json_to_table(documents: list, source: str = "<json>") -> pa.Table:
    """Read decoded Jaeger JSON documents (one per file, or one per line of JSON lines)."""
    columns: dict[str, list] = {name: [] for name in RAW_COLUMNS}
    for number, document in enumerate(documents):
        where = source if len(documents) == 1 else f"{source}, document {number + 1}"
        for trace in _traces(document, where):
            _add_trace(trace, columns, where)
    return table_from_columns(columns, source)


def is_jaeger_document(document: object) -> bool:
    return isinstance(document, dict) and (
        "data" in document or ("traceID" in document and "spans" in document)
    )


def _traces(document: object, where: str) -> list:
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        return document["data"]
    if isinstance(document, dict) and isinstance(document.get("spans"), list):
        return [document]
    raise TraceInputError(
        f"Jaeger JSON needs {{'data': [trace, ...]}} or a trace {{'traceID', 'spans', "
        f"'processes'}} (in {where})"
    )


def _add_trace(trace: object, columns: dict[str, list], where: str) -> None:
    if not isinstance(trace, dict) or not isinstance(trace.get("spans"), list):
        raise TraceInputError(f"a Jaeger trace must be an object with a 'spans' list (in {where})")
    trace_id = _trace_id(trace.get("traceID")) or None
    processes = trace.get("processes") or {}
    if not isinstance(processes, dict):
        raise TraceInputError(f"'processes' must be an object (in {where})", trace_id=trace_id)
    for span in trace["spans"]:
        if not isinstance(span, dict):
            raise TraceInputError(f"a Jaeger span must be an object (in {where})", trace_id=trace_id)
        try:
            row = _span_row(span, trace.get("traceID"), processes, where)
        except TraceInputError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise TraceInputError(
                f"malformed Jaeger span: {error!r} (in {where})",
                trace_id=_trace_id(span.get("traceID", trace.get("traceID"))) or None,
                span_id=_span_id(span.get("spanID")) or None,
            ) from None
        for name in RAW_COLUMNS:
            columns[name].append(row[name])


def _span_row(span: dict, trace_trace_id: object, processes: dict, where: str) -> dict:
    trace_id = _trace_id(span.get("traceID", trace_trace_id))
    span_id = _span_id(span.get("spanID"))

    def error(message: str) -> TraceInputError:
        return TraceInputError(f"{message} (in {where})", trace_id=trace_id or None, span_id=span_id or None)

    process = processes.get(span.get("processID")) if "processID" in span else span.get("process")
    if not isinstance(process, dict) or not isinstance(process.get("serviceName"), str):
        raise error(f"span's process {span.get('processID')!r} has no serviceName")
    start_us, duration_us = span.get("startTime"), span.get("duration")
    if not _is_int(start_us):
        raise error(f"span has no integer startTime (got {start_us!r})")
    if not _is_int(duration_us):
        raise error(f"span has no integer duration (got {duration_us!r})")
    tags = _tag_values(span.get("tags") or [])
    start_ns = start_us * _NS_PER_US
    return {
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_id": _parent_id(span.get("references") or [], trace_id, span_id),
        "service": process["serviceName"],
        "operation": str(span.get("operationName", "")),
        "start_ns": start_ns,
        "end_ns": start_ns + duration_us * _NS_PER_US,
        "kind": _kind(tags.get("span.kind"), error),
        "status": _status(tags),
        "peer_service": _text(tags.get(PEER_SERVICE)),
        "db_system": _text(tags.get(DB_SYSTEM)),
        "instance": _instance(process.get("tags") or []),
    }


def _parent_id(references: list, trace_id: str, span_id: str) -> str | None:
    same_trace = [ref for ref in references if _trace_id(ref.get("traceID", trace_id)) == trace_id]
    for ref_type in PARENT_REFERENCES:
        for ref in same_trace:
            if ref.get("refType", "CHILD_OF") == ref_type:
                return _span_id(ref.get("spanID"))
    if references:
        log.warning(
            "trace %s, span %s: references only other traces (%s); kept as a root span",
            trace_id,
            span_id,
            ", ".join(f"{ref.get('traceID')}/{ref.get('spanID')}" for ref in references),
        )
    return None


def _trace_id(value: object) -> str:
    """Lowercase hex, zero-padded to 16 or 32 digits as Jaeger prints 64/128-bit ids."""
    text = str(value).lower() if value is not None else ""
    return text.rjust(16 if len(text) <= 16 else 32, "0") if text else ""


def _span_id(value: object) -> str:
    text = str(value).lower() if value is not None else ""
    return text.rjust(16, "0") if text else ""


def _tag_values(tags: list) -> dict:
    return {tag["key"]: tag.get("value") for tag in tags}


def _kind(value: object, error) -> str:
    if value is None:
        return "unspecified"
    kind = str(value).lower()
    if kind not in SPAN_KINDS:
        raise error(f"unknown span.kind {value!r}; expected one of {SPAN_KINDS}")
    return kind


def _status(tags: dict) -> str:
    if tags.get("error") in (True, "true"):
        return "error"
    code = str(tags.get("otel.status_code", "")).upper()
    return {"ERROR": "error", "OK": "ok"}.get(code, "unset")


def _instance(process_tags: list) -> str | None:
    values = _tag_values(process_tags)
    return next((_text(values[key]) for key in JAEGER_INSTANCE_KEYS if key in values), None)


def _text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return "true" if value is True else "false" if value is False else str(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- span table -> Jaeger JSON ---------------------------------------------------------------


def table_to_jaeger_json(table: pa.Table) -> dict:
    """A span table as the query API's `{"data": [trace, ...]}`, one trace per trace id."""
    traces: dict[str, dict] = {}
    for row in table.to_pylist():
        trace = traces.setdefault(row["trace_id"], {"traceID": row["trace_id"], "spans": [], "processes": {}})
        trace["spans"].append(_jaeger_span(row, _process_id(trace["processes"], row)))
    return {"data": list(traces.values())}


def _process_id(processes: dict, row: dict) -> str:
    process = {"serviceName": row["service"], "tags": []}
    if row["instance"] is not None:
        process["tags"].append({"key": "hostname", "type": "string", "value": row["instance"]})
    for process_id, known in processes.items():
        if known == process:
            return process_id
    process_id = f"p{len(processes) + 1}"
    processes[process_id] = process
    return process_id


def _jaeger_span(row: dict, process_id: str) -> dict:
    tags = []
    if row["kind"] != "unspecified":
        tags.append({"key": "span.kind", "type": "string", "value": row["kind"]})
    if row["status"] == "error":
        tags.append({"key": "error", "type": "bool", "value": True})
    elif row["status"] == "ok":
        tags.append({"key": "otel.status_code", "type": "string", "value": "OK"})
    for key, column in ((PEER_SERVICE, "peer_service"), (DB_SYSTEM, "db_system")):
        if row[column] is not None:
            tags.append({"key": key, "type": "string", "value": row[column]})
    references = []
    if row["parent_id"] is not None:
        references.append({"refType": "CHILD_OF", "traceID": row["trace_id"], "spanID": row["parent_id"]})
    return {
        "traceID": row["trace_id"],
        "spanID": row["span_id"],
        "operationName": row["operation"],
        "references": references,
        "startTime": row["start_ns"] // _NS_PER_US,
        "duration": row["duration_ns"] // _NS_PER_US,
        "tags": tags,
        "logs": [],
        "processID": process_id,
    }
