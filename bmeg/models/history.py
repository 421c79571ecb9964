"""What a stream of traces has shown so far: the state that history features read.

The detector holds no state between calls. A streaming caller (the server, the Kafka consumer,
a replay of a window) owns a `StreamHistory`, passes it to `Detector.diagnose`, and the
detector reads it and then records the batch into it. Every trace of a batch reads the
history as it was before the batch (never the batch's other traces), so a trace diagnosed in
a batch gets the features it gets alone with the same history. The crowd check
(`bmeg.models.crowd`) reads the traces begun before the trace, in the history or in the
batch: how the stream was cut into batches does not change it, and a trace begun at the same
time or later is never read.

Today the history holds each service's latest self-time z-scores (the temporal-context
feature, `bmeg.models.features`), at most `visits` per service, and the nodes of the traces
begun in the latest `retain_s` seconds (the crowd a trace is set against, `bmeg.models.crowd`)
with, per trace, whether stage 1 put it above its threshold (the crowd's alarm share).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from bmeg.graphs import SpanForest
from bmeg.models.window import RecentTraffic, WindowRanker


@dataclass(frozen=True)
class ServiceTimes:
    """Nodes grouped by service: service `names[i]`'s are rows [bounds[i], bounds[i + 1]), in
    order of their trace's start (equal starts in the order recorded). What the crowd check
    searches (`bmeg.models.crowd`); a service may have no row (a name the nodes were numbered
    with before some were left out).

    `keys` lets one search find, for every service at once, the rows begun before a time: row
    r's key is its service's number × (rows + 1) + how many rows (of any service) began before
    it. A row began before time t exactly when its count is below the count of rows begun
    before t (`np.searchsorted(sorted_starts, t)`), so within service i's rows the search for
    i × (rows + 1) + that count lands where the search for t among service i's starts would."""

    names: np.ndarray
    bounds: np.ndarray
    trace_start_ns: np.ndarray
    z_self: np.ndarray
    sorted_starts: np.ndarray  # every row's start, sorted
    keys: np.ndarray

    @classmethod
    def of(cls, codes: np.ndarray, names: np.ndarray, trace_start_ns: np.ndarray, z_self: np.ndarray) -> ServiceTimes:
        order = np.lexsort((trace_start_ns, codes))  # stable: equal starts keep their order
        counts = np.bincount(codes, minlength=len(names))
        starts, sorted_starts = trace_start_ns[order], np.sort(trace_start_ns)
        keys = codes[order] * (len(codes) + 1) + np.searchsorted(sorted_starts, starts)
        return cls(names, np.r_[0, np.cumsum(counts)], starts, z_self[order], sorted_starts, keys)

    def rows_before(self, times_ns: np.ndarray) -> np.ndarray:
        """int [S, T]: for each service with a row (`present`) and time, the first of the
        service's rows begun at or after the time (its rows begun before it end there)."""
        before = np.searchsorted(self.sorted_starts, times_ns)
        return np.searchsorted(self.keys, (self.present * (len(self.keys) + 1))[:, None] + before)

    @property
    def present(self) -> np.ndarray:
        """The numbers of the services with a row."""
        return np.flatnonzero(np.diff(self.bounds))


