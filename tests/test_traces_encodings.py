"""Every encoding of the Collector's Kafka exporter: detected from the bytes, read back exactly.

The bytes are written here the way the Collector's translators write them (contrib v0.155.0:
`jaeger.ProtoFromTraces` then one `model.Span` per message, its process embedded, as protobuf or
gogo jsonpb; `zipkinv2` as a `ListOfSpans` or a JSON array), through the message classes the
readers use; `test_real_collector_messages` reads messages the real Collector wrote
(`fixtures/collector-kafka-messages.json`, captured by `test_traces_collector_encodings.py`, which
checks the same on a live Collector where one is built).
"""

from __future__ import annotations

import base64
import gzip
import json

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pathlib import Path

import pyarrow.compute as pc
from builders import in_order, sent_spans, span_tables

from bmeg.traces import (
    ENCODINGS,
    SPAN_SCHEMA,
    TraceInputError,
    detect_encoding,
    read_spans,
    read_spans_bytes,
    to_otlp_proto_bytes,
)
from bmeg.traces.io import MAX_INFLATED_BYTES
from bmeg.traces.jaeger import JaegerSpan, jaeger_model_json_bytes
from bmeg.traces.otlp import table_to_otlp_json
from bmeg.traces.zipkin import ListOfSpans

# --- writers, as the Collector's translators write ---------------------------------------------


def jaeger_model_spans(table: pa.Table) -> list:
    """One Jaeger `model.Span` per row, with its process (jaeger.ProtoFromTraces + Kafka)."""
    spans = []
    for row in table.to_pylist():
        span = JaegerSpan(
            trace_id=bytes.fromhex(row["trace_id"]),
            span_id=bytes.fromhex(row["span_id"]),
            operation_name=row["operation"],
        )
        span.start_time.FromNanoseconds(row["start_ns"])
        span.duration.FromNanoseconds(row["duration_ns"])
        if row["parent_id"] is not None:
            span.references.add(trace_id=span.trace_id, span_id=bytes.fromhex(row["parent_id"]))
        span.process.service_name = row["service"]
        if row["instance"] is not None:
            span.process.tags.add(key="service.instance.id", v_str=row["instance"])
        if row["kind"] != "unspecified":
            span.tags.add(key="span.kind", v_str=row["kind"])
        if row["status"] != "unset":
            span.tags.add(key="otel.status_code", v_str=row["status"].upper())
        if row["status"] == "error":
            span.tags.add(key="error", v_type=1, v_bool=True)
        for key, column in (("peer.service", "peer_service"), ("db.system", "db_system")):
            if row[column] is not None:
                span.tags.add(key=key, v_str=row[column])
        spans.append(span)
    return spans


def zipkin_spans(table: pa.Table) -> list[dict]:
    """Zipkin v2 JSON spans (zipkinv2's translator: resource attributes become tags)."""
    spans = []
    for row in table.to_pylist():
        tags = {}
        if row["status"] != "unset":
            tags["otel.status_code"] = row["status"].upper()
        if row["status"] == "error":
            tags["error"] = "boom"
        for key, column in (("peer.service", "peer_service"), ("db.system", "db_system"),
                            ("service.instance.id", "instance")):  # fmt: skip
            if row[column] is not None:
                tags[key] = row[column]
        span = {
            "traceId": row["trace_id"],
            "id": row["span_id"],
            "name": row["operation"],
            "timestamp": row["start_ns"] // 1000,
            "duration": row["duration_ns"] // 1000,
            "localEndpoint": {"serviceName": row["service"]},
            "tags": tags,
        }
        if row["parent_id"] is not None:
            span["parentId"] = row["parent_id"]
        if row["kind"] in ("client", "server", "producer", "consumer"):
            span["kind"] = row["kind"].upper()
        spans.append(span)
    return spans


def zipkin_proto_bytes(spans: list[dict]) -> bytes:
    message = ListOfSpans()
    for span in spans:
        out = message.spans.add(
            trace_id=bytes.fromhex(span["traceId"]),
            id=bytes.fromhex(span["id"]),
            name=span["name"],
            timestamp=span["timestamp"],
            duration=span["duration"],
            kind=span.get("kind", "SPAN_KIND_UNSPECIFIED"),
        )
        if "parentId" in span:
            out.parent_id = bytes.fromhex(span["parentId"])
        out.local_endpoint.service_name = span["localEndpoint"]["serviceName"]
        out.tags.update(span["tags"])
    return message.SerializeToString()


