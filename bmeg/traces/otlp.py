"""OTLP traces: protobuf (`ExportTraceServiceRequest`, `TracesData`) and OTLP/JSON.

Both protobuf messages have the same layout (field 1: `resource_spans`), so one parser reads
either. OTLP/JSON is the protobuf JSON mapping with two differences the Collector's encoding
makes: ids are hex (not base64) and enums are integers (names are accepted too). JSON is read
by turning hex ids into base64 and handing the document to `json_format`, so both encodings
share one decoder and one set of field rules.

The protobuf path is the hot one (HTTP server, Kafka consumer): it decodes through the lean
views of `otlp_view` (no Python objects for the fields a span table does not use), builds
column lists in one pass over the spans with no per-span dicts, turns ids into hex in one
vectorised step, and reads attributes only for the spans that hold a peer or database key (`semconv`).
A start time of 0 is an error here: proto3 cannot tell it from an unset field, and no SDK
sends it (Jaeger and CSV input may start at 0).

OTLP/JSON is read as the specification asks of receivers: unknown fields are ignored, ids may
be hex (OTLP/JSON) or base64 (the protobuf JSON mapping, which Tempo's API writes), enums
integers or names. Tempo's `{"batches": [...]}` and Jaeger api_v3's `{"result": {...}}`
wrap the same resource spans.
"""

from __future__ import annotations

import base64
import copy
from typing import Any

import numpy as np
import pyarrow as pa
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from bmeg.traces.build import table_from_arrays
from bmeg.traces.errors import PROTOBUF_JSON_ERRORS, TraceInputError
from bmeg.traces.otlp_view import SpansView
from bmeg.traces.schema import SPAN_KINDS, STATUS_CODES
from bmeg.traces.semconv import (
    DB_SYSTEM,
    DB_SYSTEM_KEYS,
    INSTANCE_KEYS,
    PEER_SERVICE_KEYS,
    PEER_SERVICE,
    SERVICE_NAME,
    UNKNOWN_SERVICE,
    peer_and_db_system,
)

_MAX_STRING_DATA = 2**31 - 1  # bytes of text in one Arrow string array (int32 offsets)
_KIND_NAMES = pa.array(SPAN_KINDS)  # OTLP's SpanKind numbers index SPAN_KINDS
_STATUS_NAMES = pa.array(STATUS_CODES)  # and Status.StatusCode numbers STATUS_CODES
# A span holds a peer or a database only under one of these keys (the server address counts
# only beside a database system): four lookups per span, unrolled in the reading loop.
_PEER_1, _PEER_2 = PEER_SERVICE_KEYS
_DB_1, _DB_2 = DB_SYSTEM_KEYS


# --- protobuf -> span table ------------------------------------------------------------------


def read_otlp_proto(data: bytes, source: str = "<bytes>") -> pa.Table:
    """Read a serialized `ExportTraceServiceRequest` or `TracesData` into a span table."""
    request = _decode(SpansView, data, source)
    trace_ids: list[bytes] = []  # ids turn into hex all at once, after the loop
    span_ids: list[bytes] = []
    parent_ids: list[bytes] = []
    operations: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    kinds: list[int] = []
    statuses: list[bytes] = []
    services: list[str] = []
    instances: list[str | None] = []
    # A run of messages repeats the same few resources: each distinct one is decoded once.
    identities: dict[bytes, tuple[str, str | None]] = {}
    keyed: list[tuple[int, Any]] = []  # (row, attributes) of the spans holding a peer or database key
    for resource_spans in request.resource_spans:
        raw_resource = resource_spans.resource
        identity = identities.get(raw_resource)
        if identity is None:
            identity = identities[raw_resource] = _resource_identity(_decode(Resource, raw_resource, source).attributes)
        service, instance = identity
        for scope_spans in resource_spans.scope_spans:
            spans = scope_spans.spans
            services += [service] * len(spans)
            instances += [instance] * len(spans)
            # plain appends of untracked values (bytes, ints): per-span tuples would wake the GC
            for span in spans:
                trace_ids.append(span.trace_id)
                span_ids.append(span.span_id)
                parent_ids.append(span.parent_span_id)
                operations.append(span.name)
                starts.append(span.start_time_unix_nano)
                ends.append(span.end_time_unix_nano)
                kinds.append(span.kind)
                statuses.append(span.status)
                # the keys `peer_and_db_system` starts from, looked up in C (a map view)
                attributes = span.attributes
                if _PEER_1 in attributes or _PEER_2 in attributes or _DB_1 in attributes or _DB_2 in attributes:
                    keyed.append((len(span_ids) - 1, attributes))
    ids = {"trace_id": trace_ids, "span_id": span_ids}
    peers, db_systems = _peer_and_db_system(keyed, len(span_ids))
    return table_from_arrays(
        {
            "trace_id": hex_strings(trace_ids),
            "span_id": hex_strings(span_ids),
            "parent_id": hex_strings(parent_ids, empty_is_null=True),
            "service": pa.array(services, pa.string()),
            "operation": pa.array(operations, pa.string()),
            "start_ns": _nanoseconds(starts, "start time", ids, source, zero_is_missing=True),
            "end_ns": _nanoseconds(ends, "end time", ids, source),
            "kind": _enum_names(kinds, _KIND_NAMES, "span kind", ids, source),
            "status": _enum_names(_status_codes(statuses, ids, source), _STATUS_NAMES, "status code", ids, source),
            "peer_service": pa.array(peers, pa.string()),
            "db_system": pa.array(db_systems, pa.string()),
            "instance": pa.array(instances, pa.string()),
        },
        source,
    )


