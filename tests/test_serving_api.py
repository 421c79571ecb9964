"""The REST API end to end on a small trained model: formats, window mode, limits, API key,
readiness, metrics, OpenAPI, and garbage that must get a 4xx, never a 500."""

from __future__ import annotations

import io
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bmeg.diagnosis import Diagnosis
from bmeg.mitigation.planner import suggest
from bmeg.models.checkpoint import CheckpointError
from bmeg.serving.app import create_app
from bmeg.serving.settings import ServingSettings
from bmeg.traces import read_spans_bytes, to_otlp_proto_bytes, write_spans
from serving_fixtures import KEY_HEADER, StandInDetector, keyed_settings, traces_of

PROTOBUF = {"content-type": "application/x-protobuf"}
JSON = {"content-type": "application/json"}


def encoded(table, format: str) -> bytes:
    buffer = io.BytesIO()
    write_spans(table, buffer, format)
    return buffer.getvalue()


def wait_ready(client: TestClient, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, client.get("/readyz").json()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client(detector):
    with TestClient(create_app(detector, keyed_settings(max_spans=5_000, max_body_bytes=2_000_000)),
                    headers=KEY_HEADER) as client:
        yield client


@pytest.mark.parametrize("format, headers", [("otlp-proto", PROTOBUF), ("otlp-json", JSON), ("jaeger-json", JSON)])
def test_each_format_gets_the_models_diagnosis(detector, flagged_trace, format, headers):
    spans, flagged = flagged_trace
    body = encoded(spans, format)
    # a fresh server: its stream history (what it served before) is empty, as the detector's here
    with TestClient(create_app(detector, keyed_settings(max_spans=5_000, max_body_bytes=2_000_000)),
                    headers=KEY_HEADER) as client:
        response = client.post("/diagnose", content=body, headers=headers)

    assert response.status_code == 200, response.text
    diagnosis = Diagnosis.model_validate(response.json())
    assert diagnosis == suggest(detector.diagnose(read_spans_bytes(body, headers["content-type"])))
    (trace,) = diagnosis.traces
    assert trace.trace_id == spans["trace_id"][0].as_py()
    assert trace.anomalous and [s.service for s in trace.bottlenecks if s.bottleneck] == flagged
    assert trace.critical_path and trace.latencies
    assert {hint.service for hint in trace.mitigations} == set(flagged)


def test_the_diagnosis_is_kept_with_its_call_graph(client, flagged_trace):
    spans, _ = flagged_trace
    response = client.post("/diagnose", content=to_otlp_proto_bytes(spans), headers=PROTOBUF)
    kept = client.get(f"/diagnoses/{response.headers['x-diagnosis-id']}").json()

    (graph,) = kept["graphs"]
    assert kept["diagnosis"] == response.json()
    assert {n["span_service"] for n in graph["nodes"]} == set(spans["service"].to_pylist())
    latencies = {latency["service"] for latency in kept["diagnosis"]["traces"][0]["latencies"]}
    assert {n["service"] for n in graph["nodes"]} == latencies  # stores as the model names them
    assert sum(n["calls"] for n in graph["nodes"]) == spans.num_rows
    assert sum(e["calls"] for e in graph["edges"]) == spans.num_rows - 1  # every span but the root has a parent
    summaries = client.get("/diagnoses/recent").json()
    assert summaries[0]["id"] == response.headers["x-diagnosis-id"] and summaries[0]["anomalous"] == 1
    assert client.get("/diagnoses/nope").status_code == 404


def test_a_batch_in_window_mode_ranks_services_over_all_its_traces(client, hotel_dataset):
    trace_ids = hotel_dataset.traces["trace_id"].to_pylist()[:40]
    batch = traces_of(hotel_dataset.spans, trace_ids)
    response = client.post("/diagnose?window=true", content=to_otlp_proto_bytes(batch), headers=PROTOBUF)

    diagnosis = Diagnosis.model_validate(response.json())
    assert sorted(t.trace_id for t in diagnosis.traces) == sorted(trace_ids)
    services = {latency.service for trace in diagnosis.traces for latency in trace.latencies}
    assert diagnosis.ranking and {s.service for s in diagnosis.ranking} == services
    # a run of `bmeg train` keeps no normal traces: the answer says the window was ranked without them
    assert diagnosis.window_method == "mean-node-score"
    plain = client.post("/diagnose", content=to_otlp_proto_bytes(batch), headers=PROTOBUF).json()
    assert plain["ranking"] is None and plain["window_method"] is None


@pytest.mark.parametrize("body, headers, status, words", [
    (b"", PROTOBUF, 400, "empty body"),
    (b"\xff\x00garbage", PROTOBUF, 400, "malformed trace payload"),
    (b"{\"resourceSpans\": [", JSON, 400, "malformed trace payload"),
    (b"{}", {"content-type": "text/plain"}, 415, "unsupported content type"),
    (b"x" * 2_000_001, PROTOBUF, 413, "over the limit"),
])
def test_bad_requests_get_a_clear_4xx(client, body, headers, status, words):
    response = client.post("/diagnose", content=body, headers=headers)
    assert response.status_code == status
    assert words in response.json()["detail"]


def test_too_many_spans_is_refused(client, hotel_dataset):
    spans = hotel_dataset.spans.slice(0, 5_001)
    response = client.post("/diagnose", content=to_otlp_proto_bytes(spans), headers=PROTOBUF)
    assert response.status_code == 413 and "5001 spans" in response.json()["detail"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(min_size=1, max_size=300), content_type=st.sampled_from(["application/x-protobuf", "application/json"]))
def test_random_bytes_never_get_a_500(client, body, content_type):
    response = client.post("/diagnose", content=body, headers={"content-type": content_type})
    assert response.status_code in (200, 400, 422), response.text


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(["resourceSpans", "scopeSpans", "spans", "traceId", "spanId", "name",
                                          "startTimeUnixNano", "endTimeUnixNano", "data", "processes", "x"]),
                         inner, max_size=4), max_leaves=20)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=_json)
