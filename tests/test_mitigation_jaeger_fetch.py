"""The real-cluster campaign reads its traces from the Jaeger query API into a span table."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from bmeg.faultinject.kubernetes import fetch_jaeger_traces

DOCUMENT = {"data": [{
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
}]}


@pytest.fixture
def jaeger_query():
    """A stand-in Jaeger query service on loopback that records the queries it gets."""
    queries = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            queries.append((url.path, parse_qs(url.query)))
            body = json.dumps(DOCUMENT).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", queries
    server.shutdown()


def test_fetch_builds_a_span_table_from_the_query_api(jaeger_query) -> None:
    url, queries = jaeger_query
    table = fetch_jaeger_traces(url, "nginx-web-server", 1_700_000_000.0, 1_700_000_060.0, limit=50)
    assert table.num_rows == 2
    assert sorted(table["service"].to_pylist()) == ["home-timeline-service", "nginx-web-server"]
    [(path, query)] = queries
    assert path == "/api/traces"
    assert query == {"service": ["nginx-web-server"], "start": ["1700000000000000"], "end": ["1700000060000000"],
                     "limit": ["50"]}