def messages(table: pa.Table, encoding: str) -> list[bytes]:
    """The Kafka messages the exporter writes for a table, in one encoding."""
    if encoding == "otlp_proto":
        return [to_otlp_proto_bytes(table)]
    if encoding == "otlp_json":
        return [json.dumps(table_to_otlp_json(table)).encode()]
    if encoding == "jaeger_proto":
        return [span.SerializeToString() for span in jaeger_model_spans(table)]
    if encoding == "jaeger_json":
        return [jaeger_model_json_bytes(span) for span in jaeger_model_spans(table)]
    if encoding == "zipkin_json":
        return [json.dumps(zipkin_spans(table)).encode()]
    return [zipkin_proto_bytes(zipkin_spans(table))]


def as_encoded(table: pa.Table, encoding: str) -> pa.Table:
    """What an encoding keeps of a table: Zipkin has no INTERNAL kind (the translator drops it)
    and reads an all-zero parent id as none (the translator writes one for a root)."""
    if encoding.startswith("zipkin"):
        kinds = ["unspecified" if kind == "internal" else kind for kind in table["kind"].to_pylist()]
        parents = [parent if parent and parent.strip("0") else None for parent in table["parent_id"].to_pylist()]
        table = table.set_column(table.schema.get_field_index("kind"), "kind", pa.array(kinds, pa.string()))
        table = table.set_column(table.schema.get_field_index("parent_id"), "parent_id", pa.array(parents, pa.string()))
    return table.cast(SPAN_SCHEMA)


def exporter_tables(encoding: str):
    """Random tables an encoding can carry: a service name (Jaeger requires one, Zipkin has
    `unknown_service` for none), microsecond times for Zipkin."""
    return span_tables(time_step=1000 if encoding.startswith("zipkin") else 1).filter(
        lambda table: table.num_rows > 0 and all(table["service"].to_pylist())
    )


# --- properties -------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ENCODINGS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_each_encoding_is_detected_and_read_back(encoding, data):
    table = data.draw(exporter_tables(encoding))
    parts = []
    for message in messages(table, encoding):
        assert detect_encoding(message) == encoding
        assert detect_encoding(message, expected=encoding) == encoding
        read = read_spans_bytes(message, encoding=encoding)
        assert read.equals(read_spans_bytes(message))  # detected, then read
        parts.append(read)
    assert in_order(pa.concat_tables(parts)).equals(in_order(as_encoded(table, encoding)))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), expected=st.sampled_from([None, *ENCODINGS]))
def test_any_bytes_are_an_encoding_or_a_trace_input_error(data, expected):
    try:
        encoding = detect_encoding(data, expected=expected)
    except TraceInputError:
        return
    assert encoding in ENCODINGS


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), encoding=st.sampled_from(ENCODINGS))
def test_any_bytes_read_as_any_encoding_are_spans_or_a_trace_input_error(data, encoding):
    try:
        assert read_spans_bytes(data, encoding=encoding).schema == SPAN_SCHEMA
    except TraceInputError:
        pass


def test_enum_numbers_past_the_known_ones_are_named():
    span = jaeger_model_spans(one_span())[0]
    span.references.add(trace_id=span.trace_id, span_id=b"\x01" * 8, ref_type=-3)
    assert read_spans_bytes(span.SerializeToString(), encoding="jaeger_proto")["parent_id"].to_pylist() == [None]
    message = ListOfSpans.FromString(zipkin_proto_bytes(zipkin_spans(one_span())))
    message.spans[0].kind = -1
    with pytest.raises(TraceInputError, match="unknown kind 'kind -1'"):
        read_spans_bytes(message.SerializeToString(), encoding="zipkin_proto")


@pytest.mark.parametrize("encoding", ENCODINGS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data(), cut=st.integers(0, 2000), flip=st.integers(0, 2000), junk=st.binary(max_size=40))
def test_damaged_messages_never_crash_a_reader(encoding, data, cut, flip, junk):
    message = bytearray(messages(data.draw(exporter_tables(encoding)), encoding)[0])
    message[flip % len(message)] ^= 0x5A
    damaged = bytes(message[: max(cut, 1)]) + junk
    for read in (lambda: read_spans_bytes(damaged, encoding=encoding), lambda: read_spans_bytes(damaged)):
        try:
            assert read().schema == SPAN_SCHEMA
        except TraceInputError:
            pass


