import json
import logging

import pytest

from bmeg.traces import SPAN_SCHEMA, TraceInputError, read_spans
from bmeg.traces.jaeger import jaeger_json_to_table, table_to_jaeger_json


def jaeger_trace(*spans: dict) -> dict:
    return {
        "traceID": "abc",
        "spans": list(spans),
        "processes": {
            "p1": {"serviceName": "nginx", "tags": [{"key": "hostname", "type": "string", "value": "nginx-0"}]},
            "p2": {"serviceName": "user", "tags": []},
        },
    }


def span(span_id: str, process: str = "p1", references: list | None = None, tags: list | None = None) -> dict:
    return {
        "traceID": "abc",
        "spanID": span_id,
        "operationName": f"op-{span_id}",
        "references": references or [],
        "startTime": 1_600_000_000_000_000,
        "duration": 250,
        "tags": tags or [],
        "processID": process,
    }


def ref(span_id: str, ref_type: str = "CHILD_OF", trace_id: str = "abc") -> dict:
    return {"refType": ref_type, "traceID": trace_id, "spanID": span_id}


def test_ui_fixture(shared_dir):
    table = read_spans(shared_dir / "fixtures/jaeger/ui_01.json")
    assert table.schema == SPAN_SCHEMA
    rows = table.to_pylist()
    # duplicate span ids are kept for the graph builder to repair: nothing is lost
    assert [row["span_id"][-1] for row in rows] == ["2", "2", "3", "4", "5"]
    assert [row["service"] for row in rows] == ["service-x"] * 2 + ["service-y"] * 3
    # span 4: a CHILD_OF to another trace is skipped for the in-trace CHILD_OF
    parents = [row["parent_id"] for row in rows]
    assert parents == [None, None, "0000000000000002", "0000000000000002", "0000000000000004"]
    assert (rows[1]["status"], rows[1]["peer_service"]) == ("error", "service-y")
    assert {row["start_ns"] for row in rows} == {1485467191639875000}  # microseconds -> ns
    assert rows[0]["duration_ns"] == 5_000


def test_query_api_document_with_several_traces():
    second = jaeger_trace(span("02"))
    second["traceID"] = second["spans"][0]["traceID"] = "DEF"
    table = jaeger_json_to_table([{"data": [jaeger_trace(span("01")), second], "total": 0, "errors": None}])
    # ids are lowercased and zero-padded to 16 hex digits as Jaeger prints them
    assert table["trace_id"].to_pylist() == ["0000000000000abc", "0000000000000def"]
    assert table["span_id"].to_pylist() == ["0000000000000001", "0000000000000002"]
    assert table["instance"].to_pylist() == ["nginx-0", "nginx-0"]


def test_child_of_is_preferred_to_follows_from():
    trace = jaeger_trace(
        span("01"),
        span("02"),
        span("03", "p2", references=[ref("02", "FOLLOWS_FROM"), ref("01")]),
        span("04", "p2", references=[ref("02", "FOLLOWS_FROM")]),
    )
    parents = jaeger_json_to_table([trace])["parent_id"].to_pylist()
    assert parents == [None, None, "0000000000000001", "0000000000000002"]


def test_reference_to_another_trace_only_is_a_root_and_is_logged(caplog):
    trace = jaeger_trace(span("01", references=[ref("09", trace_id="ffff")]))
    with caplog.at_level(logging.WARNING, logger="bmeg.traces.jaeger"):
        table = jaeger_json_to_table([trace])
    assert table["parent_id"].to_pylist() == [None]
    assert "references only other traces" in caplog.text
    assert "ffff/09" in caplog.text


def test_tags_give_kind_status_peer_and_db():
    tags = [
        {"key": "span.kind", "type": "string", "value": "client"},
        {"key": "otel.status_code", "type": "string", "value": "OK"},
        {"key": "peer.service", "type": "string", "value": "mongodb"},
        {"key": "db.system", "type": "string", "value": "mongodb"},
    ]
    row = jaeger_json_to_table([jaeger_trace(span("01", "p2", tags=tags))]).to_pylist()[0]
    assert (row["kind"], row["status"], row["peer_service"], row["db_system"]) == ("client", "ok", "mongodb", "mongodb")
    assert (row["service"], row["instance"]) == ("user", None)


def test_writer_round_trip_keeps_microsecond_spans():
    error = {"key": "error", "type": "bool", "value": True}
    trace = jaeger_trace(span("01", tags=[error]), span("02", "p2", [ref("01")]))
    table = jaeger_json_to_table([trace])
    document = json.loads(json.dumps(table_to_jaeger_json(table)))
    assert len(document["data"]) == 1 and len(document["data"][0]["processes"]) == 2
    assert jaeger_json_to_table([document]).equals(table)


@pytest.mark.parametrize(
    "broken, message",
    [
        (lambda s: s.pop("startTime"), "no integer startTime"),
        (lambda s: s.update(duration="5"), "no integer duration"),
        (lambda s: s.update(duration=-5), "ends before it starts"),
        (lambda s: s.update(processID="p9"), "has no serviceName"),
        (lambda s: s.update(spanID="zz"), "not a lowercase hex id"),
        (lambda s: s.pop("spanID"), "no span id"),
        (lambda s: s.update(tags=[{"key": "span.kind", "value": "sideways"}]), "unknown span.kind"),
        (lambda s: s.update(tags=["not a tag"]), "malformed Jaeger span"),
        (lambda s: s.update(startTime=2**62), "does not fit int64"),
    ],
)
def test_bad_span_is_a_trace_input_error_naming_it(broken, message):
    bad = span("07")
    broken(bad)
    with pytest.raises(TraceInputError, match=message) as caught:
        jaeger_json_to_table([jaeger_trace(span("01"), bad)], "ui.json")
    assert "ui.json" in str(caught.value)
    assert caught.value.trace_id == "0000000000000abc"


@pytest.mark.parametrize("document", [{"data": "x"}, {"data": [5]}, [1, 2], {"traceID": "1", "spans": [3]}])
def test_wrong_shape_is_a_trace_input_error(document):
    with pytest.raises(TraceInputError):
        jaeger_json_to_table([document])
