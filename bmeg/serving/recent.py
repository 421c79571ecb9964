"""Recent diagnoses kept in memory, for the web page: at most `capacity` of them and `max_bytes`.

Each keeps its diagnosis as JSON bytes (a fraction of the typed objects' memory) and the spans
of its first traces; the call graphs are built only when the page asks for them, so a busy
server does not pay for graphs nobody looks at. An item's size is its JSON's length plus its
spans' Arrow buffers; the oldest go first when the total passes `max_bytes` (a diagnosis larger
than the whole budget is not kept).
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


class RecentSummary(BaseModel):
    id: str
    received_at: float
    traces: int
    anomalous: int
    top_service: str | None


@dataclass
class _Kept:
    summary: RecentSummary
    diagnosis_json: bytes
    spans: pa.Table  # of the traces whose graphs are kept
    trace_ids: list[str]  # those traces

    @property
    def size(self) -> int:
        return len(self.diagnosis_json) + self.spans.nbytes

    def view(self) -> RecentDiagnosis:
        return RecentDiagnosis(id=self.summary.id, received_at=self.summary.received_at,
                               diagnosis=Diagnosis.model_validate_json(self.diagnosis_json),
                               graphs=trace_graphs(self.spans, self.trace_ids))


class RecentDiagnoses:
    def __init__(self, capacity: int, max_bytes: int = 64 * 1024 * 1024):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._items: deque[_Kept] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        # ids: a random prefix per server and a counter (uuid4 reads the OS entropy pool per call)
        self._ids = (f"{secrets.token_hex(4)}{n:08x}" for n in itertools.count())

    @property
    def held_bytes(self) -> int:
        """Memory the kept diagnoses hold (their JSON and spans)."""
        return self._bytes

    def add(self, diagnosis: Diagnosis, spans: pa.Table, diagnosis_json: bytes | None = None) -> str:
        """Keep a diagnosis (`diagnosis_json`: its JSON, when already made) and the spans of its
        first traces; returns its id."""
        kept = [trace.trace_id for trace in diagnosis.traces[:GRAPHS_PER_DIAGNOSIS]]
        if len(kept) < len(diagnosis.traces):
            spans = spans.filter(pc.is_in(spans["trace_id"], pa.array(kept, pa.string())))
        summary = RecentSummary(id=next(self._ids), received_at=time.time(), traces=len(diagnosis.traces),
                                anomalous=len(diagnosis.anomalous), top_service=_top_service(diagnosis))
        item = _Kept(summary, diagnosis_json or diagnosis.model_dump_json().encode(), spans, kept)
        with self._lock:
            self._items.append(item)
            self._bytes += item.size
            while self._items and (len(self._items) > self.capacity or self._bytes > self.max_bytes):
                self._bytes -= self._items.popleft().size
        return summary.id

    def get(self, diagnosis_id: str) -> RecentDiagnosis | None:
        with self._lock:
            item = next((item for item in self._items if item.summary.id == diagnosis_id), None)
        return None if item is None else item.view()

    def summaries(self, limit: int) -> list[RecentSummary]:
        with self._lock:
            newest_first = list(reversed(self._items))[:limit]
        return [item.summary for item in newest_first]


def _top_service(diagnosis: Diagnosis) -> str | None:
    """The window's first service, else the first anomalous (or first) trace's."""
    if diagnosis.ranking:
        return diagnosis.ranking[0].service
    traces = diagnosis.anomalous or diagnosis.traces
    if traces and traces[0].bottlenecks:
        return traces[0].bottlenecks[0].service
    return None