@pytest.mark.parametrize("encoding", ["otlp_json", "jaeger_json", "zipkin_json"])
def test_half_a_surrogate_pair_in_json_text_is_a_clear_error(encoding):
    """JSON's escapes can spell a lone surrogate, which Python's JSON reader keeps and Arrow
    cannot store as UTF-8: a clear error, not a crash (hypothesis found it in zipkin_json)."""
    fixture = json.loads((Path(__file__).parent / "fixtures/collector-kafka-messages.json").read_text())
    message = base64.b64decode(fixture["messages"][encoding][0]).decode()
    damaged = message.replace('"frontend"', '"front\\ud800end"', 1)
    assert damaged != message
    for read in (lambda: read_spans_bytes(damaged.encode(), encoding=encoding), lambda: read_spans_bytes(damaged.encode())):
        with pytest.raises(TraceInputError, match="[Ss]urrogate|Unicode"):
            read()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_real_collector_messages(encoding):
    """Bytes the Collector's kafka exporter wrote (v0.155.0) read back into the spans sent."""
    fixture = json.loads((Path(__file__).parent / "fixtures/collector-kafka-messages.json").read_text())
    messages = [base64.b64decode(message) for message in fixture["messages"][encoding]]
    for message in messages:
        assert detect_encoding(message) == encoding
    read = pa.concat_tables([read_spans_bytes(message, encoding=encoding) for message in messages])
    sent = sent_spans(fixture["run"])
    if encoding == "zipkin_json":  # Zipkin's JSON model lowercases span names
        operation = sent.schema.get_field_index("operation")
        sent = sent.set_column(operation, sent.schema.field(operation), pc.utf8_lower(sent["operation"]))
    assert in_order(read).equals(in_order(sent))


# --- documented cases -------------------------------------------------------------------------


def one_span(**overrides) -> pa.Table:
    row = {"trace_id": "0a" * 16, "span_id": "0b" * 8, "parent_id": None, "service": "web", "operation": "GET /",
           "start_ns": 1_700_000_000_000_000_000, "duration_ns": 7_000, "kind": "server", "status": "ok",
           "peer_service": None, "db_system": None, "instance": None}  # fmt: skip
    return pa.Table.from_pylist([{**row, **overrides}], schema=SPAN_SCHEMA)


def test_protobuf_that_starts_like_json_is_still_protobuf():
    table = one_span(service="s" * 24)
    for encoding in ("otlp_proto", "jaeger_proto", "zipkin_proto"):
        [message] = messages(table, encoding)
        assert detect_encoding(message) == encoding


def test_unknown_encoding_and_undetectable_bytes_are_named():
    with pytest.raises(TraceInputError, match="unknown encoding 'avro'"):
        read_spans_bytes(b"", encoding="avro")
    with pytest.raises(TraceInputError, match="none of the encodings"):
        detect_encoding(b"\xff\xff\xff")
    with pytest.raises(TraceInputError, match="none of the encodings"):
        detect_encoding(b'{"hello": 1}')


def test_an_empty_otlp_request_is_an_empty_table():
    assert detect_encoding(b"") == "otlp_proto"
    assert read_spans_bytes(b"").num_rows == 0


def test_the_query_api_json_is_read_under_the_jaeger_json_name():
    document = {"data": [{"traceID": "0a" * 8, "spans": [{"traceID": "0a" * 8, "spanID": "0b" * 8,
                "operationName": "op", "startTime": 0, "duration": 5, "processID": "p1"}],
                "processes": {"p1": {"serviceName": "web"}}}]}  # fmt: skip
    table = read_spans_bytes(json.dumps(document).encode(), encoding="jaeger_json")
    assert table["start_ns"].to_pylist() == [0]  # the epoch is a valid Jaeger time
    assert read_spans_bytes(json.dumps(document).encode()).equals(table)  # no Kafka encoding: read as a file
    assert table["duration_ns"].to_pylist() == [5000]


def test_gzip_is_inflated_up_to_a_bound():
    [message] = messages(one_span(), "otlp_proto")
    assert read_spans_bytes(gzip.compress(message)).equals(read_spans_bytes(message))
    bomb = gzip.compress(b"\0" * (2 * 2**20))
    with pytest.raises(TraceInputError, match="inflates to more than 1,048,576 bytes"):
        read_spans_bytes(bomb, encoding="otlp_proto", max_inflated_bytes=2**20)
    assert MAX_INFLATED_BYTES >= 64 * 2**20  # a Collector message (max_message_bytes 1 MB) fits
    with pytest.raises(TraceInputError, match="corrupt gzip data"):
        read_spans_bytes(gzip.compress(message)[:-12], encoding="otlp_proto")


