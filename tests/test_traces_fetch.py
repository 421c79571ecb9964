"""Fetching traces from Jaeger (api_v3, v1) and Tempo.

Real Jaeger and Tempo are not built here (both are large Go programs; the session's time went
to the readers): a local HTTP server answers in the shapes their documentation and code give
(Jaeger v2's api_v3 HTTP gateway: OTLP/JSON chunks wrapped in `{"result": ...}`, 404 for an
unknown trace; Tempo's `/api/traces/{id}`: `{"batches": [...]}` with base64 ids and enum
names; `/api/search`: `{"traces": [{"traceID", ...}]}`), and records what it was asked.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pyarrow as pa
import pytest

from bmeg.traces import SPAN_SCHEMA, TraceInputError
from bmeg.traces.fetch import (
    TraceFetchError,
    fetch_jaeger_traces,
    fetch_jaeger_v3_trace,
    fetch_jaeger_v3_traces,
    fetch_tempo_trace,
    fetch_tempo_traces,
)
from bmeg.traces.jaeger import table_to_jaeger_json
from bmeg.traces.otlp import table_to_otlp_json

TRACE_A, TRACE_B = "0a" * 16, "0b" * 16


def trace(trace_id: str) -> pa.Table:
    rows = [
        {"trace_id": trace_id, "span_id": "01" * 8, "parent_id": None, "service": "frontend", "operation": "GET /",
         "start_ns": 1_700_000_000_000_000_000, "duration_ns": 9_000_000, "kind": "server", "status": "ok",
         "peer_service": None, "db_system": None, "instance": "frontend-0"},
        {"trace_id": trace_id, "span_id": "02" * 8, "parent_id": "01" * 8, "service": "cart", "operation": "get",
         "start_ns": 1_700_000_000_001_000_000, "duration_ns": 2_000_000, "kind": "client", "status": "error",
         "peer_service": None, "db_system": "redis", "instance": None},
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=SPAN_SCHEMA)


def tempo_document(table: pa.Table) -> dict:
    """As Tempo answers: base64 ids, enum names, `batches`."""
    document = table_to_otlp_json(table)
    for resource_spans in document["resourceSpans"]:
        for span in resource_spans["scopeSpans"][0]["spans"]:
            for key in ("traceId", "spanId", "parentSpanId"):
                if key in span:
                    span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
            span["kind"] = {2: "SPAN_KIND_SERVER", 3: "SPAN_KIND_CLIENT"}[span["kind"]]
    return {"batches": document["resourceSpans"]}


class Store:
    """Answers per path; records (path, query) of every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.routes: dict[str, tuple[int, bytes]] = {}
        self.delay_s = 0.0


@pytest.fixture
def store():
    state = Store()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            state.requests.append((url.path, parse_qs(url.query)))
            time.sleep(state.delay_s)
            status, body = state.routes.get(url.path, (404, b'{"error": {"httpCode": 404, "message": "not found"}}'))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_port}"
    yield state
    server.shutdown()
    server.server_close()


def ordered(table: pa.Table) -> pa.Table:
    return table.sort_by([("trace_id", "ascending"), ("span_id", "ascending")])


def test_jaeger_v3_trace_by_id(store):
    store.routes[f"/api/v3/traces/{TRACE_A}"] = (200, json.dumps({"result": table_to_otlp_json(trace(TRACE_A))}).encode())
    assert ordered(fetch_jaeger_v3_trace(store.url, TRACE_A.upper())).equals(trace(TRACE_A))
    assert fetch_jaeger_v3_trace(store.url, TRACE_B).num_rows == 0  # 404: Jaeger does not have it


def test_jaeger_v3_search_reads_every_chunk_and_asks_with_rfc3339_times(store):
    chunks = [json.dumps({"result": table_to_otlp_json(trace(trace_id))}) for trace_id in (TRACE_A, TRACE_B)]
    store.routes["/api/v3/traces"] = (200, "\n".join(chunks).encode())
    table = fetch_jaeger_v3_traces(store.url + "/", "frontend", 1_700_000_000.0, 1_700_000_060.5, limit=50,
                                   operation="GET /")  # fmt: skip
    assert ordered(table).equals(ordered(pa.concat_tables([trace(TRACE_A), trace(TRACE_B)])))
    [(path, query)] = store.requests
    assert path == "/api/v3/traces"
    assert query == {
        "query.service_name": ["frontend"], "query.start_time_min": ["2023-11-14T22:13:20Z"],
        "query.start_time_max": ["2023-11-14T22:14:20.500000Z"], "query.search_depth": ["50"],
        "query.operation_name": ["GET /"],
    }  # fmt: skip