@dataclass(frozen=True)
class Observation:
    """What one batch adds to a history: per node, its service, its trace's start and its
    self-time z-score (nodes of every trace, in any order)."""

    services: np.ndarray
    trace_start_ns: np.ndarray
    z_self: np.ndarray

    @cached_property
    def numbered(self) -> tuple[np.ndarray, np.ndarray]:
        """(codes, names): each node's service as `names[code]`. Numbered by hashing (`np.isin`
        or a sort on the visits' strings cost ~4 µs a trace), once: `where` carries it over."""
        return pd.factorize(self.services, use_na_sentinel=False)

    @cached_property
    def by_service(self) -> ServiceTimes:
        """The nodes by service, each service's in time order: sorted once per batch, when the
        crowd check first reads the batch, and kept with it in the history (sorting the whole
        window the crowd reads, every batch, had cost ~55 µs a trace: docs/issue-14.md)."""
        return ServiceTimes.of(*self.numbered, self.trace_start_ns, self.z_self)

    def of(self, services: list[str]) -> Observation:
        """The visits of the given services only."""
        codes, names = self.numbered
        return self.where(np.isin(names, services)[codes])

    def where(self, keep: np.ndarray) -> Observation:
        kept = Observation(self.services[keep], self.trace_start_ns[keep], self.z_self[keep])
        if "numbered" in self.__dict__:  # the same names (some may be left with no node)
            codes, names = self.numbered
            kept.__dict__["numbered"] = codes[keep], names
        return kept

    @classmethod
    def empty(cls) -> Observation:
        return cls(np.zeros(0, dtype=object), np.zeros(0, dtype=np.int64), np.zeros(0))

    def __add__(self, other: Observation) -> Observation:
        return Observation(np.concatenate([self.services, other.services]),
                           np.concatenate([self.trace_start_ns, other.trace_start_ns]),
                           np.concatenate([self.z_self, other.z_self]))


#: How long a stream's history keeps nodes for the crowd (`bmeg.models.crowd`): its window
#: (1 s) and room for traces that arrive late (the SDK exports in batches every few seconds).
RETAIN_S = 10.0


#: Batches kept apart in a history's recent nodes at most; beyond, they are joined into one.
_MAX_CHUNKS = 64


