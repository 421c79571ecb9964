"""Recent diagnoses kept in memory (a bounded ring), for the web page.

Each keeps the spans of its first traces; their call graphs are built only when the page
asks for them, so a busy server does not pay for graphs nobody looks at.
"""

from __future__ import annotations

import threading
import time
import itertools
import secrets
from collections import deque
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from bmeg.diagnosis import Diagnosis
from bmeg.serving.graphview import TraceGraph, trace_graphs

#: Call graphs kept per diagnosis: the page shows one trace at a time, batches can be large.
GRAPHS_PER_DIAGNOSIS = 50


class RecentDiagnosis(BaseModel):
    id: str
    received_at: float
    diagnosis: Diagnosis
    graphs: list[TraceGraph]


@dataclass
class _Kept:
    id: str
    received_at: float
    diagnosis: Diagnosis
    spans: pa.Table  # of the traces whose graphs are kept

    def view(self) -> RecentDiagnosis:
        kept = [trace.trace_id for trace in self.diagnosis.traces[:GRAPHS_PER_DIAGNOSIS]]
        return RecentDiagnosis(id=self.id, received_at=self.received_at, diagnosis=self.diagnosis,
                               graphs=trace_graphs(self.spans, kept))


class RecentSummary(BaseModel):
    id: str
    received_at: float
    traces: int
    anomalous: int
    top_service: str | None


class RecentDiagnoses:
    def __init__(self, capacity: int):
        self._items: deque[_Kept] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        # ids: a random prefix per server and a counter (uuid4 reads the OS entropy pool per call)
        self._ids = (f"{secrets.token_hex(4)}{n:08x}" for n in itertools.count())

    def add(self, diagnosis: Diagnosis, spans: pa.Table) -> str:
        """Keep a diagnosis and the spans of its first traces; returns its id."""
        kept = [trace.trace_id for trace in diagnosis.traces[:GRAPHS_PER_DIAGNOSIS]]
        if len(kept) < len(diagnosis.traces):
            spans = spans.filter(pc.is_in(spans["trace_id"], pa.array(kept, pa.string())))
        with self._lock:
            item = _Kept(next(self._ids), time.time(), diagnosis, spans)
            self._items.append(item)
        return item.id

    def get(self, diagnosis_id: str) -> RecentDiagnosis | None:
        with self._lock:
            item = next((item for item in self._items if item.id == diagnosis_id), None)
        return None if item is None else item.view()

    def summaries(self, limit: int) -> list[RecentSummary]:
        with self._lock:
            newest_first = list(reversed(self._items))[:limit]
        return [_summary(item) for item in newest_first]


def _summary(item: _Kept) -> RecentSummary:
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
