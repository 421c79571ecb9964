"""Fixtures of the serving tests, a pytest plugin (`conftest.py` registers it); test modules
import only its plain helpers (`traces_of`, `StandInDetector`, `running`), never its fixtures.

`trained_run_dir` trains a small real model (hotelreservation, 2,000 traces, 2 epochs) into the
bmeg cache under a key that is the hash of bmeg's own source: any change to the code trains a
new one, so a model from older code is never reused; unchanged code pays the training once. `StandInDetector` is a model double for behaviour a real model cannot be
steered into (slow calls, failures on chosen traces).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import uvicorn

import bmeg
from bmeg.diagnosis import Diagnosis, ServiceScore, TraceDiagnosis
from bmeg.traces import TraceInputError

APPLICATION = "hotelreservation"
TRACES = 2000
#: The servers of the tests run with authentication on, as `bmeg serve` does by default.
API_KEY = "test-key-9f2c4e"
KEY_HEADER = {"X-API-Key": API_KEY}


def keyed_settings(**values):
    """`ServingSettings` with the tests' API key (and `values`)."""
    from bmeg.serving.settings import ServingSettings

    return ServingSettings(api_key=API_KEY, **values)


@contextmanager
def running(server_config: uvicorn.Config) -> Iterator[int]:
    """The server of `server_config` (port 0: the system picks one) on a thread; yields the port
    it listens on once it does, and stops it after."""
    server = uvicorn.Server(server_config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def trained_run_dir() -> Path:
    import torch

    from bmeg.models.checkpoint import CheckpointError
    from bmeg.models.detector import Detector
    from bmeg.paths import cache_dir
    from bmeg.training import train

    torch.set_num_threads(1)  # tiny graphs: threads only contend
    run_dir = cache_dir() / "test-runs" / f"serving-{APPLICATION}-{_source_hash()}"
    try:
        Detector.load(run_dir, device="cpu")
    except CheckpointError:  # not trained yet with this code, or left half-written
        train(dataset=APPLICATION, traces=TRACES, epochs=2, out=run_dir, device="cpu", progress=False)
    return run_dir


def _source_hash() -> str:
    """A digest of every bmeg source file: the trained fixture's cache key."""
    digest = hashlib.sha256()
    package = Path(bmeg.__file__).parent
    for path in sorted(package.rglob("*.py")) + sorted(package.rglob("*.yaml")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def detector(trained_run_dir: Path):
    from bmeg.models.detector import Detector

    return Detector.load(trained_run_dir, device="cpu")


@pytest.fixture(scope="session")
def hotel_dataset():
    from bmeg.datasets.loader import load_dataset

    return load_dataset(APPLICATION, TRACES, progress=False)


def traces_of(spans: pa.Table, trace_ids: list[str]) -> pa.Table:
    return spans.filter(pc.is_in(spans["trace_id"], pa.array(trace_ids)))


@pytest.fixture(scope="session")
def flagged_trace(detector, hotel_dataset) -> tuple[pa.Table, list[str]]:
    """The labelled-anomalous trace that the model, diagnosing it alone, flags with bottlenecks
    by the widest margin over its threshold (so rounding, e.g. Jaeger's microseconds, keeps it)."""
    labels = hotel_dataset.traces.filter(hotel_dataset.traces["anomalous"])
    best, best_margin = None, 0.0
    for trace_id in labels["trace_id"].to_pylist():
        spans = traces_of(hotel_dataset.spans, [trace_id])
        (trace,) = detector.diagnose(spans).traces
        flagged = [score.service for score in trace.bottlenecks if score.bottleneck]
        margin = trace.anomaly_score - trace.threshold
        if trace.anomalous and flagged and margin > best_margin:
            best, best_margin = (spans, flagged), margin
    if best is None:
        pytest.fail("the trained model flags no labelled-anomalous trace: training went wrong")
    return best


class StandInDetector:
    """Diagnoses each trace by its slowest span's service; `fail_on` trace ids raise; `delay_s` per call."""

    application = "stand-in"
    version = "stand-in/1"
    run_dir = None

    def __init__(self, delay_s: float = 0.0, fail_on: frozenset[str] = frozenset()):
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.calls: list[int] = []  # traces per call

    def diagnose(self, spans: pa.Table, window: bool = False) -> Diagnosis:
        time.sleep(self.delay_s)
        rows = spans.select(["trace_id", "service", "duration_ns"]).to_pylist()
        trace_ids = list(dict.fromkeys(row["trace_id"] for row in rows))
        bad = self.fail_on.intersection(trace_ids)
        if bad:
            raise TraceInputError(f"trace {sorted(bad)[0]}: refused by the stand-in")
        self.calls.append(len(trace_ids))
        traces = []
        for trace_id in trace_ids:
            mine = [row for row in rows if row["trace_id"] == trace_id]
            slowest = max(mine, key=lambda row: row["duration_ns"])["service"]
            traces.append(TraceDiagnosis(
                trace_id=trace_id, spans=len(mine), total_us=1.0, anomalous=True, anomaly_score=0.9, threshold=0.5,
                model="gnn", bottlenecks=[ServiceScore(service=slowest, score=0.9, bottleneck=True)]))
        ranking = [ServiceScore(service="window", score=1.0, bottleneck=True)] if window else None
        return Diagnosis(model_version=self.version, application=self.application, traces=traces, ranking=ranking)