def test_jaeger_v1_query_api(store):
    store.routes["/api/traces"] = (200, json.dumps(table_to_jaeger_json(trace(TRACE_A))).encode())
    assert ordered(fetch_jaeger_traces(store.url, "frontend", 1_700_000_000, 1_700_000_060, limit=5)).equals(
        trace(TRACE_A)
    )
    [(path, query)] = store.requests
    assert path == "/api/traces"
    assert query == {"service": ["frontend"], "start": ["1700000000000000"], "end": ["1700000060000000"],
                     "limit": ["5"]}


#: A v1 answer as the Jaeger UI gets it (processes by id, references), not written by bmeg's writer.
JAEGER_UI_DOCUMENT = {"data": [{
    "traceID": "00000000000000aa",
    "spans": [
        {"traceID": "00000000000000aa", "spanID": "0000000000000001", "operationName": "/wrk2-api/home-timeline/read",
         "references": [], "startTime": 1_700_000_000_000_000, "duration": 900, "tags": [], "processID": "p1"},
        {"traceID": "00000000000000aa", "spanID": "0000000000000002", "operationName": "read_home_timeline_server",
         "references": [{"refType": "CHILD_OF", "traceID": "00000000000000aa", "spanID": "0000000000000001"}],
         "startTime": 1_700_000_000_000_100, "duration": 500, "tags": [], "processID": "p2"},
    ],
    "processes": {"p1": {"serviceName": "nginx-web-server", "tags": []},
                  "p2": {"serviceName": "home-timeline-service", "tags": []}},
}]}  # fmt: skip


def test_jaeger_v1_reads_the_ui_document(store):
    store.routes["/api/traces"] = (200, json.dumps(JAEGER_UI_DOCUMENT).encode())
    table = fetch_jaeger_traces(store.url, "nginx-web-server", 1_700_000_000.0, 1_700_000_060.0, limit=50)
    assert sorted(table["service"].to_pylist()) == ["home-timeline-service", "nginx-web-server"]
    assert table["parent_id"].to_pylist() == [None, "0000000000000001"]


def test_tempo_trace_by_id_and_search(store):
    for trace_id in (TRACE_A, TRACE_B):
        store.routes[f"/api/traces/{trace_id}"] = (200, json.dumps(tempo_document(trace(trace_id))).encode())
    summaries = [{"traceID": trace_id, "rootServiceName": "frontend", "rootTraceName": "GET /",
                  "startTimeUnixNano": "1700000000000000000", "durationMs": 9} for trace_id in (TRACE_A, TRACE_B)]  # fmt: skip
    store.routes["/api/search"] = (200, json.dumps({"traces": summaries, "metrics": {"inspectedTraces": 2}}).encode())
    assert ordered(fetch_tempo_trace(store.url, TRACE_A)).equals(trace(TRACE_A))
    table = fetch_tempo_traces(store.url, "front end", 1_700_000_000, 1_700_000_060, limit=2)
    assert ordered(table).equals(ordered(pa.concat_tables([trace(TRACE_A), trace(TRACE_B)])))
    path, query = store.requests[1]
    assert path == "/api/search"
    assert query == {"tags": ['service.name="front end"'], "start": ["1700000000"], "end": ["1700000061"],
                     "limit": ["2"]}  # fmt: skip
    store.routes["/api/search"] = (200, b'{"traces": []}')
    assert fetch_tempo_traces(store.url, "frontend", 0, 1).num_rows == 0


def test_store_failures_are_named(store):
    store.routes["/api/v3/traces"] = (500, b'{"error": {"message": "storage down"}}')
    with pytest.raises(TraceFetchError, match="answered HTTP 500.*storage down"):
        fetch_jaeger_v3_traces(store.url, "frontend", 0, 1)
    store.routes[f"/api/traces/{TRACE_A}"] = (200, b"<html>login</html>")
    with pytest.raises(TraceInputError):
        fetch_tempo_trace(store.url, TRACE_A)
    store.routes["/api/search"] = (200, b'{"traces": [{"rootServiceName": "x"}]}')
    with pytest.raises(TraceInputError, match="no trace list"):
        fetch_tempo_traces(store.url, "frontend", 0, 1)
    with pytest.raises(TraceInputError, match="not hex"):
        fetch_tempo_trace(store.url, "../../etc/passwd")
    store.delay_s = 2.0
    with pytest.raises(TraceFetchError, match="cannot fetch"):
        fetch_jaeger_v3_trace(store.url, TRACE_A, timeout_s=0.3)


def test_unreachable_store():
    with pytest.raises(TraceFetchError, match="cannot fetch http://127.0.0.1:9/"):
        fetch_tempo_trace("http://127.0.0.1:9", TRACE_A, timeout_s=2)
