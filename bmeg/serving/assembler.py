"""Assembling traces from spans that arrive in pieces (many messages, many partitions).

Spans are grouped by trace id. A trace is finished when no span of it has arrived for
`idle_timeout_s`, or when it reaches `max_spans` (a runaway trace must not hold memory and
offsets forever). Spans of a finished trace that arrive later start a new fragment with the
same trace id, diagnosed on its own: the idle timeout should exceed the tracing pipeline's
batching delay. Each trace remembers the messages (`sources`) that carried its spans, so
their offsets can be released once its diagnosis is published.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

Source = Hashable  # a message: `bmeg.serving.offsets.Source` in the consumer


@dataclass
class PendingTrace:
    trace_id: str
    last_seen: float
    parts: list[pa.Table] = field(default_factory=list)
    spans: int = 0
    sources: set[Source] = field(default_factory=set)

    def table(self) -> pa.Table:
        return pa.concat_tables(self.parts)


class TraceAssembler:
    def __init__(self, idle_timeout_s: float, max_spans: int, clock: Callable[[], float] = time.monotonic):
        self.idle_timeout_s = idle_timeout_s
        self.max_spans = max_spans
        self.clock = clock
        self._pending: OrderedDict[str, PendingTrace] = OrderedDict()  # least recently touched first
        self._full: list[PendingTrace] = []

    def __len__(self) -> int:
        return len(self._pending) + len(self._full)

    def __iter__(self) -> Iterator[PendingTrace]:
        """The traces held, not yet finished."""
        return iter([*self._full, *self._pending.values()])

    def add(self, spans: pa.Table, source: Source) -> int:
        """Add one message's spans; returns how many traces they belong to."""
        now = self.clock()
        pieces = split_by_trace(spans)
        for trace_id, piece in pieces:
            trace = self._pending.get(trace_id)
            if trace is None:
                trace = self._pending[trace_id] = PendingTrace(trace_id, now)
            else:
                self._pending.move_to_end(trace_id)
                trace.last_seen = now
            trace.parts.append(piece)
            trace.spans += piece.num_rows
            trace.sources.add(source)
            if trace.spans >= self.max_spans:
                self._full.append(self._pending.pop(trace_id))
        return len(pieces)

    def finished(self) -> list[PendingTrace]:
        """Traces at the span cap, and those idle for the timeout; they leave the assembler."""
        done, self._full = self._full, []
        deadline = self.clock() - self.idle_timeout_s
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.last_seen > deadline:
                break
            done.append(self._pending.popitem(last=False)[1])
        return done

    def discard(self, unwanted: Callable[[PendingTrace], bool]) -> int:
        """Drop the traces held that are `unwanted`; returns how many."""
        kept_full = [trace for trace in self._full if not unwanted(trace)]
        dropped = [trace_id for trace_id, trace in self._pending.items() if unwanted(trace)]
        for trace_id in dropped:
            del self._pending[trace_id]
        count = len(self._full) - len(kept_full) + len(dropped)
        self._full = kept_full
        return count

    def drain(self) -> list[PendingTrace]:
        """Every trace, finished or not (shutdown, rebalance)."""
        done = self._full + list(self._pending.values())
        self._full, self._pending = [], OrderedDict()
        return done


def split_by_trace(spans: pa.Table) -> list[tuple[str, pa.Table]]:
    """A table's spans grouped by trace id, in one sort."""
    if spans.num_rows == 0:
        return []
    ordered = spans.take(pc.sort_indices(spans["trace_id"]))
    ids = ordered["trace_id"].to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1, [len(ids)]])
    return [(ids[start], ordered.slice(start, end - start)) for start, end in zip(starts[:-1], starts[1:])]
