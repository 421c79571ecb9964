import json

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

from bmeg.traces import SPAN_SCHEMA, TraceInputError, read_spans, to_otlp_proto_bytes
from bmeg.traces.otlp import any_value_text, otlp_json_to_table, read_otlp_proto, table_to_otlp_json
from bmeg.traces.semconv import peer_and_db_system

TRACE = bytes.fromhex("5b8efff798038103d269b633813fc60c")
ROOT, CHILD = bytes.fromhex("eee19b7ec3c1b173"), bytes.fromhex("eee19b7ec3c1b174")


def two_span_request() -> ExportTraceServiceRequest:
    """frontend (server, root) calls redis (client span with peer.service and db.system)."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    attributes = resource_spans.resource.attributes
    attributes.add(key="service.name").value.string_value = "frontend"
    attributes.add(key="k8s.pod.name").value.string_value = "frontend-5d8f-abcde"
    spans = resource_spans.scope_spans.add().spans
    root = spans.add(trace_id=TRACE, span_id=ROOT, name="GET /", kind=2)
    root.start_time_unix_nano, root.end_time_unix_nano = 1_000_000, 9_000_000
    root.status.code = 1
    child = spans.add(trace_id=TRACE, span_id=CHILD, parent_span_id=ROOT, name="GET", kind=3)
    child.start_time_unix_nano, child.end_time_unix_nano = 2_000_000, 3_500_000
    child.status.code = 2
    child.status.message = "timeout"
    child.attributes.add(key="http.method").value.string_value = "GET"
    child.attributes.add(key="peer.service").value.string_value = "redis"
    child.attributes.add(key="db.system").value.string_value = "redis"
    child.events.add(name="retry", time_unix_nano=2_500_000)
    return request


def test_protobuf_request_reads_every_field():
    table = read_otlp_proto(two_span_request().SerializeToString())
    assert table.schema == SPAN_SCHEMA
    root, child = table.to_pylist()
    assert root == {
        "trace_id": TRACE.hex(), "span_id": ROOT.hex(), "parent_id": None, "service": "frontend",
        "operation": "GET /", "start_ns": 1_000_000, "duration_ns": 8_000_000, "kind": "server",
        "status": "ok", "peer_service": None, "db_system": None, "instance": "frontend-5d8f-abcde",
    }  # fmt: skip
    assert child["parent_id"] == ROOT.hex()
    assert (child["kind"], child["status"], child["duration_ns"]) == ("client", "error", 1_500_000)
    assert (child["peer_service"], child["db_system"]) == ("redis", "redis")


def test_traces_data_has_the_same_layout():
    data = TracesData()
    data.resource_spans.extend(two_span_request().resource_spans)
    assert read_otlp_proto(data.SerializeToString()).equals(read_otlp_proto(two_span_request().SerializeToString()))


def test_missing_service_name_is_unknown_service():
    request = two_span_request()
    del request.resource_spans[0].resource.attributes[0]
    assert set(read_otlp_proto(request.SerializeToString())["service"].to_pylist()) == {"unknown_service"}


def test_write_groups_spans_by_service_into_resource_spans():
    table = read_otlp_proto(two_span_request().SerializeToString())
    other = table.slice(0, 1).set_column(3, SPAN_SCHEMA.field("service"), pa.array(["cart"]))
    request = ExportTraceServiceRequest.FromString(to_otlp_proto_bytes(pa.concat_tables([table, other])))
    names = [rs.resource.attributes[0].value.string_value for rs in request.resource_spans]
    assert names == ["frontend", "cart"]
    assert [len(rs.scope_spans[0].spans) for rs in request.resource_spans] == [2, 1]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda span: setattr(span, "trace_id", b""), "no trace id"),
        (lambda span: setattr(span, "span_id", b""), "no span id"),
        (lambda span: setattr(span, "start_time_unix_nano", 0), "no start time"),
        (lambda span: setattr(span, "end_time_unix_nano", 1), "ends before it starts"),
        (lambda span: setattr(span, "start_time_unix_nano", 2**63), "overflows int64"),
        (lambda span: setattr(span, "kind", 9), "unknown span kind 9"),
    ],
)
def test_bad_span_is_named_in_the_error(mutate, message):
    request = two_span_request()
    mutate(request.resource_spans[0].scope_spans[0].spans[1])
    with pytest.raises(TraceInputError, match=message) as caught:
        read_otlp_proto(request.SerializeToString(), "batch.pb")
    assert "batch.pb" in str(caught.value)
    if "span id" not in message:
        assert caught.value.span_id == CHILD.hex()


@pytest.mark.parametrize("cut", [1, 7, 40, -3])
def test_truncated_or_garbage_protobuf_is_a_trace_input_error(cut):
    data = two_span_request().SerializeToString()
    with pytest.raises(TraceInputError, match="not an OTLP protobuf"):
        read_otlp_proto(data[:cut])
    with pytest.raises(TraceInputError):
        read_otlp_proto(b"\xff\xfe garbage" * 3)


def test_otlp_json_fixture(shared_dir):
    table = read_spans(shared_dir / "fixtures/otlp/trace.json")
    assert table.to_pylist() == [
        {
            "trace_id": "5b8efff798038103d269b633813fc60c",  # upper-case hex in the file
            "span_id": "eee19b7ec3c1b174",
            "parent_id": "eee19b7ec3c1b173",
            "service": "my.service",
            "operation": "I'm a server span",
            "start_ns": 1544712660000000000,
            "duration_ns": 1_000_000_000,
            "kind": "server",
            "status": "unset",
            "peer_service": None,
            "db_system": None,
            "instance": None,
        }
    ]


def test_jaeger_example_otlp_json_fixture(shared_dir):
    table = read_spans(shared_dir / "fixtures/otlp/jaeger_example_trace.json")
    assert table.num_rows == 5
    assert set(table["trace_id"].to_pylist()) == {"00000000000000000000000000000011"}
    assert sorted(set(table["service"].to_pylist())) == ["example-service-1", "example-service-2", "example-service-3"]
    assert table["kind"].to_pylist().count("server") == 1
    assert table["kind"].to_pylist().count("client") == 1
    assert set(table["duration_ns"].to_pylist()) == {100_000}


def test_otlp_json_accepts_enum_names_int_times_and_json_lines():
    document = table_to_otlp_json(read_otlp_proto(two_span_request().SerializeToString()))
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][1]
    span["kind"] = "SPAN_KIND_CLIENT"
    span["startTimeUnixNano"] = int(span["startTimeUnixNano"])
    span["traceId"] = span["traceId"].upper()
    table = otlp_json_to_table([document, document])
    assert table.num_rows == 4
    assert table["kind"].to_pylist()[1] == "client"
    lines = (json.dumps(document) + "\n" + json.dumps(document) + "\n").encode()
    assert read_spans(lines).equals(table)


@pytest.mark.parametrize(
    "document, message",
    [
        ({"resourceSpans": "no"}, "malformed OTLP/JSON"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "xyz"}]}]}]}, "neither a hex nor a base64 id"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "e!6=="}]}]}]}, "neither a hex nor a base64 id"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "-5"}]}]}]}, "malformed OTLP/JSON"),
        ({"spans": []}, "needs an object with 'resourceSpans'"),
    ],
)
def test_malformed_otlp_json(document, message):
    with pytest.raises(TraceInputError, match=message):
        otlp_json_to_table([document], "x.json")


def test_pre_1_0_field_names_are_read():
    document = json.loads(json.dumps(table_to_otlp_json(read_otlp_proto(two_span_request().SerializeToString()))))
    resource_spans = document["resourceSpans"][0]
    resource_spans["instrumentationLibrarySpans"] = resource_spans.pop("scopeSpans")
    resource_spans["instrumentationLibrarySpans"][0]["instrumentationLibrary"] = {"name": "old"}
    del resource_spans["instrumentationLibrarySpans"][0]["scope"]
    before = json.dumps(document)
    assert otlp_json_to_table([document]).num_rows == 2
    assert json.dumps(document) == before  # the caller's document is left as it was


_KEYS = ["service.peer.name", "peer.service", "db.system.name", "db.system", "server.address", "net.peer.name",
         "http.method", "peer.name", "db.system.version", "xpeer.service"]
_VALUES = st.one_of(st.text(max_size=12), st.sampled_from(["cart.shop.svc", "10.0.0.7", "[::1]", ""]),
                    st.integers(-5, 5), st.booleans(), st.floats(allow_nan=False))


def _set(value, any_value) -> None:
    if isinstance(value, bool):
        any_value.bool_value = value
    elif isinstance(value, int):
        any_value.int_value = value
    elif isinstance(value, float):
        any_value.double_value = value
    else:
        any_value.string_value = value


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=5), min_size=1, max_size=6))
def test_peer_and_database_are_those_the_full_attributes_give(spans_attributes):
    """The reader looks up only the keys a peer or a database starts from, in a map view of
    each span's attributes: the same columns as every attribute decoded by the full protobuf
    classes and read by `peer_and_db_system`."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.add(key="service.name").value.string_value = "frontend"
    spans = resource_spans.scope_spans.add().spans
    for row, attributes in enumerate(spans_attributes):
        span = spans.add(trace_id=TRACE, span_id=row.to_bytes(8, "big"), name="op", kind=3,
                         parent_span_id=b"" if row == 0 else (0).to_bytes(8, "big"))
        span.start_time_unix_nano, span.end_time_unix_nano = 1_000 + row, 2_000 + row
        for key, value in attributes.items():
            _set(value, span.attributes.add(key=key).value)

    table = read_otlp_proto(request.SerializeToString())

    expected = []
    for span in ExportTraceServiceRequest.FromString(request.SerializeToString()).resource_spans[0].scope_spans[0].spans:
        values = {kv.key: kv.value for kv in span.attributes}
        expected.append(peer_and_db_system(lambda key, values=values: any_value_text(values[key]) if key in values
                                           else None))
    assert list(zip(table["peer_service"].to_pylist(), table["db_system"].to_pylist())) == expected
