"""`POST /v1/traces`: an OTLP/HTTP receiver, so an SDK or the Collector's `otlphttp` exporter can
send spans to bmeg without Kafka (the OTLP/HTTP specification's request and response).

- Body: an `ExportTraceServiceRequest`, `application/x-protobuf` or `application/json` (OTLP/JSON:
  hex ids, unknown fields ignored), optionally `Content-Encoding: gzip`. The body is refused
  past `BMEG_MAX_BODY_BYTES` (413) and inflated at most to it, so a small bomb cannot take memory.
- The API key (`BMEG_API_KEY`, sent as `X-API-Key`: the `otlphttp` exporter's `headers`) is
  required when the server has one: what comes in here is published and may reach the
  mitigation controller, which acts on the cluster (401 without it).
- Answer: `ExportTraceServiceResponse` in the request's encoding (empty: every span accepted),
  once the spans are queued. The spans are assembled into traces, diagnosed and published to
  Kafka exactly as `bmeg consume` does (`bmeg.serving.ingest`).
- 429 with Retry-After while the spans held (queued, assembling, awaiting the broker) are at the
  bound (`BMEG_OTLP_MAX_HELD_SPANS`); 503 with Retry-After while no model is loaded or when
  publishing has failed for good; 404 when the endpoint is off (no `BMEG_OTLP_BOOTSTRAP`);
  400 for a body that is not a trace, 415 for another content type.

Settings: `bmeg.serving.ingest.IngestSettings` (`BMEG_OTLP_*`). The router's lifespan starts the
ingest worker with the server and, at shutdown, publishes what it holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from starlette.concurrency import run_in_threadpool

from bmeg.serving.dependencies import API_KEY_HEADER, check_api_key, read_body
from bmeg.traces import TraceInputError
from bmeg.traces.io import read_spans_bytes

PROTOBUF, JSON = "application/x-protobuf", "application/json"


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the ingest worker when `BMEG_OTLP_BOOTSTRAP` is set (Kafka is imported only then:
    a server without the `kafka` extra serves everything else)."""
    from bmeg.serving.ingest import IngestSettings

    settings = IngestSettings()
    ingest = None
    if settings.bootstrap is not None:
        from bmeg.serving.ingest import OtlpIngest

        ingest = OtlpIngest(settings, app.state.slot.call)
        ingest.start()
    app.state.otlp_ingest = ingest
    try:
        yield
    finally:
        if ingest is not None:
            await run_in_threadpool(ingest.stop)


router = APIRouter(lifespan=_lifespan)


@router.post("/v1/traces", response_class=Response,
             responses={400: {"description": "Not an OTLP trace export"}, 401: {"description": "No or wrong API key"}, 404: {"description": "Off: no Kafka configured"},
                        413: {"description": "Too large"}, 415: {"description": "Unsupported content type"},
                        429: {"description": "Queue full: retry after Retry-After"},
                        503: {"description": "No model loaded, or publishing failed"}})
async def export_traces(request: Request) -> Response:
    """Accept spans as an OTLP/HTTP exporter sends them; their traces are diagnosed and published to Kafka."""
    ingest = getattr(request.app.state, "otlp_ingest", None)
    if ingest is None:
        raise HTTPException(404, "POST /v1/traces is off: set BMEG_OTLP_BOOTSTRAP to the Kafka brokers to publish to")
    check_api_key(request.headers.get(API_KEY_HEADER), request.app.state.settings.api_key)
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in (PROTOBUF, JSON):
        raise HTTPException(415, f"content type {media_type or '(none)'}: send {PROTOBUF} or {JSON}")
    retry_after = {"Retry-After": str(ingest.settings.retry_after_s)}
    if ingest.failed is not None:
        raise HTTPException(503, f"publishing diagnoses failed: {ingest.failed}", headers=retry_after)
    if not request.app.state.slot.ready:
        raise HTTPException(503, "the model is not loaded yet", headers=retry_after)
    limit = request.app.state.settings.max_body_bytes
    body = await read_body(request, limit, allow_empty=True)
    try:
        spans = await run_in_threadpool(read_spans_bytes, body, media_type, max_inflated_bytes=limit)
    except TraceInputError as error:
        raise HTTPException(400, f"not an OTLP trace export: {error}") from None
    if spans.num_rows and not ingest.offer(spans):
        raise HTTPException(429, f"{ingest.held_spans} spans are waiting to be diagnosed and published: retry later",
                            headers=retry_after)
    if media_type == JSON:
        return Response(b"{}", media_type=JSON)
    return Response(ExportTraceServiceResponse().SerializeToString(), media_type=PROTOBUF)


