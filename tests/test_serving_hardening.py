"""The server against hostile input and clients: bounded gzip, JSON shape limits, requests that
fail alone however they fail, large requests that cannot starve small ones, bounded metric
labels, the page's security headers, the readiness race, slow clients."""

from __future__ import annotations

import asyncio
import copy
import gzip
import io
import json
import socket
import time

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.serving import model as model_module
from bmeg.serving.app import CONTENT_SECURITY_POLICY, create_app
from bmeg.serving.batcher import MicroBatcher
from bmeg.serving.httpserver import config
from bmeg.serving.limits import LimitExceeded, check_json, inflate
from bmeg.serving.model import ModelSlot
from bmeg.serving.payloads import Answer, Limits, Payload, RequestRefused, diagnose_payloads, split
from bmeg.serving.recent import RecentDiagnoses
from bmeg.traces import span_table, to_otlp_proto_bytes, write_spans
from serving_fixtures import KEY_HEADER, StandInDetector, keyed_settings, running

PROTOBUF = {"content-type": "application/x-protobuf"}
JSON = {"content-type": "application/json"}


def spans_of(trace_ids: list[str], services: list[str] | None = None) -> pa.Table:
    n = len(trace_ids)
    return span_table({
        "trace_id": trace_ids, "span_id": [f"{i:016x}" for i in range(n)], "parent_id": [None] * n,
        "service": services or ["api"] * n, "operation": ["GET"] * n, "start_ns": [1_000] * n,
        "duration_ns": [500 + i for i in range(n)]})


def tid(i: int) -> str:
    return f"{i + 1:032x}"


def otlp_json(spans: pa.Table) -> dict:
    buffer = io.BytesIO()
    write_spans(spans, buffer, "otlp-json")
    return json.loads(buffer.getvalue())


# -- bounded decompression ---------------------------------------------------------------
BOMB = gzip.compress(b" " * (64 * 1024 * 1024))  # 64 KB that inflate to 64 MB


@pytest.fixture(scope="module")
def stand_in_client():
    app = create_app(StandInDetector(), keyed_settings(max_body_bytes=1_000_000, max_traces=50, max_response_bytes=20_000))
    with TestClient(app, headers=KEY_HEADER) as client:
        yield client


def test_gzip_is_inflated_only_when_the_header_says_so_and_within_the_limit(stand_in_client):
    trace = to_otlp_proto_bytes(spans_of([tid(0)]))
    sent = stand_in_client.post("/diagnose", content=gzip.compress(trace), headers={**PROTOBUF, "content-encoding": "gzip"})
    assert sent.status_code == 200, sent.text

    unlabelled = stand_in_client.post("/diagnose", content=BOMB, headers=PROTOBUF)
    assert unlabelled.status_code == 400 and "Content-Encoding does not say so" in unlabelled.json()["detail"]
    bomb = stand_in_client.post("/diagnose", content=BOMB, headers={**PROTOBUF, "content-encoding": "gzip"})
    assert bomb.status_code == 413 and "BMEG_MAX_BODY_BYTES" in bomb.json()["detail"]
    other = stand_in_client.post("/diagnose", content=trace, headers={**PROTOBUF, "content-encoding": "br"})
    assert other.status_code == 415 and "unsupported content encoding" in other.json()["detail"]
    broken = stand_in_client.post("/diagnose", content=gzip.compress(trace)[:-9], headers={**PROTOBUF, "content-encoding": "gzip"})
    assert broken.status_code == 400 and "gzip" in broken.json()["detail"]


def test_inflate_never_holds_more_than_the_limit():
    assert inflate(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip", 4) == b"abcd"  # members one after another
    with pytest.raises(LimitExceeded) as refused:
        inflate(BOMB, "gzip", 1_000_000)
    assert refused.value.limit == "max_body_bytes"
    assert inflate(BOMB, None, 10) == BOMB  # not declared: not inflated


# -- per-request limits ------------------------------------------------------------------
def test_traces_and_answer_size_are_limited(stand_in_client):
    many = stand_in_client.post("/diagnose", content=to_otlp_proto_bytes(spans_of([tid(i) for i in range(51)])), headers=PROTOBUF)
    assert many.status_code == 413 and "51 traces is over the limit of 50 per request (BMEG_MAX_TRACES)" in many.json()["detail"]
    big = stand_in_client.post("/diagnose", content=to_otlp_proto_bytes(spans_of([tid(i) for i in range(50)])), headers=PROTOBUF)
    assert big.status_code == 413 and "BMEG_MAX_RESPONSE_BYTES" in big.json()["detail"]


def test_recent_diagnoses_are_held_within_their_bytes():
    recent = RecentDiagnoses(capacity=1000, max_bytes=50_000)
    detector = StandInDetector()
    ids = []
    for i in range(200):
        spans = spans_of([tid(i)] * 20)
        ids.append(recent.add(detector.diagnose(spans), spans))
        assert recent.held_bytes <= 50_000
    assert recent.get(ids[0]) is None and recent.get(ids[-1]) is not None
    assert 0 < len(recent.summaries(1000)) < 200


# -- JSON shape ----------------------------------------------------------------------------
def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


_documents = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab1', max_size=6),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\x', max_size=4), inner, max_size=3),
                          max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(document=_documents, limit=st.integers(1, 8))
