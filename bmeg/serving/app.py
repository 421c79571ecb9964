"""The REST API: `POST /diagnose`, health and readiness, metrics, models, recent diagnoses, the page.

Build it with `create_app(detector_or_loader, settings)`. Given a loader (a function returning
a detector), the model loads in the background after start-up, so `/healthz` answers at once
and `/readyz` turns ready when the model is in; `POST /models/reload` calls the loader again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from bmeg.version import __version__
from bmeg.diagnosis import Diagnosis
from bmeg.serving.batcher import MicroBatcher
from bmeg.serving.metrics import ServerMetrics
from bmeg.serving.model import DiagnosisModel, Loader, ModelSlot, ModelState
from bmeg.serving.otlp_http import router as otlp_router
from bmeg.serving.payloads import Answer, Limits, Payload, RequestRefused
from bmeg.serving.recent import RecentDiagnoses, RecentDiagnosis, RecentSummary
from bmeg.serving.settings import ServingSettings
from bmeg.traces.io import CONTENT_TYPES

log = logging.getLogger(__name__)

_STATIC = resources.files("bmeg.serving") / "static"
_TRACE_BODY = {"schema": {"type": "string", "format": "binary"}}
_DIAGNOSE_BODY = {
    "requestBody": {
        "required": True,
        "description": "One trace or a batch: OTLP protobuf (ExportTraceServiceRequest), OTLP/JSON or Jaeger JSON.",
        "content": {media_type: _TRACE_BODY for media_type in CONTENT_TYPES},
    }
}


def create_app(detector_or_loader: DiagnosisModel | Loader, settings: ServingSettings | None = None) -> FastAPI:
    settings = settings or ServingSettings()
    slot = ModelSlot(detector_or_loader)
    recent = RecentDiagnoses(settings.recent_diagnoses)
    metrics = ServerMetrics()
    batcher = MicroBatcher(slot, Limits(settings.max_spans, settings.max_batch_spans), settings.max_body_bytes,
                           settings.batch_interval_ms / 1e3)

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
        body = await _read_body(request, settings.max_body_bytes)
        if not slot.ready:
            raise HTTPException(503, "the model is not loaded yet")
        answer = await _diagnose(batcher, Payload(body, media_type), window, settings.request_timeout_s)
        metrics.count_diagnosis(answer.diagnosis)
        # Serialised directly: the Diagnosis is already validated (response_model documents it).
        return Response(answer.diagnosis.model_dump_json(), media_type="application/json",
                        headers={"X-Diagnosis-Id": recent.add(answer.diagnosis, answer.spans)})

    @app.get("/healthz")
    async def healthz() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", response_model=ModelState, responses={503: {"description": "Model not loaded"}})
    async def readyz():
        """Readiness: a model is loaded."""
        state = slot.state()
        return state if state.ready else JSONResponse(state.model_dump(), status_code=503)

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/models", response_model=ModelState)
    async def models() -> ModelState:
        """The model in use (and the last load error, if any)."""
        return slot.state()

    @app.post("/models/reload", response_model=ModelState, dependencies=[Depends(require_key)])
    async def reload_model() -> ModelState:
        """Load the model again from its run directory (e.g. after retraining). Needs the API key when set."""
        if not slot.can_reload:
            raise HTTPException(409, "this server was started with a model object, not a run directory")
        try:
            await run_in_threadpool(slot.load)
        except Exception as error:  # noqa: BLE001 - the old model stays in use; say why
            raise HTTPException(422, f"reload failed, the previous model stays in use: {slot.error}") from error
        _model_metrics(slot, metrics)
        return slot.state()

    @app.get("/diagnoses/recent", response_model=list[RecentSummary])
    async def recent_diagnoses(limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> list[RecentSummary]:
        """The latest diagnoses, newest first."""
        return recent.summaries(limit)

    @app.get("/diagnoses/{diagnosis_id}", response_model=RecentDiagnosis, responses={404: {"description": "Gone"}})
    async def recent_diagnosis(diagnosis_id: str) -> RecentDiagnosis:
        """One recent diagnosis with the call graphs of its traces."""
        item = await run_in_threadpool(recent.get, diagnosis_id)
        if item is None:
            raise HTTPException(404, f"no recent diagnosis {diagnosis_id!r} (only the last {settings.recent_diagnoses} are kept)")
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


def _model_metrics(slot: ModelSlot, metrics: ServerMetrics) -> None:
    info = slot.state().model
    metrics.model.info({"application": info.application, "version": info.version, "run_dir": info.run_dir or ""})
    metrics.model_loaded.set(1)


def _media_type(request: Request) -> str:
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";")[0].strip().lower()
    if media_type not in CONTENT_TYPES:
        raise HTTPException(415, f"unsupported content type {content_type!r}; send one of {sorted(CONTENT_TYPES)}")
    return media_type


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to pass `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"body of {declared} bytes is over the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"body is over the limit of {limit} bytes")
    if not body:
        raise HTTPException(400, "empty body: send a trace")
    return bytes(body)


async def _diagnose(batcher: MicroBatcher, payload: Payload, window: bool, timeout_s: float) -> Answer:
    try:
        return await asyncio.wait_for(batcher.diagnose(payload, window), timeout_s)
    except RequestRefused as refusal:
        raise HTTPException(refusal.status, refusal.message) from None
    except TimeoutError:
        raise HTTPException(504, f"diagnosis took longer than {timeout_s:g} s") from None


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
    async def require_api_key(x_api_key: Annotated[str | None, Header()] = None) -> None:
        expected = settings.api_key
        if expected is None:
            return
        if x_api_key is None or not secrets.compare_digest(x_api_key.encode(), expected.get_secret_value().encode()):
            raise HTTPException(401, "this request changes state: send the API key in the X-API-Key header",
                                headers={"WWW-Authenticate": "X-API-Key"})

    return require_api_key
