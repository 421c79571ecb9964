"""Zipkin v2 spans: JSON (`[span, ...]`, the API's `[[span, ...], ...]`) and `zipkin.proto3`.

These are the Collector's Kafka encodings `zipkin_json` and `zipkin_proto` (its `zipkinv2`
translator; the protobuf message is a `ListOfSpans`), Zipkin's `/api/v2/spans` body and the
files its API writes. A v2 span is `{traceId, id, parentId?, name, kind?, timestamp, duration,
localEndpoint: {serviceName}, remoteEndpoint: {serviceName}, tags: {string: string}}` with hex
ids and microsecond times (converted exactly to nanoseconds).

- service: `localEndpoint.serviceName` (`unknown_service` when absent, as OpenTelemetry says);
- kind: CLIENT/SERVER/PRODUCER/CONSUMER; none (OpenTelemetry's INTERNAL spans) is `unspecified`;
- status: `error` when the `error` tag is set (Zipkin's rule; `"false"` aside) or
  `otel.status_code` says ERROR, `ok` when it says OK (`semconv.status_of_code`);
- parent: none when `parentId` is absent or zero (the Collector writes 8 zero bytes for a root
  in protobuf);
- names are as written: the Collector's `zipkin_json` lowercases them (`GET /cart` arrives as
  `get /cart`), its `zipkin_proto` does not;
- peer: the tags as in `semconv`, else `remoteEndpoint.serviceName`; store and replica: tags
  (the translator copies resource attributes into tags), the replica else the local IPv4;
- a span with no `timestamp` (0 in protobuf) is an error: Zipkin leaves it out of incomplete
  spans, and there is no time to put the span at.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

import pyarrow as pa
from google.protobuf.message import DecodeError

from bmeg.traces.build import RAW_COLUMNS, table_from_columns
from bmeg.traces.descriptors import F, Field, message_classes
from bmeg.traces.errors import TraceInputError
from bmeg.traces.semconv import INSTANCE_KEYS, UNKNOWN_SERVICE, peer_and_db_system, status_of_code

_ENDPOINT: list[Field] = [
    ("service_name", 1, F.TYPE_STRING, "", "optional"),
    ("ipv4", 2, F.TYPE_BYTES, "", "optional"),
    ("ipv6", 3, F.TYPE_BYTES, "", "optional"),
    ("port", 4, F.TYPE_INT32, "", "optional"),
]
# openzipkin zipkin-api `zipkin.proto` (package zipkin.proto3).
_PROTO = message_classes(
    "bmeg/traces/zipkin.proto",
    "bmeg.zipkin.proto3",
    {
        "Span": [
            ("trace_id", 1, F.TYPE_BYTES, "", "optional"),
            ("parent_id", 2, F.TYPE_BYTES, "", "optional"),
            ("id", 3, F.TYPE_BYTES, "", "optional"),
            ("kind", 4, F.TYPE_ENUM, "Span.Kind", "optional"),
            ("name", 5, F.TYPE_STRING, "", "optional"),
            ("timestamp", 6, F.TYPE_FIXED64, "", "optional"),
            ("duration", 7, F.TYPE_UINT64, "", "optional"),
            ("local_endpoint", 8, F.TYPE_MESSAGE, "Endpoint", "optional"),
            ("remote_endpoint", 9, F.TYPE_MESSAGE, "Endpoint", "optional"),
            ("annotations", 10, F.TYPE_MESSAGE, "Annotation", "repeated"),
            ("tags", 11, F.TYPE_STRING, "", "map"),
            ("debug", 12, F.TYPE_BOOL, "", "optional"),
            ("shared", 13, F.TYPE_BOOL, "", "optional"),
        ],
        "Endpoint": _ENDPOINT,
        "Annotation": [("timestamp", 1, F.TYPE_FIXED64, "", "optional"), ("value", 2, F.TYPE_STRING, "", "optional")],
        "ListOfSpans": [("spans", 1, F.TYPE_MESSAGE, "Span", "repeated")],
    },
    enums={"Span.Kind": [("SPAN_KIND_UNSPECIFIED", 0), ("CLIENT", 1), ("SERVER", 2), ("PRODUCER", 3), ("CONSUMER", 4)]},
)
ListOfSpans = _PROTO["ListOfSpans"]
ZipkinSpan = _PROTO["Span"]
KINDS = {"CLIENT": "client", "SERVER": "server", "PRODUCER": "producer", "CONSUMER": "consumer"}
_PROTO_KINDS = (None, "CLIENT", "SERVER", "PRODUCER", "CONSUMER")
_NS_PER_US = 1000


def is_zipkin_document(document: object) -> bool:
    """A v2 span list (or the API's list of traces), or one v2 span."""
    if isinstance(document, list) and document:
        first = document[0][0] if isinstance(document[0], list) and document[0] else document[0]
        return is_zipkin_span(first)
    return is_zipkin_span(document)


def is_zipkin_span(value: object) -> bool:
    return isinstance(value, dict) and "traceId" in value and "id" in value


def zipkin_json_to_table(documents: list, source: str = "<json>") -> pa.Table:
    """Read decoded Zipkin v2 JSON documents: span lists, lists of traces, single spans."""
    columns: dict[str, list] = {name: [] for name in RAW_COLUMNS}
    for number, document in enumerate(documents):
        where = source if len(documents) == 1 else f"{source}, document {number + 1}"
        for span in _json_spans(document, where):
            _add(columns, _json_row(span, where))
    return table_from_columns(columns, source)


def read_zipkin_proto(data: bytes, source: str = "<bytes>") -> pa.Table:
    """Read a serialized `ListOfSpans` (the Kafka exporter's `zipkin_proto`)."""
    try:
        spans = ListOfSpans.FromString(data).spans
    except DecodeError as error:
        raise TraceInputError(f"not a Zipkin protobuf ListOfSpans: {error} (in {source})") from None
    columns: dict[str, list] = {name: [] for name in RAW_COLUMNS}
    for span in spans:
        local, remote = span.local_endpoint, span.remote_endpoint
        _add(
            columns,
            _row(
                span.trace_id.hex(),
                span.id.hex(),
                _parent(span.parent_id.hex()),
                span.name,
                _PROTO_KINDS[span.kind] if 0 <= span.kind < len(_PROTO_KINDS) else f"kind {span.kind}",
                (span.timestamp, span.duration),
                (local.service_name or None, remote.service_name or None, _ipv4_text(local.ipv4)),
                span.tags,
                source,
            ),
        )
    return table_from_columns(columns, source)


def _json_spans(document: object, where: str) -> list[dict]:
    if is_zipkin_span(document):
        return [document]  # type: ignore[list-item]
    if not isinstance(document, list):
        raise TraceInputError(f"Zipkin JSON needs a list of spans (in {where})")
    spans = [span for item in document for span in (item if isinstance(item, list) else [item])]
    bad = next((span for span in spans if not isinstance(span, dict)), None)
    if bad is not None:
        raise TraceInputError(f"a Zipkin span must be an object, got {type(bad).__name__} (in {where})")
    return spans


def _json_row(span: dict, where: str) -> dict:
    def endpoint(key: str) -> dict:
        value = span.get(key) or {}
        if not isinstance(value, dict):
            raise _error(f"{key} must be an object", span.get("traceId"), span.get("id"), where)
        return value

    local, remote = endpoint("localEndpoint"), endpoint("remoteEndpoint")
    tags = span.get("tags") or {}
    if not isinstance(tags, dict):
        raise _error("tags must be an object", span.get("traceId"), span.get("id"), where)
    times = (span.get("timestamp", 0), span.get("duration", 0))
    if not all(isinstance(time, int) and not isinstance(time, bool) for time in times):
        raise _error(f"timestamp and duration must be integer microseconds, got {times}", span.get("traceId"),
                     span.get("id"), where)  # fmt: skip
    return _row(
        _hex(span.get("traceId"), "traceId", span, where),
        _hex(span.get("id"), "id", span, where),
        _parent(_hex(span.get("parentId"), "parentId", span, where)),
        _text(span.get("name")) or "",
        _text(span.get("kind")),
        times,
        (_text(local.get("serviceName")), _text(remote.get("serviceName")), _text(local.get("ipv4"))),
        {str(key): _text(value) for key, value in tags.items()},
        where,
    )


def _row(
    trace_id: str,
    span_id: str,
    parent_id: str | None,
    name: str,
    kind: str | None,
    times_us: tuple[int, int],
    endpoints: tuple[str | None, str | None, str | None],
    tags: Mapping[str, str | None],
    where: str,
) -> dict:
    """One span's raw columns; `endpoints` is (local service, remote service, local IPv4)."""
    local_service, remote_service, local_ipv4 = endpoints
    if kind is not None and kind.upper() not in KINDS:
        raise _error(f"unknown kind {kind!r}; expected one of {list(KINDS)}", trace_id, span_id, where)
    timestamp, duration = times_us
    if timestamp == 0:
        raise _error("span has no timestamp", trace_id, span_id, where)
    peer, db_system = peer_and_db_system(
        lambda key: tags.get(key) if key in tags else remote_service if key == "peer.service" else None
    )
    return {
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_id": parent_id,
        "service": local_service or UNKNOWN_SERVICE,
        "operation": name,
        "start_ns": timestamp * _NS_PER_US,
        "end_ns": (timestamp + duration) * _NS_PER_US,
        "kind": KINDS[kind.upper()] if kind else "unspecified",
        "status": _status(tags),
        "peer_service": peer,
        "db_system": db_system,
        "instance": next((tags[key] for key in INSTANCE_KEYS if tags.get(key) is not None), local_ipv4),
    }


def _status(tags: Mapping[str, str | None]) -> str:
    code = status_of_code(tags.get("otel.status_code"))
    if code == "error" or ("error" in tags and (tags["error"] or "").lower() != "false"):
        return "error"
    return code or "unset"


def _add(columns: dict[str, list], row: dict) -> None:
    for name in RAW_COLUMNS:
        columns[name].append(row[name])


def _hex(value: object, what: str, span: dict, where: str) -> str:
    if value is None:
        return ""
    text = value.lower() if isinstance(value, str) else None
    if text is None or not all(c in "0123456789abcdef" for c in text):
        raise _error(f"{what} {value!r} is not a hex id", span.get("traceId"), span.get("id"), where)
    return text


def _parent(hex_id: str) -> str | None:
    """No parent for an absent or all-zero id (the translator writes 8 zero bytes for a root)."""
    return hex_id if hex_id.strip("0") else None


def _text(value: object) -> str | None:
    return value if value is None or isinstance(value, str) else str(value)


def _ipv4_text(raw: bytes) -> str | None:
    return str(ipaddress.IPv4Address(raw)) if len(raw) == 4 else None


def _error(message: str, trace_id: object, span_id: object, where: str) -> TraceInputError:
    return TraceInputError(
        f"{message} (in {where})",
        trace_id=trace_id if isinstance(trace_id, str) and trace_id else None,
        span_id=span_id if isinstance(span_id, str) and span_id else None,
    )