@dataclass
class StreamHistory:
    """Each service's latest `visits` self-time z-scores, oldest first; the nodes of the traces
    begun within `retain_s` seconds of the latest batch recorded (`recent`, by its median start).

    The recent nodes are kept as the batches recorded them (with each batch's earliest and
    latest start): recording trims only the batches at the retained span's edges, and the crowd
    reads only the batches its window overlaps (`between`). Joining every batch to the whole
    retained window, twice a batch, had cost as much as the crowd check itself (docs/issue-14.md)."""

    visits: int = 50
    z_self: dict[str, np.ndarray] = field(default_factory=dict)
    retain_s: float = RETAIN_S
    _chunks: list[tuple[int, int, Observation]] = field(default_factory=list)  # (earliest, latest start, nodes)
    # (trace starts, above stage 1's threshold) of the traces recorded, kept as long as their nodes
    _alarms: tuple[np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)))

    @property
    def recent(self) -> Observation:
        """The nodes kept, in the order they were recorded."""
        return _joined([chunk for _, _, chunk in self._chunks])

    def overlapping(self, lower_ns: int, upper_ns: int) -> list[Observation]:
        """The batches kept that hold a node whose trace began in [lower_ns, upper_ns), whole
        (with nodes outside it too: the crowd check counts only those inside its windows)."""
        return [chunk for earliest, latest, chunk in self._chunks if latest >= lower_ns and earliest < upper_ns]

    def between(self, lower_ns: int, upper_ns: int) -> Observation:
        """The nodes kept whose trace began in [lower_ns, upper_ns), in the order they were recorded."""
        return _joined([chunk.where((chunk.trace_start_ns >= lower_ns) & (chunk.trace_start_ns < upper_ns))
                        for chunk in self.overlapping(lower_ns, upper_ns)])

    def record(self, observation: Observation) -> None:
        """Append a batch's visits in time order (trace start, then node order), keeping the latest."""
        if len(observation.services) == 0:
            return
        # kept: the nodes begun within `retain_s` of this batch's median start, on either side (a
        # trace stamped far off, a wrong clock, neither empties the history for good nor stays)
        now = int(np.median(observation.trace_start_ns))
        lower, upper = now - int(self.retain_s * 1e9), now + int(self.retain_s * 1e9)
        chunks = []
        for earliest, latest, chunk in [*self._chunks, _chunk(observation)]:
            if earliest >= lower and latest <= upper:
                chunks.append((earliest, latest, chunk))
                continue
            kept = chunk.where((chunk.trace_start_ns >= lower) & (chunk.trace_start_ns <= upper))
            if len(kept.services):
                chunks.append(_chunk(kept))
        if len(chunks) > _MAX_CHUNKS:
            chunks = [_chunk(_joined([chunk for _, _, chunk in chunks]))]
        self._chunks = chunks
        times = observation.by_service  # sorted already where the crowd check read the batch
        for name, start, end in zip(times.names, times.bounds[:-1], times.bounds[1:]):
            if start == end:
                continue
            new = times.z_self[start:end].astype(np.float64)
            old = self.z_self.get(name)
            self.z_self[name] = (new if old is None else np.concatenate([old, new]))[-self.visits:]

    def record_alarms(self, trace_start_ns: np.ndarray, above: np.ndarray) -> None:
        """Append a batch's traces' starts and whether each was above stage 1's threshold, keeping
        those begun within `retain_s` of the batch's median start (as `record` keeps nodes)."""
        if len(trace_start_ns) == 0:
            return
        now = int(np.median(trace_start_ns))
        starts = np.concatenate([self._alarms[0], np.asarray(trace_start_ns, dtype=np.int64)])
        flags = np.concatenate([self._alarms[1], np.asarray(above, dtype=bool)])
        kept = np.abs(starts - now) <= int(self.retain_s * 1e9)
        self._alarms = starts[kept], flags[kept]

    def alarms_between(self, lower_ns: int, upper_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """(starts, above the threshold) of the recorded traces begun in [lower_ns, upper_ns)."""
        starts, flags = self._alarms
        inside = (starts >= lower_ns) & (starts < upper_ns)
        return starts[inside], flags[inside]

    def copy(self) -> StreamHistory:
        return copy.deepcopy(self)


def _chunk(nodes: Observation) -> tuple[int, int, Observation]:
    return int(nodes.trace_start_ns.min()), int(nodes.trace_start_ns.max()), nodes


def _joined(parts: list[Observation]) -> Observation:
    if not parts:
        return Observation.empty()
    return parts[0] if len(parts) == 1 else Observation(*(np.concatenate(column) for column in zip(
        *((part.services, part.trace_start_ns, part.z_self) for part in parts))))


class StreamedDetector:
    """A detector with the history of the stream it serves: a streaming caller's one object.

    `diagnose` passes the history to `Detector.diagnose`, which reads it and records the batch
    into it. Calls must be serialised (they change the history); the detector itself is shared.
    A window (`diagnose(window=True)`) is ranked against the latest traces the stream served
    before it (`bmeg.models.window.RecentTraffic`, `WindowRanker.against`), else, where those are
    too few, against the normal traces the detector's run keeps (`WindowRanker.of_run`, read
    here, once, when the model loads); with no kept normal traces, by the mean node score. The
    window's ranking never reads the stream's feature history.
    """

    def __init__(self, detector: Any):
        self.detector = detector
        self.history = StreamHistory(visits=detector.encoder.history)
        self.application: str = detector.application
        self.run_dir = detector.run_dir
        self.window_ranker = WindowRanker.of_run(detector)
        self.recent = RecentTraffic()

    @property
    def version(self) -> str:
        return self.detector.version

    @property
    def services(self) -> list[str]:
        """The model's services (the server's metric labels, the model process's answer)."""
        return list(self.detector.services)

    def diagnose(self, spans: Any, window: bool = False) -> Any:
        ranker = None
        if window and self.window_ranker is not None:
            ranker = self.window_ranker.against(self.recent.before(_table(spans)))
        diagnosis = self.detector.diagnose(spans, window=window, history=self.history, ranker=ranker)
        if self.window_ranker is not None:  # only a ranker against a normal period reads it
            self.recent.record(_table(spans))
        return diagnosis


def _table(spans: pa.Table | SpanForest) -> pa.Table:
    return spans.spans if isinstance(spans, SpanForest) else spans
