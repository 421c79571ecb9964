"""Jaeger JSON: the query API's `{"data": [trace, ...]}` and single trace objects.

A Jaeger trace is `{"traceID", "spans", "processes"}`; a span names its process by
`processID` (or embeds it as `process`). Times are microseconds (converted exactly to
nanoseconds; writing back rounds nanoseconds down to microseconds). The parent is the span's
CHILD_OF reference within the same trace, else its FOLLOWS_FROM one; a reference to another
trace is not a parent, so a span with only such references stays a root (logged). A start
time of 0 is valid (the epoch). Peer and database tags are read as in `semconv`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TypeGuard

import pyarrow as pa
from google.protobuf import duration_pb2, json_format, timestamp_pb2
from google.protobuf.message import DecodeError

from bmeg.traces.build import RAW_COLUMNS, table_from_columns
from bmeg.traces.descriptors import F, message_classes
from bmeg.traces.errors import PROTOBUF_JSON_ERRORS, TraceInputError
from bmeg.traces.schema import SPAN_KINDS
from bmeg.traces.semconv import DB_SYSTEM, INSTANCE_KEYS, PEER_SERVICE, peer_and_db_system, status_of_code

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
    start_ns = start_us * _NS_PER_US
    return _row(
        trace_id,
        span_id,
        _parent_id(span.get("references") or [], trace_id, span_id),
        process["serviceName"],
        str(span.get("operationName", "")),
        (start_ns, start_ns + duration_us * _NS_PER_US),
        _tag_values(span.get("tags") or []),
        _tag_values(process.get("tags") or []),
        error,
    )


def _row(
    trace_id: str,
    span_id: str,
    parent_id: str | None,
    service: str,
    operation: str,
    times_ns: tuple[int, int],
    tags: dict,
    process_tags: dict,
    error: Callable[[str], TraceInputError],
) -> dict:
    """One span's raw columns from Jaeger's parts (JSON or model.proto)."""
    peer, db_system = peer_and_db_system(lambda key: _text(tags.get(key)))
    return {
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_id": parent_id,
        "service": service,
        "operation": operation,
        "start_ns": times_ns[0],
        "end_ns": times_ns[1],
        "kind": _kind(tags.get("span.kind"), error),
        "status": _status(tags),
        "peer_service": peer,
        "db_system": db_system,
        "instance": next((_text(process_tags[key]) for key in JAEGER_INSTANCE_KEYS if key in process_tags), None),
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
    return status_of_code(tags.get("otel.status_code")) or "unset"


def _text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return "true" if value is True else "false" if value is False else str(value)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


# --- Jaeger model.proto: the Collector's Kafka encodings `jaeger_proto` and `jaeger_json` ----

# jaeger-idl `model.proto` (package jaeger.api_v2), the messages a span needs.
_MODEL = message_classes(
    "bmeg/traces/jaeger_model.proto",
    "bmeg.jaeger.api_v2",
    {
        "KeyValue": [
            ("key", 1, F.TYPE_STRING, "", "optional"),
            ("v_type", 2, F.TYPE_ENUM, "ValueType", "optional"),
            ("v_str", 3, F.TYPE_STRING, "", "optional"),
            ("v_bool", 4, F.TYPE_BOOL, "", "optional"),
            ("v_int64", 5, F.TYPE_INT64, "", "optional"),
            ("v_float64", 6, F.TYPE_DOUBLE, "", "optional"),
            ("v_binary", 7, F.TYPE_BYTES, "", "optional"),
        ],
        "Log": [
            ("timestamp", 1, F.TYPE_MESSAGE, ".google.protobuf.Timestamp", "optional"),
            ("fields", 2, F.TYPE_MESSAGE, "KeyValue", "repeated"),
        ],
        "SpanRef": [
            ("trace_id", 1, F.TYPE_BYTES, "", "optional"),
            ("span_id", 2, F.TYPE_BYTES, "", "optional"),
            ("ref_type", 3, F.TYPE_ENUM, "SpanRefType", "optional"),
        ],
        "Process": [
            ("service_name", 1, F.TYPE_STRING, "", "optional"),
            ("tags", 2, F.TYPE_MESSAGE, "KeyValue", "repeated"),
        ],
        "Span": [
            ("trace_id", 1, F.TYPE_BYTES, "", "optional"),
            ("span_id", 2, F.TYPE_BYTES, "", "optional"),
            ("operation_name", 3, F.TYPE_STRING, "", "optional"),
            ("references", 4, F.TYPE_MESSAGE, "SpanRef", "repeated"),
            ("flags", 5, F.TYPE_UINT32, "", "optional"),
            ("start_time", 6, F.TYPE_MESSAGE, ".google.protobuf.Timestamp", "optional"),
            ("duration", 7, F.TYPE_MESSAGE, ".google.protobuf.Duration", "optional"),
            ("tags", 8, F.TYPE_MESSAGE, "KeyValue", "repeated"),
            ("logs", 9, F.TYPE_MESSAGE, "Log", "repeated"),
            ("process", 10, F.TYPE_MESSAGE, "Process", "optional"),
            ("process_id", 11, F.TYPE_STRING, "", "optional"),
            ("warnings", 12, F.TYPE_STRING, "", "repeated"),
        ],
    },
    enums={
        "ValueType": [("STRING", 0), ("BOOL", 1), ("INT64", 2), ("FLOAT64", 3), ("BINARY", 4)],
        "SpanRefType": [("CHILD_OF", 0), ("FOLLOWS_FROM", 1)],
    },
    dependencies=(timestamp_pb2.DESCRIPTOR.name, duration_pb2.DESCRIPTOR.name),
)
#: One Jaeger `model.Span`, its process embedded: what each Kafka message holds.
JaegerSpan = _MODEL["Span"]
_REF_TYPES = ("CHILD_OF", "FOLLOWS_FROM")
_NS_PER_S = 1_000_000_000


def read_jaeger_proto(data: bytes, source: str = "<bytes>") -> pa.Table:
    """Read one serialized Jaeger `model.Span` (the Kafka exporter's `jaeger_proto`)."""
    try:
        span = JaegerSpan.FromString(data)
    except DecodeError as error:
        raise TraceInputError(f"not a Jaeger protobuf span: {error} (in {source})") from None
    return jaeger_model_to_table([span], source)


def read_jaeger_model_json(documents: list, source: str = "<json>") -> pa.Table:
    """Read Jaeger `model.Span`s in the protobuf JSON mapping (the Kafka exporter's
    `jaeger_json`, written by gogo's jsonpb: base64 ids, RFC 3339 times, enum names)."""
    spans = []
    for number, document in enumerate(documents):
        where = source if len(documents) == 1 else f"{source}, document {number + 1}"
        if not isinstance(document, dict):
            raise TraceInputError(f"a Jaeger JSON span must be an object (in {where})")
        try:
            spans.append(json_format.ParseDict(document, JaegerSpan(), ignore_unknown_fields=True))
        except (json_format.ParseError, *PROTOBUF_JSON_ERRORS) as error:
            raise TraceInputError(f"malformed Jaeger JSON span: {error} (in {where})") from None
    return jaeger_model_to_table(spans, source)


def is_jaeger_model_document(document: object) -> bool:
    """A jsonpb `model.Span` (camelCase ids; the query API's JSON says `traceID`, `spanID`)."""
    return isinstance(document, dict) and "spanId" in document and "traceId" in document


def jaeger_model_to_table(spans: list, source: str) -> pa.Table:
    columns: dict[str, list] = {name: [] for name in RAW_COLUMNS}
    for span in spans:
        trace_id, span_id = _trace_id(span.trace_id.hex()), _span_id(span.span_id.hex())

        def error(message: str, trace_id=trace_id, span_id=span_id) -> TraceInputError:
            return TraceInputError(f"{message} (in {source})", trace_id=trace_id or None, span_id=span_id or None)

        if not span.process.service_name:
            raise error("span's process has no service_name")
        references = [
            {
                "traceID": ref.trace_id.hex(),
                "spanID": ref.span_id.hex(),
                "refType": _REF_TYPES[ref.ref_type] if 0 <= ref.ref_type < len(_REF_TYPES) else f"type {ref.ref_type}",
            }
            for ref in span.references
        ]
        start_ns = span.start_time.seconds * _NS_PER_S + span.start_time.nanos
        row = _row(
            trace_id,
            span_id,
            _parent_id(references, trace_id, span_id),
            span.process.service_name,
            span.operation_name,
            (start_ns, start_ns + span.duration.seconds * _NS_PER_S + span.duration.nanos),
            {tag.key: _model_value(tag) for tag in span.tags},
            {tag.key: _model_value(tag) for tag in span.process.tags},
            error,
        )
        for name in RAW_COLUMNS:
            columns[name].append(row[name])
    return table_from_columns(columns, source)


def _model_value(tag) -> object:
    """A model.KeyValue's value as the JSON reader sees tag values (then `_text`)."""
    which = tag.v_type
    if which == 1:
        return tag.v_bool
    if which == 2:
        return tag.v_int64
    if which == 3:
        return tag.v_float64
    if which == 4:
        return tag.v_binary.hex()
    return tag.v_str


def jaeger_model_json_bytes(span) -> bytes:
    """A `model.Span` as the Kafka exporter's `jaeger_json` writes it (for tests and tools)."""
    return json.dumps(json_format.MessageToDict(span)).encode()


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
