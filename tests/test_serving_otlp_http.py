"""`POST /v1/traces` as an OTLP/HTTP receiver, without a broker: the answers of the protocol
(ExportTraceServiceResponse in the request's encoding), refusals (415, 400, 404), and
backpressure: with the broker away nothing is published, the spans held reach the bound and
the next request is refused with 429 and Retry-After, which OTLP senders retry. The path through
the real Collector and Kafka is tests/test_collector_pipeline.py."""

from __future__ import annotations

import gzip
import json
import socket

import pytest
from fastapi.testclient import TestClient

from bmeg.serving.app import create_app
from bmeg.serving.settings import ServingSettings
from bmeg.traces import to_otlp_proto_bytes
from bmeg.traces.io import table_to_otlp_json
from serving_fixtures import StandInDetector, traces_of

KEY = "otlp-test-key"
PROTOBUF = {"content-type": "application/x-protobuf", "x-api-key": KEY}


def keyed_app():
    return create_app(StandInDetector(), ServingSettings(api_key=KEY))


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again on return: nothing listens there


@pytest.fixture
def away_broker(monkeypatch) -> None:
    monkeypatch.setenv("BMEG_OTLP_BOOTSTRAP", f"127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("BMEG_OTLP_MAX_HELD_SPANS", "20")
    monkeypatch.setenv("BMEG_OTLP_SHUTDOWN_TIMEOUT_S", "0")


def test_spans_are_accepted_in_both_encodings_until_the_bound_then_429_with_retry_after(away_broker, hotel_dataset):
    first, second = hotel_dataset.traces["trace_id"].to_pylist()[:2]
    with TestClient(keyed_app()) as client:
        accepted = client.post("/v1/traces", content=json.dumps(table_to_otlp_json(traces_of(hotel_dataset.spans, [first]))),
                               headers={"content-type": "application/json", "x-api-key": KEY})
        assert accepted.status_code == 200, accepted.text
        assert accepted.json() == {} and accepted.headers["content-type"] == "application/json"
        body = gzip.compress(to_otlp_proto_bytes(traces_of(hotel_dataset.spans, [second])))
        refused = client.post("/v1/traces", content=body, headers={**PROTOBUF, "content-encoding": "gzip"})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert client.app.state.otlp_ingest.held_spans == traces_of(hotel_dataset.spans, [first]).num_rows


def test_the_answer_is_an_export_response_in_protobuf(monkeypatch, hotel_dataset):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    monkeypatch.setenv("BMEG_OTLP_BOOTSTRAP", f"127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("BMEG_OTLP_SHUTDOWN_TIMEOUT_S", "0")
    trace_id = hotel_dataset.traces["trace_id"][0].as_py()
    with TestClient(keyed_app()) as client:
        answer = client.post("/v1/traces", content=gzip.compress(to_otlp_proto_bytes(traces_of(hotel_dataset.spans, [trace_id]))),
                             headers={**PROTOBUF, "content-encoding": "gzip"})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-protobuf"
    response = ExportTraceServiceResponse.FromString(answer.content)
    assert not response.HasField("partial_success")  # every span accepted


def test_bad_bodies_are_refused_with_a_reason(away_broker):
    with TestClient(keyed_app()) as client:
        assert client.post("/v1/traces", content=b"x", headers={"content-type": "text/plain", "x-api-key": KEY}).status_code == 415
        unkeyed = client.post("/v1/traces", content=b"x", headers={"content-type": "application/x-protobuf"})
        assert unkeyed.status_code == 401  # what comes in may reach the mitigation controller
        garbage = client.post("/v1/traces", content=b"\x0a\xff\xffnot protobuf", headers=PROTOBUF)
        assert garbage.status_code == 400 and "not an OTLP trace export" in garbage.json()["detail"]
        bomb = gzip.compress(b"\0" * (64 << 20))  # inflates past the body limit (16 MiB)
        inflated = client.post("/v1/traces", content=bomb, headers={**PROTOBUF, "content-encoding": "gzip"})
        assert inflated.status_code == 400 and "inflates to more than" in inflated.json()["detail"]


def test_the_endpoint_is_off_without_a_broker_to_publish_to(monkeypatch):
    monkeypatch.delenv("BMEG_OTLP_BOOTSTRAP", raising=False)
    with TestClient(keyed_app()) as client:
        answer = client.post("/v1/traces", content=b"", headers=PROTOBUF)
    assert answer.status_code == 404 and "BMEG_OTLP_BOOTSTRAP" in answer.json()["detail"]