def test_check_json_measures_the_depth_of_any_document(document, limit):
    data = json.dumps(document).encode()
    if _depth(document) > limit:
        with pytest.raises(LimitExceeded, match="max_json_depth|JSON nested"):
            check_json(data, limit, 1000)
    else:
        check_json(data, limit, 1000)


@settings(max_examples=100, deadline=None)
@given(digits=st.integers(1, 60), in_string=st.booleans())
def test_check_json_counts_digits_of_numbers_not_of_strings(digits, in_string):
    number = "9" * digits
    data = json.dumps({"a": [number if in_string else int(number)]}).encode()
    if digits > 40 and not in_string:
        with pytest.raises(LimitExceeded, match="a JSON number of"):
            check_json(data, 64, 40)
    else:
        check_json(data, 64, 40)


# -- poison neighbours -----------------------------------------------------------------------
def _poisons(spans: pa.Table) -> dict[str, Payload]:
    """The payloads that failed their batch mates (or themselves with a 500) before."""
    document = otlp_json(spans)
    nested_otlp = copy.deepcopy(document)
    value: dict = {"stringValue": "x"}
    for _ in range(150):
        value = {"kvlistValue": {"values": [{"key": "k", "value": value}]}}
    nested_otlp["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = [{"key": "a", "value": value}]
    separator = copy.deepcopy(document)
    separator["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["name"] = "get\x1fuser"
    overflow = copy.deepcopy(document)
    overflow["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["startTimeUnixNano"] = str(2**63 - 10)
    overflow["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["endTimeUnixNano"] = str(2**63 - 1)
    digits = json.dumps(document).replace('"startTimeUnixNano": "', '"startTimeUnixNano": 9' + "9" * 4300 + ', "x": "', 1)
    return {
        "json nested 1,000 deep": Payload(b"[" * 1000 + b"]" * 1000, "application/json"),
        "otlp nested 150 deep": Payload(json.dumps(nested_otlp).encode(), "application/json"),
        "a 4,301-digit integer": Payload(digits.encode(), "application/json"),
        "\\x1f in an operation": Payload(json.dumps(separator).encode(), "application/json"),
        "clock skew past int64": Payload(json.dumps(overflow).encode(), "application/json"),
    }


def test_poison_requests_fail_alone_with_a_4xx_and_their_batch_mates_succeed(detector, flagged_trace):
    spans, flagged = flagged_trace
    good = Payload(to_otlp_proto_bytes(spans), "application/x-protobuf")
    poisons = _poisons(spans)
    for name, poison in poisons.items():
        limits = Limits(max_spans=10_000, max_batch_spans=10_000)
        answers = diagnose_payloads(detector, [good, poison, good], False, limits)
        assert isinstance(answers[1], RequestRefused) and 400 <= answers[1].status < 500, (name, answers[1])
        for answer in (answers[0], answers[2]):
            assert isinstance(answer, Answer), (name, answer)
            assert [s.service for s in answer.diagnosis.traces[0].bottlenecks if s.bottleneck] == flagged
    assert set(poisons) == {"json nested 1,000 deep", "otlp nested 150 deep", "a 4,301-digit integer",
                            "\\x1f in an operation", "clock skew past int64"}


def test_poison_requests_get_a_4xx_naming_the_fault_over_http(detector, flagged_trace):
    with TestClient(create_app(detector, keyed_settings()), headers=KEY_HEADER) as client:
        for name, poison in _poisons(flagged_trace[0]).items():
            response = client.post("/diagnose", content=poison.body, headers=JSON)
            assert 400 <= response.status_code < 500, (name, response.text)
            assert any(words in response.json()["detail"] for words in (
                "BMEG_MAX_JSON_DEPTH", "BMEG_MAX_JSON_NUMBER_DIGITS", "control character", "2^62")), (name, response.text)


# -- a large request cannot starve small ones ------------------------------------------------
class PerTraceDetector(StandInDetector):
    """Takes `per_trace_s` per trace, as the model's cost grows with the traces."""

    def __init__(self, per_trace_s: float):
        super().__init__()
        self.per_trace_s = per_trace_s

    def diagnose(self, spans, window=False):
        time.sleep(self.per_trace_s * len(set(spans["trace_id"].to_pylist())))
        return super().diagnose(spans, window)


def test_split_keeps_traces_whole_and_in_bounds():
    spans = spans_of([tid(i % 7) for i in range(100)])
    parts = split(spans, 30)
    assert sum(p.num_rows for p in parts) == 100 and all(p.num_rows <= 30 for p in parts)
    owners = [set(p["trace_id"].to_pylist()) for p in parts]
    assert all(a.isdisjoint(b) for i, a in enumerate(owners) for b in owners[i + 1:])


def test_small_requests_are_answered_between_the_parts_of_a_large_one():
    """400 traces at 5 ms each: 2 s alone. Small requests sent meanwhile wait for a part (~50 spans,
    0.25 s), not for the whole; the large request's answer is whole and in order."""
    detector = PerTraceDetector(per_trace_s=0.005)
    limits = Limits(max_spans=10_000, max_batch_spans=10_000, split_spans=50)
    large = spans_of([tid(i) for i in range(400)])

    async def main():
        batcher = MicroBatcher(ModelSlot(detector), limits, max_batch_bytes=10_000_000)
        batcher.start()
        from bmeg.serving.app import _diagnose_in_parts

        big = asyncio.create_task(_diagnose_in_parts(batcher, Payload(to_otlp_proto_bytes(large), "application/x-protobuf"), False))
        await asyncio.sleep(0.1)
        waits = []
        for i in range(5):
            started = time.perf_counter()
            await _diagnose_in_parts(batcher, Payload(to_otlp_proto_bytes(spans_of([tid(1000 + i)])), "application/x-protobuf"), False)
            waits.append(time.perf_counter() - started)
        answer = await big
        await batcher.stop()
        return waits, answer, big

    waits, answer, _ = asyncio.run(main())
    assert [t.trace_id for t in answer.diagnosis.traces] == [tid(i) for i in range(400)]
    assert answer.spans.num_rows == 400
    assert max(waits) < 1.0, waits  # unsplit, the first small request waited for the whole 2 s


# -- metrics ---------------------------------------------------------------------------------
class KnowsServices(StandInDetector):
    services = ["frontend", "search"]


def test_invented_service_names_share_the_label_other():
    with TestClient(create_app(KnowsServices(), keyed_settings()), headers=KEY_HEADER) as client:
        for batch in range(20):
            names = [f"invented-{batch}-{i}" for i in range(50)] + ["search"]
            body = to_otlp_proto_bytes(spans_of([tid(i) for i in range(51)], names))
            assert client.post("/diagnose", content=body, headers=PROTOBUF).status_code == 200
        lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith("bmeg_bottlenecks_total")]
    assert sorted(lines) == ['bmeg_bottlenecks_total{service="other"} 1000.0', 'bmeg_bottlenecks_total{service="search"} 20.0']


# -- the page's headers ----------------------------------------------------------------------
def test_the_page_and_its_assets_carry_the_security_headers(stand_in_client):
    for path in ("/", "/static/app.js", "/static/style.css", "/healthz"):
        headers = stand_in_client.get(path).headers
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
        assert "frame-ancestors 'none'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY


# -- the readiness race ----------------------------------------------------------------------
def test_ready_is_never_said_before_the_model_info_is_there(monkeypatch):
    """`_set` used to publish the model, freeze the heap (hundreds of ms with a real model), then
    set the info: `/readyz` said ready while `/models` had no model. Look at the state then."""
    seen = []
    slot = ModelSlot(lambda: StandInDetector())
    monkeypatch.setattr(model_module, "freeze_heap", lambda: seen.append(slot.state()))
    slot.load()
    assert seen and all(state.model is not None for state in seen if state.ready)
    assert slot.state().ready and slot.state().model.application == "stand-in"


# -- slow clients ------------------------------------------------------------------------------
@pytest.fixture
def deadline_server():
    settings = keyed_settings(request_read_timeout_s=1.0)
    with running(config(create_app(StandInDetector(), settings), "127.0.0.1", 0, settings, log_level="warning")) as port:
        yield port


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_trickling_clients_are_disconnected_and_others_are_served(deadline_server):
    port = deadline_server
    body = to_otlp_proto_bytes(spans_of([tid(0)]))
    head = (f"POST /diagnose HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-protobuf\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    silent, in_headers, in_body = ([socket.create_connection(("127.0.0.1", port)) for _ in range(20)] for _ in range(3))
    for sock in in_body:
        sock.sendall(head)
    started = time.monotonic()
    while time.monotonic() - started < 3.0:  # a byte every 0.25 s: never complete within the deadline
        for i, sock in enumerate(in_headers + in_body):
            try:
                sock.send(head[int((time.monotonic() - started) * 4) % len(head):][:1] if i < 20 else body[:1])
            except OSError:
                pass
        time.sleep(0.25)
    for sock in silent + in_headers + in_body:
        sock.setblocking(False)
    assert all(_closed(sock) for sock in silent + in_headers + in_body)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + body)
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
    for sock in silent + in_headers + in_body:
        sock.close()