def test_jaeger_json_is_gogo_jsonpb():
    """The Kafka exporter's `jaeger_json`: base64 ids, RFC 3339 times, enum names, int64 as text."""
    document = {
        "traceId": "AAAAAAAAAAAAAAAAAAAAEQ==",
        "spanId": "AAAAAAAAAAM=",
        "operationName": "HTTP GET /user",
        "references": [{"traceId": "AAAAAAAAAAAAAAAAAAAAEQ==", "spanId": "AAAAAAAAAAI=", "refType": "CHILD_OF"}],
        "flags": 1,
        "startTime": "2017-01-26T16:46:31.639875Z",
        "duration": "0.000100s",
        "tags": [
            {"key": "span.kind", "vStr": "client"},
            {"key": "db.system.name", "vStr": "mongodb"},
            {"key": "server.address", "vStr": "user-mongodb.socialnet.svc.cluster.local"},
            {"key": "retries", "vType": "INT64", "vInt64": "3"},
            {"key": "error", "vType": "BOOL", "vBool": True},
        ],
        "process": {"serviceName": "user-service", "tags": [{"key": "hostname", "vStr": "user-7d9f-x2"}]},
        "someFutureField": {"x": 1},
    }
    [row] = read_spans_bytes(json.dumps(document).encode()).to_pylist()
    assert row == {
        "trace_id": "00000000000000000000000000000011", "span_id": "0000000000000003",
        "parent_id": "0000000000000002", "service": "user-service", "operation": "HTTP GET /user",
        "start_ns": 1485449191639875000, "duration_ns": 100_000, "kind": "client", "status": "error",
        "peer_service": "user-mongodb", "db_system": "mongodb", "instance": "user-7d9f-x2",
    }  # fmt: skip


def test_zipkin_v2_json_file():
    """A Zipkin v2 trace as its API returns it (`/api/v2/trace/{id}`): the peer from the remote
    endpoint, the error from the `error` tag, a list of traces read too."""
    trace = [
        {"traceId": "86154a4ba6e91385", "parentId": "86154a4ba6e91385", "id": "4d1e00c0db9010db",
         "kind": "CLIENT", "name": "get /api", "timestamp": 1472470996199000, "duration": 207000,
         "localEndpoint": {"serviceName": "frontend", "ipv4": "127.0.0.1"},
         "remoteEndpoint": {"serviceName": "backend", "ipv4": "192.168.99.101", "port": 9000},
         "tags": {"http.path": "/api", "error": "500"}},
        {"traceId": "86154a4ba6e91385", "id": "86154a4ba6e91385", "kind": "SERVER", "name": "get /",
         "timestamp": 1472470996199000, "duration": 300000, "localEndpoint": {"serviceName": "frontend"},
         "tags": {"service.instance.id": "frontend-1"}},
    ]  # fmt: skip
    table = read_spans(json.dumps(trace).encode())
    assert table.to_pylist()[0] == {
        "trace_id": "86154a4ba6e91385", "span_id": "4d1e00c0db9010db", "parent_id": "86154a4ba6e91385",
        "service": "frontend", "operation": "get /api", "start_ns": 1472470996199000000,
        "duration_ns": 207000000, "kind": "client", "status": "error", "peer_service": "backend",
        "db_system": None, "instance": "127.0.0.1",
    }  # fmt: skip
    assert table["instance"].to_pylist()[1] == "frontend-1"
    assert read_spans(json.dumps([trace, trace]).encode()).num_rows == 4
    assert read_spans(json.dumps(trace).encode(), "zipkin-json").equals(table)


@pytest.mark.parametrize(
    "span, message",
    [
        ({"traceId": "aa", "id": "bb", "localEndpoint": {"serviceName": "x"}}, "no timestamp"),
        ({"traceId": "aa", "id": "bb", "timestamp": "5"}, "integer microseconds"),
        ({"traceId": "aa", "id": "bb", "timestamp": 5, "kind": "SIDEWAYS"}, "unknown kind"),
        ({"traceId": "zz", "id": "bb", "timestamp": 5}, "not a hex id"),
        ({"traceId": "aa", "id": "bb", "timestamp": 5, "tags": ["x"]}, "tags must be an object"),
        ({"traceId": "aa", "id": "bb", "timestamp": 5, "localEndpoint": "x"}, "must be an object"),
    ],
)
def test_bad_zipkin_spans_are_named(span, message):
    with pytest.raises(TraceInputError, match=message):
        read_spans_bytes(json.dumps([span]).encode(), encoding="zipkin_json")


