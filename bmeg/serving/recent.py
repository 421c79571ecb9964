"""Recent diagnoses kept in memory (a bounded ring), each with its call graphs, for the web page."""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque

from pydantic import BaseModel

from bmeg.diagnosis import Diagnosis
from bmeg.serving.graphview import TraceGraph

#: Call graphs kept per diagnosis: the page shows one trace at a time, batches can be large.
GRAPHS_PER_DIAGNOSIS = 50


class RecentDiagnosis(BaseModel):
    id: str
    received_at: float
    diagnosis: Diagnosis
    graphs: list[TraceGraph]


class RecentSummary(BaseModel):
    id: str
    received_at: float
    traces: int
    anomalous: int
    top_service: str | None


class RecentDiagnoses:
    def __init__(self, capacity: int):
        self._items: deque[RecentDiagnosis] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, diagnosis: Diagnosis, graphs: list[TraceGraph]) -> RecentDiagnosis:
        item = RecentDiagnosis(id=uuid.uuid4().hex[:16], received_at=time.time(), diagnosis=diagnosis, graphs=graphs)
        with self._lock:
            self._items.append(item)
        return item

    def get(self, diagnosis_id: str) -> RecentDiagnosis | None:
        with self._lock:
            return next((item for item in self._items if item.id == diagnosis_id), None)

    def summaries(self, limit: int) -> list[RecentSummary]:
        with self._lock:
            newest_first = list(reversed(self._items))[:limit]
        return [_summary(item) for item in newest_first]


def _summary(item: RecentDiagnosis) -> RecentSummary:
    return RecentSummary(id=item.id, received_at=item.received_at, traces=len(item.diagnosis.traces),
                         anomalous=len(item.diagnosis.anomalous), top_service=_top_service(item.diagnosis))


def _top_service(diagnosis: Diagnosis) -> str | None:
    """The window's first service, else the first anomalous (or first) trace's."""
    if diagnosis.ranking:
        return diagnosis.ranking[0].service
    traces = diagnosis.anomalous or diagnosis.traces
    if traces and traces[0].bottlenecks:
        return traces[0].bottlenecks[0].service
    return None
