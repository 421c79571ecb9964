"""The REST API: `POST /diagnose`, health and readiness, metrics, models, recent diagnoses, the page.

Build it with `create_app(detector_or_loader, settings)`. Given a loader (a function returning
a detector), the model loads in the background after start-up, so `/healthz` answers at once
and `/readyz` turns ready when the model is in; `POST /models/reload` calls the loader again.

Security (README, Security):
- The API key (`X-API-Key`, the `APIKeyHeader` scheme of the OpenAPI document, compared in
  constant time) guards what changes state or shows other users' data: `POST /models/reload`,
  `GET /models` (the run directory), `GET /diagnoses/*` (other users' traces). Settings without
  a key refuse to build the app unless `no_auth` is set. `/diagnose`, the probes, `/metrics` and
  the page stay open (the page asks for the key).
- Limits (`bmeg.serving.settings`): the body's bytes (as sent and as inflated), spans, traces,
  JSON depth and number length per request, the answer's bytes, the recent diagnoses' bytes.
- Every answer carries `X-Content-Type-Options: nosniff`; all but the interactive API docs
  (which load Swagger UI from a CDN) a Content-Security-Policy that allows only this origin's
  scripts and styles, no inline ones, and no framing (`frame-ancestors 'none'`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Security
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from bmeg.version import __version__
from bmeg.diagnosis import Diagnosis
from bmeg.serving.batcher import MicroBatcher
from bmeg.serving.dependencies import API_KEY_SCHEME, check_api_key, read_body
from bmeg.serving.metrics import ServerMetrics
from bmeg.serving.model import DiagnosisModel, Loader, ModelSlot, ModelState
from bmeg.serving.otlp_http import router as otlp_router
from bmeg.serving.payloads import Answer, Limits, Parts, Payload, RequestRefused, merge
from bmeg.serving.recent import RecentDiagnoses, RecentDiagnosis, RecentSummary
from bmeg.serving.settings import ServingSettings
from bmeg.traces.io import CONTENT_TYPES

log = logging.getLogger(__name__)

_STATIC = resources.files("bmeg.serving") / "static"
#: The page's policy: scripts, styles and fetches from this origin only, nothing inline, no framing.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
_DOCS = ("/docs", "/redoc")  # Swagger UI and ReDoc come from a CDN, with inline scripts
_TRACE_BODY = {"schema": {"type": "string", "format": "binary"}}
_DIAGNOSE_BODY = {
    "requestBody": {
        "required": True,
        "description": "One trace or a batch: OTLP protobuf (ExportTraceServiceRequest), OTLP/JSON or Jaeger JSON.",
        "content": {media_type: _TRACE_BODY for media_type in CONTENT_TYPES},
    }
}


def create_app(detector_or_loader: DiagnosisModel | Loader, settings: ServingSettings | None = None) -> FastAPI:
    """The app; raises `pydantic.ValidationError` (saying what to set) for settings without an API key
    unless they say `no_auth`."""
    settings = settings or ServingSettings()
    slot = ModelSlot(detector_or_loader)
    recent = RecentDiagnoses(settings.recent_diagnoses, settings.recent_bytes)
    metrics = ServerMetrics()
    limits = Limits(settings.max_spans, settings.max_batch_spans, settings.max_traces, settings.max_body_bytes,
                    settings.max_json_depth, settings.max_json_number_digits, settings.split_spans)
    batcher = MicroBatcher(slot, limits, settings.max_body_bytes, settings.batch_interval_ms / 1e3)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(_load(slot, metrics)) if slot.can_reload else None
        if slot.ready:
            _model_metrics(slot, metrics)
        batcher.start()
        yield
        await batcher.stop()
        if loading is not None:
            loading.cancel()
        slot.close()

    app = FastAPI(title="bmeg", version=__version__, lifespan=lifespan,
                  description="Bottlenecked microservices from distributed traces (B-MEG).")
    app.state.slot, app.state.recent, app.state.metrics, app.state.settings = slot, recent, metrics, settings
    app.add_middleware(_Measure, metrics=metrics)
    app.add_middleware(_SecurityHeaders)
    app.mount("/static", StaticFiles(directory=str(_STATIC)), name="static")
    app.include_router(otlp_router)  # POST /v1/traces
    require_key = _api_key_dependency(settings)

    @app.post("/diagnose", response_model=Diagnosis, openapi_extra=_DIAGNOSE_BODY,
              responses={400: {"description": "Malformed trace payload"}, 413: {"description": "Too large"},
                         415: {"description": "Unsupported content type"}, 422: {"description": "Invalid trace"},
                         503: {"description": "Model not loaded"}, 504: {"description": "Timed out"}})
    async def diagnose(request: Request,
                       window: Annotated[bool, Query(description="Also rank services over the whole batch.")] = False
                       ) -> Response:
        """Diagnose the traces in the body: anomalous or not, bottleneck services, evidence."""
        media_type = _media_type(request)
        body = await read_body(request, settings.max_body_bytes)
        if not slot.ready:
            raise HTTPException(503, "the model is not loaded yet")
        payload = Payload(body, media_type, request.headers.get("content-encoding"))
        answer = await _diagnose(batcher, payload, window, settings.request_timeout_s)
        metrics.count_diagnosis(answer.diagnosis)
        # Serialised directly: the Diagnosis is already validated (response_model documents it).
        document = answer.diagnosis.model_dump_json().encode()
        if len(document) > settings.max_response_bytes:
            raise HTTPException(413, f"the answer of {len(document)} bytes is over the limit of "
                                     f"{settings.max_response_bytes} (BMEG_MAX_RESPONSE_BYTES): send fewer traces")
        return Response(document, media_type="application/json",
                        headers={"X-Diagnosis-Id": recent.add(answer.diagnosis, answer.spans, document)})

    @app.get("/healthz")
    async def healthz() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", response_model=Readiness, responses={503: {"description": "Model not loaded"}})
    async def readyz():
        """Readiness: a model is loaded (details, such as a load error's, at `/models`, with the key)."""
        state = slot.state()
        error = None if state.error is None else f"{state.error.split(':')[0]} (details at /models)"
        readiness = Readiness(ready=state.ready, version=state.model.version if state.model else None, error=error)
        return readiness if state.ready else JSONResponse(readiness.model_dump(), status_code=503)

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/models", response_model=ModelState, dependencies=[Depends(require_key)])
    async def models() -> ModelState:
        """The model in use (and the last load error, if any). Needs the API key."""
        return slot.state()

    @app.post("/models/reload", response_model=ModelState, dependencies=[Depends(require_key)])
    async def reload_model() -> ModelState:
        """Load the model again from its run directory (e.g. after retraining). Needs the API key."""
        if not slot.can_reload:
            raise HTTPException(409, "this server was started with a model object, not a run directory")
        try:
            await run_in_threadpool(slot.load)
        except Exception as error:  # noqa: BLE001 - the old model stays in use; say why
            raise HTTPException(422, f"reload failed, the previous model stays in use: {slot.error}") from error
        _model_metrics(slot, metrics)
        return slot.state()

    @app.get("/diagnoses/recent", response_model=list[RecentSummary], dependencies=[Depends(require_key)])
    async def recent_diagnoses(limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> list[RecentSummary]:
        """The latest diagnoses, newest first. Needs the API key."""
        return recent.summaries(limit)

    @app.get("/diagnoses/{diagnosis_id}", response_model=RecentDiagnosis, responses={404: {"description": "Gone"}},
             dependencies=[Depends(require_key)])
    async def recent_diagnosis(diagnosis_id: str) -> RecentDiagnosis:
        """One recent diagnosis with the call graphs of its traces. Needs the API key."""
        item = await run_in_threadpool(recent.get, diagnosis_id)
        if item is None:
            raise HTTPException(404, f"no recent diagnosis {diagnosis_id[:100]!r} (only the last "
                                     f"{settings.recent_diagnoses}, within {settings.recent_bytes} bytes, are kept)")
        return item

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse((_STATIC / "index.html").read_text(encoding="utf-8"))

    return app


async def _load(slot: ModelSlot, metrics: ServerMetrics) -> None:
    try:
        await asyncio.to_thread(slot.load)
    except Exception:  # noqa: BLE001 - reported by /readyz; the server stays up for probes and reloads
        log.exception("loading the model failed")
        return
    _model_metrics(slot, metrics)


class Readiness(BaseModel):
    ready: bool
    version: str | None = None
    error: str | None = None


def _model_metrics(slot: ModelSlot, metrics: ServerMetrics) -> None:
    info = slot.state().model
    metrics.know_services(getattr(slot.model, "services", ()))
    metrics.model.info({"application": info.application, "version": info.version, "run_dir": info.run_dir or ""})
    metrics.model_loaded.set(1)


def _media_type(request: Request) -> str:
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";")[0].strip().lower()
    if media_type not in CONTENT_TYPES:
        raise HTTPException(415, f"unsupported content type {content_type!r}; send one of {sorted(CONTENT_TYPES)}")
    return media_type


async def _diagnose(batcher: MicroBatcher, payload: Payload, window: bool, timeout_s: float) -> Answer:
    try:
        return await asyncio.wait_for(_diagnose_in_parts(batcher, payload, window), timeout_s)
    except RequestRefused as refusal:
        raise HTTPException(refusal.status, refusal.message) from None
    except TimeoutError:
        raise HTTPException(504, f"diagnosis took longer than {timeout_s:g} s") from None


async def _diagnose_in_parts(batcher: MicroBatcher, payload: Payload, window: bool) -> Answer:
    """The answer; a large request comes back as `Parts`, queued again one by one, so requests that
    arrived meanwhile go between them (a large request cannot starve small ones)."""
    answer = await batcher.diagnose(payload, window)
    if not isinstance(answer, Parts):
        return answer
    answers = [await batcher.diagnose(Payload(b"", payload.media_type, spans=part), window) for part in answer.tables]
    return merge(answers)


class _SecurityHeaders:
    """`X-Content-Type-Options`, `Referrer-Policy` and (but for the API docs) the Content-Security-Policy
    on every answer: a plain ASGI middleware, like `_Measure`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]
        if not scope["path"].startswith(_DOCS):
            extra += [(b"content-security-policy", CONTENT_SECURITY_POLICY.encode()), (b"x-frame-options", b"DENY")]

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _Measure:
    """Request counts and latencies by route template: a plain ASGI middleware (cheaper per request
    than Starlette's BaseHTTPMiddleware)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client sees if the app raises before answering

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "<unmatched>")
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()


def _api_key_dependency(settings: ServingSettings):
    async def require_api_key(key: Annotated[str | None, Security(API_KEY_SCHEME)]) -> None:
        check_api_key(key, settings.api_key)

    return require_api_key