def test_json_shaped_garbage_never_gets_a_500(client, document):
    response = client.post("/diagnose", content=json.dumps(document).encode(), headers=JSON)
    assert response.status_code in (200, 400, 422), response.text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_protobuf_never_gets_a_500(client, flagged_trace, data):
    payload = bytearray(to_otlp_proto_bytes(flagged_trace[0]))
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    response = client.post("/diagnose", content=bytes(payload), headers=PROTOBUF)
    assert response.status_code in (200, 400, 422), response.text


def test_metrics_count_requests_traces_and_the_model(client, flagged_trace):
    before = _metric(client, "bmeg_traces_diagnosed_total")
    client.post("/diagnose", content=to_otlp_proto_bytes(flagged_trace[0]), headers=PROTOBUF)
    text = client.get("/metrics").text

    assert _metric(client, "bmeg_traces_diagnosed_total") == before + 1
    assert 'bmeg_http_requests_total{method="POST",route="/diagnose",status="200"}' in text
    assert 'bmeg_http_request_seconds_bucket{le="0.05",route="/diagnose"}' in text
    assert 'bmeg_model_info{application="hotelreservation"' in text


def _metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_openapi_documents_the_diagnosis_and_the_formats(client):
    spec = client.get("/openapi.json").json()
    operation = spec["paths"]["/diagnose"]["post"]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Diagnosis")
    assert {"application/x-protobuf", "application/json"} <= set(operation["requestBody"]["content"])
    assert "TraceDiagnosis" in spec["components"]["schemas"]


def test_readiness_waits_for_the_model_and_reports_a_failed_load(trained_run_dir):
    from bmeg.models.detector import Detector

    release = threading.Event()

    def slow_loader():
        release.wait(10)
        return Detector.load(trained_run_dir, device="cpu")

    with TestClient(create_app(slow_loader, keyed_settings()), headers=KEY_HEADER) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 503
        assert client.post("/diagnose", content=b"x", headers=PROTOBUF).status_code == 503
        release.set()
        wait_ready(client)
        assert client.get("/models").json()["model"]["application"] == "hotelreservation"

    with TestClient(create_app(lambda: Detector.load(trained_run_dir / "missing", device="cpu"), keyed_settings())) as client:
        deadline = time.monotonic() + 10
        while client.get("/readyz").json()["error"] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        state = client.get("/readyz")
        assert state.status_code == 503 and state.json()["error"] == "CheckpointError (details at /models)"
        assert "missing" in client.get("/models", headers=KEY_HEADER).json()["error"]


