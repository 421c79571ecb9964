"""The model the server uses: loaded in the background, swapped on reload, used one call at a time.

The model and its `ModelInfo` change together: they are one `_Loaded` pair, assigned in one
step, so `/readyz` never says ready while `/models` has no model yet.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

import pyarrow as pa
from pydantic import BaseModel

from bmeg.diagnosis import Diagnosis
from bmeg.models.detector import Detector
from bmeg.models.history import StreamedDetector
from bmeg.serving.payloads import Answer, Limits, Parts, Payload, diagnose_payloads


@runtime_checkable
class DiagnosisModel(Protocol):
    """What the server needs of `bmeg.models.detector.Detector`."""

    application: str
    run_dir: Path | None

    @property
    def version(self) -> str: ...

    def diagnose(self, spans: pa.Table, window: bool = False) -> Diagnosis: ...


Loader = Callable[[], DiagnosisModel]
T = TypeVar("T")


class ModelInfo(BaseModel):
    application: str
    version: str
    run_dir: str | None
    loaded_at: float


class ModelState(BaseModel):
    ready: bool
    model: ModelInfo | None
    error: str | None = None


@dataclass(frozen=True)
class _Loaded:
    model: DiagnosisModel
    info: ModelInfo


class ModelSlot:
    """Holds the model and the history of the traces it has served (`StreamedDetector`, the
    server's stream state: the detector itself holds none), so calls are serialised."""

    def __init__(self, model_or_loader: DiagnosisModel | Loader):
        self._loaded: _Loaded | None = None
        self.error: str | None = None
        self._lock = threading.Lock()
        if isinstance(model_or_loader, DiagnosisModel):
            self._loader: Loader | None = None
            self._set(model_or_loader)
        else:
            self._loader = model_or_loader

    @property
    def ready(self) -> bool:
        return self._loaded is not None

    @property
    def can_reload(self) -> bool:
        return self._loader is not None

    @property
    def model(self) -> DiagnosisModel | None:
        loaded = self._loaded
        return None if loaded is None else loaded.model

    def state(self) -> ModelState:
        loaded = self._loaded  # read once: ready and info from the same pair
        return ModelState(ready=loaded is not None, model=None if loaded is None else loaded.info, error=self.error)

    def load(self) -> None:
        """Load (or reload) through the loader; on failure the model in use, if any, stays."""
        if self._loader is None:
            raise RuntimeError("this server was given a model object, not a loader: nothing to reload from")
        try:
            model = self._loader()
        except Exception as error:  # noqa: BLE001 - kept for /readyz and /models; the old model stays
            self.error = f"{type(error).__name__}: {error}"
            raise
        with self._lock:
            self._set(model)
            self.error = None

    def diagnose_payloads(self, payloads: list[Payload], window: bool, limits: Limits) -> list[Answer | Parts | Exception]:
        """`bmeg.serving.payloads.diagnose_payloads` with the model in use (in its process, if it has one)."""
        with self._lock:
            model = self.model
            if model is None:
                raise RuntimeError("no model loaded")
            if hasattr(model, "diagnose_payloads"):  # a model process: the whole job runs there
                return model.diagnose_payloads(payloads, window, limits)
            return diagnose_payloads(model, payloads, window, limits)

    def call(self, work: Callable[[DiagnosisModel], T]) -> T:
        """`work` with the model in use, one call at a time (`POST /v1/traces` diagnoses this way)."""
        with self._lock:
            model = self.model
            if model is None:
                raise RuntimeError("no model loaded")
            return work(model)

    def close(self) -> None:
        """Stop the model's process, if it has one (see `bmeg.serving.model_process`)."""
        with self._lock:
            _close(self.model)

    def _set(self, model: DiagnosisModel) -> None:
        if isinstance(model, Detector):  # in process: the server owns the stream's history
            model = StreamedDetector(model)
        run_dir = getattr(model, "run_dir", None)
        info = ModelInfo(application=model.application, version=model.version,
                         run_dir=None if run_dir is None else str(run_dir), loaded_at=time.time())
        previous, self._loaded = self.model, _Loaded(model, info)
        if previous is not model:
            _close(previous)
        freeze_heap()


def freeze_heap() -> None:
    """Take everything alive now (the model, the libraries) out of the cycle collector's sight.

    A full collection walks torch's and pydantic's millions of objects and stalls every answer
    for ~200 ms, several times a minute under load. Unfrozen first, so an old model's garbage goes,
    and at exit, when extension modules (nanobind's) check that their objects were collected.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


def _close(model: DiagnosisModel | None) -> None:
    close = getattr(model, "close", None)
    if close is not None:
        close()