def hex_strings(ids: list[bytes], empty_is_null: bool = False) -> pa.Array:
    """Byte ids as a lowercase hex string array, converted in one vectorised step."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    characters = b"".join(ids).hex().encode("ascii")
    if len(characters) > _MAX_STRING_DATA:
        raise TraceInputError("too many span ids in one message for one Arrow column; split the batch")
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(lengths * 2, out=offsets[1:])
    validity = pa.py_buffer(np.packbits(lengths > 0, bitorder="little")) if empty_is_null else None
    return pa.StringArray.from_buffers(len(ids), pa.py_buffer(offsets), pa.py_buffer(characters), validity)


def _decode(view, data: bytes, source: str):
    try:
        return view.FromString(data)
    except DecodeError as error:
        raise TraceInputError(f"not an OTLP protobuf trace message: {error} (in {source})") from None


def _peer_and_db_system(keyed: list[tuple[int, Any]], rows: int) -> tuple[list[str | None], list[str | None]]:
    """Peer service and database system per span (`semconv`), from the attributes of the
    `keyed` spans (those holding one of the keys `peer_and_db_system` starts from)."""
    peers: list[str | None] = [None] * rows
    db_systems: list[str | None] = [None] * rows
    for row, attributes in keyed:
        peers[row], db_systems[row] = peer_and_db_system(
            lambda key, attributes=attributes: any_value_text(attributes[key]) if key in attributes else None
        )
    return peers, db_systems


def _status_codes(statuses: list[bytes], ids: dict[str, list], source: str) -> list[int]:
    codes = [0] * len(statuses)
    if not any(statuses):  # empty for the usual unset status: nothing to decode
        return codes
    for row, raw in enumerate(statuses):
        if raw:
            try:
                codes[row] = Status.FromString(raw).code
            except DecodeError as error:
                _fail_at(row, f"malformed span status: {error}", ids, source)
    return codes


def any_value_text(value: AnyValue) -> str:
    """An attribute value as text: strings as they are, other scalars printed."""
    which = value.WhichOneof("value")
    if which is None or which == "string_value":
        return value.string_value
    if which == "bool_value":
        return "true" if value.bool_value else "false"
    if which == "bytes_value":
        return value.bytes_value.hex()
    if which in ("int_value", "double_value"):
        return str(getattr(value, which))
    return json_format.MessageToJson(value, indent=None)  # arrays and key-value lists


def _resource_identity(attributes) -> tuple[str, str | None]:
    found = {a.key: a.value for a in attributes if a.key == SERVICE_NAME or a.key in INSTANCE_KEYS}
    service = any_value_text(found[SERVICE_NAME]) if SERVICE_NAME in found else UNKNOWN_SERVICE
    instance = next((any_value_text(found[key]) for key in INSTANCE_KEYS if key in found), None)
    return service, instance


def _nanoseconds(
    values: list[int], what: str, ids: dict[str, list], source: str, zero_is_missing: bool = False
) -> pa.Array:
    """uint64 protobuf times as int64; a time past int64 (year 2262) is an error, and so is
    0 with `zero_is_missing` (an unset field)."""
    times = np.asarray(values, dtype=np.uint64)
    too_large = np.flatnonzero(times > np.uint64(2**63 - 1))
    if too_large.size:
        _fail_at(int(too_large[0]), f"{what} {values[too_large[0]]} overflows int64 ns", ids, source)
    if zero_is_missing:
        zero = np.flatnonzero(times == 0)
        if zero.size:
            _fail_at(int(zero[0]), f"span has no {what} (0)", ids, source)
    return pa.array(times.astype(np.int64))


def _enum_names(
    values: list[int], names: pa.Array, what: str, ids: dict[str, list], source: str
) -> pa.Array:
    numbers = np.asarray(values, dtype=np.int64)
    unknown = np.flatnonzero((numbers < 0) | (numbers >= len(names)))
    if unknown.size:
        _fail_at(int(unknown[0]), f"unknown {what} {values[unknown[0]]}", ids, source)
    return names.take(pa.array(numbers))


def _fail_at(row: int, message: str, ids: dict[str, list[bytes]], source: str) -> None:
    raise TraceInputError(
        f"{message} (in {source})",
        trace_id=ids["trace_id"][row].hex() or None,
        span_id=ids["span_id"][row].hex() or None,
    )


# --- span table -> protobuf ------------------------------------------------------------------


def table_to_request(table: pa.Table) -> ExportTraceServiceRequest:
    """One `resource_spans` per (service, instance), spans in table order within each."""
    request = ExportTraceServiceRequest()
    scopes: dict[tuple[str, str | None], object] = {}
    kind_numbers = {name: number for number, name in enumerate(SPAN_KINDS)}
    status_numbers = {name: number for number, name in enumerate(STATUS_CODES)}
    for row in table.to_pylist():
        identity = (row["service"], row["instance"])
        scope_spans = scopes.get(identity)
        if scope_spans is None:
            scope_spans = scopes[identity] = _add_resource(request, *identity)
        span = scope_spans.spans.add(
            trace_id=_id_bytes(row["trace_id"]),
            span_id=_id_bytes(row["span_id"]),
            name=row["operation"],
            start_time_unix_nano=row["start_ns"],
            end_time_unix_nano=row["start_ns"] + row["duration_ns"],
            kind=kind_numbers[row["kind"]],
        )
        if row["parent_id"] is not None:
            span.parent_span_id = _id_bytes(row["parent_id"])
        span.status.code = status_numbers[row["status"]]
        for key, column in ((PEER_SERVICE, "peer_service"), (DB_SYSTEM, "db_system")):
            if row[column] is not None:
                span.attributes.add(key=key).value.string_value = row[column]
    return request


def to_otlp_proto_bytes(table: pa.Table) -> bytes:
    """Serialize a span table as an `ExportTraceServiceRequest` (a Kafka message, an HTTP body)."""
    return table_to_request(table).SerializeToString()


def _add_resource(request: ExportTraceServiceRequest, service: str, instance: str | None):
    resource_spans = request.resource_spans.add()
    attributes = resource_spans.resource.attributes
    attributes.add(key=SERVICE_NAME).value.string_value = service
    if instance is not None:
        attributes.add(key=INSTANCE_KEYS[0]).value.string_value = instance
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "bmeg"
    return scope_spans


def _id_bytes(hex_id: str) -> bytes:
    """Hex id to bytes; an odd-length id (possible in CSV input) gets a leading zero."""
    return bytes.fromhex(hex_id if len(hex_id) % 2 == 0 else "0" + hex_id)


# --- OTLP/JSON -------------------------------------------------------------------------------

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


#: Top-level keys holding the resource spans: OTLP's own, Tempo's `/api/traces/{id}`.
RESOURCE_SPANS_KEYS = ("resourceSpans", "batches")
#: Jaeger api_v3 wraps each OTLP document in `{"result": ...}`.
RESULT_KEY = "result"


def is_otlp_json_document(document: object) -> bool:
    if isinstance(document, dict) and isinstance(document.get(RESULT_KEY), dict):
        document = document[RESULT_KEY]
    return isinstance(document, dict) and any(key in document for key in RESOURCE_SPANS_KEYS)


def otlp_json_to_table(documents: list, source: str = "<json>") -> pa.Table:
    """Read decoded OTLP/JSON documents (one per file, or one per line of JSON lines)."""
    request = ExportTraceServiceRequest()
    for number, document in enumerate(documents):
        where = source if len(documents) == 1 else f"{source}, document {number + 1}"
        if not is_otlp_json_document(document):
            raise TraceInputError(
                f"OTLP/JSON needs an object with 'resourceSpans' (or Tempo's 'batches', or Jaeger's "
                f"'result' around them) (in {where})"
            )
        if RESULT_KEY in document:
            document = document[RESULT_KEY]
        resource_spans = next(document[key] for key in RESOURCE_SPANS_KEYS if key in document)
        document = {"resourceSpans": copy.deepcopy(resource_spans)}  # the rewrites must not change the caller's data
        _rename_pre_1_0_fields(document)
        _ids_to_base64(document, where)
        try:
            # Receivers must ignore unknown fields (OTLP specification, "JSON Protobuf Encoding").
            part = json_format.ParseDict(document, ExportTraceServiceRequest(), ignore_unknown_fields=True)
        except (json_format.ParseError, *PROTOBUF_JSON_ERRORS) as error:
            raise TraceInputError(f"malformed OTLP/JSON: {error} (in {where})") from None
        request.MergeFrom(part)
    return read_otlp_proto(request.SerializeToString(), source)


def table_to_otlp_json(table: pa.Table) -> dict:
    """A span table as an OTLP/JSON document (hex ids, integer enums, string nanoseconds)."""
    document = json_format.MessageToDict(table_to_request(table), use_integers_for_enums=True)
    document.setdefault("resourceSpans", [])  # an empty table is still an OTLP document
    for span in _json_spans(document):
        for field in _ID_FIELDS:
            if field in span:
                span[field] = base64.b64decode(span[field]).hex()
    return document


def _ids_to_base64(document: dict, where: str) -> None:
    """Rewrite the ids of an OTLP/JSON document as the base64 `json_format` expects: hex ids
    (OTLP/JSON) are converted, base64 ones (the protobuf JSON mapping) checked and kept. Padded
    base64 of an 8- or 16-byte id ends with `=`, so no id reads as both."""
    for span in _json_spans(document):
        for field in _ID_FIELDS:
            value = span.get(field)
            if isinstance(value, str):
                try:
                    span[field] = base64.b64encode(_id_from_text(value)).decode()
                except ValueError:
                    raise TraceInputError(
                        f"{field} {value!r} is neither a hex nor a base64 id (in {where})",
                        trace_id=_text_or_none(span.get("traceId")),
                        span_id=_text_or_none(span.get("spanId")),
                    ) from None


def _id_from_text(value: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except ValueError:
        if not value.endswith("="):
            raise
        return base64.b64decode(value, validate=True)


def _rename_pre_1_0_fields(document: dict) -> None:
    """OTLP before 1.0 said `instrumentationLibrarySpans` / `instrumentationLibrary` for
    `scopeSpans` / `scope`; old exporters still write them."""
    for resource_spans in _dicts(document.get("resourceSpans")):
        if "instrumentationLibrarySpans" in resource_spans:
            resource_spans["scopeSpans"] = resource_spans.pop("instrumentationLibrarySpans")
            for scope_spans in _dicts(resource_spans["scopeSpans"]):
                if "instrumentationLibrary" in scope_spans:
                    scope_spans["scope"] = scope_spans.pop("instrumentationLibrary")


def _json_spans(document: dict):
    """The span objects of an OTLP/JSON document; parts of the wrong shape are skipped here
    (json_format reports them)."""
    for resource_spans in _dicts(document.get("resourceSpans")):
        for scope_spans in _dicts(resource_spans.get("scopeSpans")):
            yield from _dicts(scope_spans.get("spans"))


def _dicts(value) -> list[dict]:
    """The objects of a JSON list (nothing if it is not a list)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _text_or_none(value) -> str | None:
    return value if isinstance(value, str) else None