def test_reload_and_other_users_data_need_the_api_key(trained_run_dir, flagged_trace, monkeypatch):
    from bmeg.models.detector import Detector

    monkeypatch.setenv("BMEG_API_KEY", "s3cret")
    with TestClient(create_app(lambda: Detector.load(trained_run_dir, device="cpu"))) as client:
        wait_ready(client)
        posted = client.post("/diagnose", content=to_otlp_proto_bytes(flagged_trace[0]), headers=PROTOBUF)
        assert posted.status_code == 200  # diagnosing needs no key
        for method, path in [("POST", "/models/reload"), ("GET", "/models"), ("GET", "/diagnoses/recent"),
                             ("GET", f"/diagnoses/{posted.headers['x-diagnosis-id']}")]:
            for headers in ({}, {"X-API-Key": "wrong"}, {"X-API-Key": ""}, {"X-API-Key": "s3cre"}):
                refused = client.request(method, path, headers=headers)
                assert refused.status_code == 401, (method, path, headers)
                assert "X-API-Key" in refused.json()["detail"]
            assert client.request(method, path, headers={"X-API-Key": "s3cret"}).status_code == 200, path
        assert str(trained_run_dir) not in client.get("/readyz").text  # the probe shows no run directory
        assert client.get("/readyz").json()["ready"]


def test_no_key_no_server_unless_told_no_auth(monkeypatch):
    from pydantic import ValidationError

    monkeypatch.delenv("BMEG_API_KEY", raising=False)
    with pytest.raises(ValidationError, match="no API key"):
        create_app(StandInDetector())
    for empty in ("", "   "):
        monkeypatch.setenv("BMEG_API_KEY", empty)
        with pytest.raises(ValidationError, match="BMEG_API_KEY is empty"):
            create_app(StandInDetector())
    monkeypatch.delenv("BMEG_API_KEY")
    with TestClient(create_app(StandInDetector(), ServingSettings(no_auth=True))) as client:
        assert client.get("/models").status_code == 200


def test_openapi_declares_the_api_key_scheme(client):
    spec = client.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["APIKey"] == {
        "type": "apiKey", "in": "header", "name": "X-API-Key", "description": "The server's key (BMEG_API_KEY)."}
    for method, path in [("post", "/models/reload"), ("get", "/models"), ("get", "/diagnoses/recent"),
                         ("get", "/diagnoses/{diagnosis_id}")]:
        assert spec["paths"][path][method]["security"] == [{"APIKey": []}], path
    assert "security" not in spec["paths"]["/diagnose"]["post"]


def test_a_failed_reload_keeps_the_model_in_use(trained_run_dir):
    from bmeg.models.detector import Detector

    loads = iter([Detector.load(trained_run_dir, device="cpu")])

    def loader():
        model = next(loads, None)
        if model is None:
            raise CheckpointError("model.pt is from another version")
        return model

    with TestClient(create_app(loader, keyed_settings()), headers=KEY_HEADER) as client:
        wait_ready(client)
        response = client.post("/models/reload")
        assert response.status_code == 422 and "another version" in response.json()["detail"]
        assert client.get("/readyz").status_code == 200


def test_a_slow_diagnosis_times_out_with_504(flagged_trace):
    app = create_app(StandInDetector(delay_s=0.5), keyed_settings(request_timeout_s=0.1))
    with TestClient(app) as client:
        response = client.post("/diagnose", content=to_otlp_proto_bytes(flagged_trace[0]), headers=PROTOBUF)
    assert response.status_code == 504 and "longer than 0.1 s" in response.json()["detail"]