@pytest.mark.parametrize(
    "attributes, peer, db_system",
    [
        ({"service.peer.name": "cart", "peer.service": "old"}, "cart", None),
        ({"peer.service": "cart"}, "cart", None),
        ({"db.system.name": "redis", "db.system": "old"}, None, "redis"),
        ({"db.system.name": "redis", "server.address": "cart-redis.shop.svc"}, "cart-redis", "redis"),
        ({"db.system": "redis", "net.peer.name": "cart-redis"}, "cart-redis", "redis"),
        ({"db.system.name": "redis", "server.address": "10.0.0.7"}, None, "redis"),
        ({"db.system.name": "redis", "server.address": "::1"}, None, "redis"),
        ({"server.address": "cart"}, None, None),  # an HTTP client's host names no store
        ({"db.system.name": "redis", "peer.service": "cache", "server.address": "x"}, "cache", "redis"),
    ],
)
def test_current_and_deprecated_semantic_conventions(attributes, peer, db_system):
    table = one_span(kind="client")
    document = table_to_otlp_json(table)
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["attributes"] = [{"key": key, "value": {"stringValue": value}} for key, value in attributes.items()]
    otlp_json = json.dumps(document).encode()
    from_proto = read_spans_bytes(to_otlp_proto_bytes(read_spans_bytes(otlp_json)), encoding="otlp_proto")
    jaeger = jaeger_model_spans(table)[0]
    for key, value in attributes.items():
        jaeger.tags.add(key=key, v_str=value)
    zipkin = zipkin_spans(table)
    zipkin[0]["tags"].update(attributes)
    for encoded, encoding in ((otlp_json, "otlp_json"), (jaeger.SerializeToString(), "jaeger_proto"),
                              (json.dumps(zipkin).encode(), "zipkin_json")):  # fmt: skip
        read = read_spans_bytes(encoded, encoding=encoding)
        assert (read["peer_service"][0].as_py(), read["db_system"][0].as_py()) == (peer, db_system), encoding
    # the writer writes what it read under the deprecated keys, and that reads back the same
    assert (from_proto["peer_service"][0].as_py(), from_proto["db_system"][0].as_py()) == (peer, db_system)


def test_otlp_json_unknown_fields_are_ignored(shared_dir):
    """The OTLP specification: receivers ignore fields they do not know (a newer sender's)."""
    document = json.loads((shared_dir / "fixtures/otlp/trace.json").read_text())
    expected = read_spans_bytes(json.dumps(document).encode())
    document["futureTopLevel"] = [1]
    resource_spans = document["resourceSpans"][0]
    resource_spans["futureResourceField"] = {"a": 1}
    resource_spans["resource"]["entityRefs"] = [{"type": "service"}]
    resource_spans["scopeSpans"][0]["futureScopeField"] = "x"
    span = resource_spans["scopeSpans"][0]["spans"][0]
    span["futureSpanField"] = {"nested": [1, 2]}
    span["flags"] = 256
    assert read_spans_bytes(json.dumps(document).encode(), encoding="otlp_json").equals(expected)


def test_tempo_batches_and_base64_ids():
    """Tempo's `/api/traces/{id}`: `batches` of resource spans, ids in base64, enum names."""
    table = one_span(parent_id="0c" * 8)
    document = table_to_otlp_json(table)
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span.update(traceId="CgoKCgoKCgoKCgoKCgoKCg==", spanId="CwsLCwsLCws=", parentSpanId="DAwMDAwMDAw=",
                kind="SPAN_KIND_SERVER", status={"code": "STATUS_CODE_OK"})  # fmt: skip
    tempo = {"batches": document["resourceSpans"]}
    assert read_spans(json.dumps(tempo).encode()).equals(table)
    assert read_spans(json.dumps({"result": document}).encode()).equals(table)  # Jaeger api_v3


@given(id_bytes=st.sampled_from([8, 16]).flatmap(lambda size: st.binary(min_size=size, max_size=size)))
def test_hex_and_base64_ids_never_collide(id_bytes):
    """OTLP ids are 8 or 16 bytes: their padded base64 ends with `=`, which no hex id has."""
    table = read_spans(json.dumps(table_to_otlp_json(one_span(trace_id=id_bytes.hex()))).encode())
    document = table_to_otlp_json(table)
    document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = base64.b64encode(id_bytes).decode()
    assert read_spans(json.dumps(document).encode())["trace_id"].to_pylist() == [id_bytes.hex()]
