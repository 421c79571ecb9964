"""Assembling traces from spans that arrive in pieces (many messages, many partitions, many exporters).

Real senders do not send a trace together: each service's SDK exports the spans it ended on
its own schedule (the OpenTelemetry SDKs' `BatchSpanProcessor`: every 5 s, or at 512 spans),
and the Collector's `batch` processor holds them up to 200 ms more. Within one process spans
are exported in the order they end, so a span's children (which end first) never arrive after
it; across processes they may arrive in any order, seconds apart.

So spans are grouped by trace id and a trace is **complete** as soon as
- its root (the span with no parent) has arrived,
- every span's parent has arrived, and
- every call into another instrumented service has its callee's span: a `client` span with no
  child yet is still expecting one, unless it calls a database (`db.system` set) or its
  (service, operation) has been learned to be a leaf (it ended childless in
  `LEAF_AFTER` traces finished by the idle timeout; seeing it with a child forgets that).

Otherwise a trace finishes when no span of it has arrived for `idle_timeout_s`, which must
exceed the senders' export interval: the default (`DEFAULT_IDLE_TIMEOUT_S`, 7 s) is the SDKs'
5 s schedule plus the Collector's batching and Kafka's linger, with a second to spare. A trace
finished while its root or a parent is still missing is **partial**: diagnosed and published
so, never handed to mitigation. A trace also finishes at `max_spans` (a runaway trace must not
hold memory and offsets forever), and the least recently touched trace finishes early when more
than `max_open` are being assembled (spans whose roots never come, sent faster than the idle
timeout ends them, must not grow memory without bound: `bench/consumer_limits.py` measures the
consumer at this cap).

Idle time counts only while the spans' way in works. A sender's spans wait in its exporter
(the Collector's queue) while the broker is away, so a trace whose last spans are stuck behind
an outage looks idle though it is not. The consumer tells the assembler when it last heard from
the broker (`heard_from_broker`): a trace finishes by the idle timeout only once the broker has
answered after that timeout ran out (the time a request was sent: an answer proves the broker
was up then), so no trace finishes on idle time in which the broker was not heard from; and
after a silence of `outage_after_s` or longer, no trace finishes on idle time for
`recovery_s` from the broker's first answer, and again from the first message read after it,
and a trace held through that window then waits a whole idle timeout more (idle time counts
from the window's end): what the senders queued meanwhile arrives only once their exporters
retry, and the Collector's exporter retries on a backoff of up to 30 s (±50%: `retry_on_failure`'s
defaults) after an attempt that waits up to its 5 s timeout, so a trace's queued pieces may come
that far apart. The consumer's own client reconnects within 2 s of the broker's return (its
backoff is bounded), so its reads resume promptly; a read that resumes later (27 s in a loaded
CI run, with the library's 30 s backoff, where the window from the answer alone ran out just
before the queued pieces were read: 14 traces split) restarts the window. A loaded CI run still split 5
of 300 traces (session 11; its logs were not kept): a window of 45 s with nothing after it left
no margin for a retry at the end of its backoff, its attempt's timeout, or the queue's draining.
Without `heard_from_broker` (the OTLP/HTTP receiver, which has no broker in front) idle time always counts.

Spans of a trace already finished (a late fragment) are never diagnosed as a new trace: the
ids of finished traces are remembered for `late_window_s` and their late spans are counted
and dropped (`late_spans`). Each trace remembers the messages (`sources`) that carried its
spans, so their offsets can be released once its diagnosis is published.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

log = logging.getLogger(__name__)

Source = Hashable  # a message: `bmeg.serving.offsets.Source` in the consumer
CallKey = tuple[str, str]  # (service, operation) of a client span

#: The SDKs' 5 s export schedule, the Collector's 200 ms batch timeout, Kafka's linger, 1 s spare.
DEFAULT_IDLE_TIMEOUT_S = 7.0
#: How long the ids of finished traces are remembered, to recognise their late spans.
DEFAULT_LATE_WINDOW_S = 300.0
#: Childless endings (in traces finished by the idle timeout) after which a call is a leaf.
LEAF_AFTER = 3
_MAX_REMEMBERED = 1_000_000  # finished trace ids kept at most (~100 MB), whatever the window
_MAX_CALL_KEYS = 100_000
#: Traces being assembled at most (the consumer's `max_open_traces`).
DEFAULT_MAX_OPEN = 50_000
#: No answer from the broker for this long is an outage (the consumer asks once a second).
DEFAULT_OUTAGE_AFTER_S = 5.0
#: After an outage, no trace finishes on idle time for this long: the Collector's exporter's
#: longest retry backoff (`retry_on_failure.max_interval` 30 s, randomised by ±50%) and its
#: export timeout (`timeout`, 5 s: an attempt still waiting when the broker answers fails then).
DEFAULT_RECOVERY_S = 50.0


class Rows(NamedTuple):
    """A trace's spans in one message's table (sorted by trace), kept as bounds: slicing 12
    columns per trace cost ~9 µs, and a batch of slices was as many chunks to combine again."""
    table: pa.Table
    start: int
    length: int


@dataclass
class PendingTrace:
    trace_id: str
    last_seen: float
    parts: list[Rows] = field(default_factory=list)
    spans: int = 0
    sources: set[Source] = field(default_factory=set)
    partial: bool = False  # finished without its root or with a parent missing (set when finished)
    span_ids: set[str] = field(default_factory=set, repr=False)
    parents: set[str] = field(default_factory=set, repr=False)  # parent ids referenced
    has_root: bool = False
    awaiting: dict[str, CallKey] = field(default_factory=dict, repr=False)  # client span id -> its call, no child yet
    guessed_leaves: dict[str, CallKey] = field(default_factory=dict, repr=False)  # learned-leaf client spans

    def table(self) -> pa.Table:
        return spans_of([self])

    @property
    def complete(self) -> bool:
        return self.has_root and not self.awaiting and self.parents <= self.span_ids

    @property
    def missing_parents(self) -> bool:
        return not self.has_root or not self.parents <= self.span_ids


@dataclass(frozen=True)
class Added:
    traces: int  # traces the message's spans went to, still being assembled (its open count)
    late_spans: int  # spans of traces already finished, dropped


class TraceAssembler:
    def __init__(self, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, max_spans: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, late_window_s: float = DEFAULT_LATE_WINDOW_S,
                 max_open: int = DEFAULT_MAX_OPEN, outage_after_s: float = DEFAULT_OUTAGE_AFTER_S,
                 recovery_s: float = DEFAULT_RECOVERY_S):
        if max_open < 1:
            raise ValueError(f"max_open={max_open}: at least one trace must be assembled at a time")
        self.idle_timeout_s = idle_timeout_s
        self.max_spans = max_spans
        self.max_open = max_open
        self.evicted = 0  # traces finished early because `max_open` were open
        self.clock = clock
        self.late_window_s = late_window_s
        self.outage_after_s = outage_after_s
        self.recovery_s = recovery_s
        self._heard: float | None = None  # when the broker last answered; None: idle time always counts
        self._recovering_until = float("-inf")  # no trace finishes on idle time before, after an outage
        self._read_since_outage = True  # False from an outage's end to the first message read after it
        self._pending: OrderedDict[str, PendingTrace] = OrderedDict()  # least recently touched first
        self._ready: dict[str, PendingTrace] = {}  # complete or at the span cap, not yet handed out
        self._finished: OrderedDict[str, float] = OrderedDict()  # trace id -> when finished, oldest first
        self._childless: Counter[CallKey] = Counter()  # call -> childless endings seen
        self.leaf_calls: set[CallKey] = set()

    def __len__(self) -> int:
        return len(self._pending) + len(self._ready)

    def __iter__(self) -> Iterator[PendingTrace]:
        """The traces held, not yet handed out."""
        return iter([*self._ready.values(), *self._pending.values()])

    def add(self, spans: pa.Table, source: Source) -> Added:
        """Add one message's spans."""
        now = self.clock()
        if not self._read_since_outage:  # reads resumed: the senders' retries may start arriving only now
            self._read_since_outage = True
            self._recovering_until = max(self._recovering_until, now + self.recovery_s)
            log.info("reads resumed after the outage: no trace finishes on idle time for %.0f s more, then "
                     "each trace held waits a whole idle timeout", self._recovering_until - now)
        traces = late = 0
        for trace_id, piece, notes in _pieces(spans):
            trace = self._pending.get(trace_id) or self._ready.get(trace_id)
            if trace is None:
                if trace_id in self._finished:
                    late += piece.length
                    continue
                trace = self._pending[trace_id] = PendingTrace(trace_id, now)
                if len(self._pending) > self.max_open:  # the least recently touched finishes early
                    oldest_id, oldest = self._pending.popitem(last=False)
                    self._ready[oldest_id] = oldest
                    self.evicted += 1
            elif trace_id in self._pending:
                self._pending.move_to_end(trace_id)
                trace.last_seen = now
            trace.parts.append(piece)
            trace.spans += piece.length
            trace.sources.add(source)
            self._note_spans(trace, notes)
            traces += 1
            if trace_id in self._pending and (trace.spans >= self.max_spans or trace.complete):
                self._ready[trace_id] = self._pending.pop(trace_id)
        return Added(traces, late)

    def finished(self) -> list[PendingTrace]:
        """Traces complete or at the span cap, and those idle for the timeout; they leave the assembler."""
        now = self.clock()
        done, self._ready = list(self._ready.values()), {}
        deadline = (now if self._heard is None else min(now, self._heard)) - self.idle_timeout_s
        # idle time counts again only from the window's end: a trace held through it gets a whole
        # idle timeout after it, for the senders' retried pieces that come just before it ends
        while self._pending and deadline >= self._recovering_until:
            oldest = next(iter(self._pending.values()))
            if oldest.last_seen > deadline:
                break
            self._pending.popitem(last=False)
            self._learn_leaves(oldest)
            done.append(oldest)
        for trace in done:
            trace.partial = trace.missing_parents
            self._remember(trace.trace_id, now)
        self._forget_old(now)
        return done

    def heard_from_broker(self, at: float) -> bool:
        """The broker answered a request sent at `at` (this assembler's clock). Returns whether
        that ends an outage (no answer for `outage_after_s`): then no trace finishes on idle time
        for `recovery_s` (counted again from the first message read after it), and idle time
        counts only from that window's end."""
        if self._heard is not None and at <= self._heard:
            return False
        outage = self._heard is not None and at - self._heard >= self.outage_after_s
        self._heard = at
        if outage:
            now = self.clock()
            self._recovering_until = now + self.recovery_s
            self._read_since_outage = False
            for trace in self._pending.values():
                trace.last_seen = now
        return outage

    def discard(self, unwanted: Callable[[PendingTrace], bool]) -> int:
        """Drop the traces held that are `unwanted` (not remembered as finished); returns how many."""
        dropped = 0
        for held in (self._ready, self._pending):
            for trace_id in [trace_id for trace_id, trace in held.items() if unwanted(trace)]:
                del held[trace_id]
                dropped += 1
        return dropped

    def drain(self) -> list[PendingTrace]:
        """Every trace, finished or not (shutdown)."""
        self._ready.update(self._pending)
        self._pending = OrderedDict()
        return self.finished()

    # -- completeness --------------------------------------------------------------------------
    def _note_spans(self, trace: PendingTrace, notes: _Notes) -> None:
        trace.span_ids.update(notes.span_ids)
        parents = {parent for parent in notes.parent_ids if parent is not None}  # not the root's
        trace.has_root = trace.has_root or notes.has_root
        trace.parents |= parents
        if trace.awaiting:
            for parent in trace.awaiting.keys() & parents:
                del trace.awaiting[parent]
        if trace.guessed_leaves:  # a learned leaf has a callee after all
            for parent in trace.guessed_leaves.keys() & parents:
                self.leaf_calls.discard(trace.guessed_leaves.pop(parent))
        for span_id, call in zip(notes.calling, notes.calls):
            if call in self.leaf_calls:
                if span_id in trace.parents:
                    self.leaf_calls.discard(call)
                else:
                    trace.guessed_leaves[span_id] = call
            elif span_id not in trace.parents:
                trace.awaiting[span_id] = call

    def _learn_leaves(self, trace: PendingTrace) -> None:
        """Calls still childless when their trace went idle: after `LEAF_AFTER` of them, leaves."""
        for call in trace.awaiting.values():
            self._childless[call] += 1
            if self._childless[call] >= LEAF_AFTER and len(self.leaf_calls) < _MAX_CALL_KEYS:
                self.leaf_calls.add(call)
        if len(self._childless) > _MAX_CALL_KEYS:
            self._childless.clear()

    # -- late spans ----------------------------------------------------------------------------
    def _remember(self, trace_id: str, now: float) -> None:
        self._finished[trace_id] = now
        self._finished.move_to_end(trace_id)

    def _forget_old(self, now: float) -> None:
        horizon = now - self.late_window_s
        while self._finished and (len(self._finished) > _MAX_REMEMBERED or next(iter(self._finished.values())) < horizon):
            self._finished.popitem(last=False)


class _Notes(NamedTuple):
    """What completeness reads of one trace's spans in a message."""

    span_ids: list[str]
    parent_ids: list[str | None]
    has_root: bool
    calling: list[str]  # client spans without `db.system`: calls that expect a callee's span
    calls: list[CallKey]  # their (service, operation)


def _pieces(spans: pa.Table) -> Iterator[tuple[str, Rows, _Notes]]:
    """Each trace's spans and what completeness reads of them: one sort and one conversion per
    message, not per trace, and only the client spans are looked at in Python (reading every
    span's kind and parent in a loop was a tenth of the consumer's reading loop)."""
    if spans.num_rows == 0:
        return
    ordered, starts = _sorted_by_trace(spans)
    ids = ordered["trace_id"].to_numpy(zero_copy_only=False)
    span_ids = ordered["span_id"].to_pylist()
    parent = ordered["parent_id"]
    parent_ids = parent.to_pylist()
    roots = np.add.reduceat(parent.is_null().to_numpy(zero_copy_only=False), starts[:-1]).tolist()
    calling_rows = pa.array(np.flatnonzero(
        pc.and_(pc.equal(ordered["kind"], "client"), pc.is_null(ordered["db_system"])).fill_null(False)
        .to_numpy(zero_copy_only=False)))
    calling = ordered["span_id"].take(calling_rows).to_pylist()
    calls = list(zip(ordered["service"].take(calling_rows).to_pylist(),
                     ordered["operation"].take(calling_rows).to_pylist()))
    call_bounds = np.searchsorted(calling_rows.to_numpy(), starts).tolist()
    bounds = starts.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        low, high = call_bounds[i], call_bounds[i + 1]
        yield ids[start], Rows(ordered, start, end - start), _Notes(
            span_ids[start:end], parent_ids[start:end], roots[i] > 0, calling[low:high], calls[low:high])


def spans_of(traces: list[PendingTrace]) -> pa.Table:
    """The traces' spans as one table, trace after trace, each trace's parts in the order they
    came: one `take` over the messages' tables."""
    places: dict[int, int] = {}  # id(table) -> its first row among the tables concatenated
    tables: list[pa.Table] = []
    starts: list[int] = []
    lengths: list[int] = []
    rows = 0
    for trace in traces:
        for part in trace.parts:
            place = places.get(id(part.table))
            if place is None:
                place = places[id(part.table)] = rows
                tables.append(part.table)
                rows += part.table.num_rows
            starts.append(place + part.start)
            lengths.append(part.length)
    counts = np.array(lengths, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    indices = np.arange(counts.sum()) + np.repeat(np.array(starts, dtype=np.int64) - offsets, counts)
    return pa.concat_tables(tables).take(indices)


def _sorted_by_trace(spans: pa.Table) -> tuple[pa.Table, np.ndarray]:
    ordered = spans.take(pc.sort_indices(spans["trace_id"]))
    ids = ordered["trace_id"].to_numpy(zero_copy_only=False)
    return ordered, np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1, [len(ids)]])


def split_by_trace(spans: pa.Table) -> list[tuple[str, pa.Table]]:
    """A table's spans grouped by trace id, in one sort."""
    if spans.num_rows == 0:
        return []
    ordered, starts = _sorted_by_trace(spans)
    ids = ordered["trace_id"].to_numpy(zero_copy_only=False)
    return [(ids[start], ordered.slice(start, end - start)) for start, end in zip(starts[:-1], starts[1:])]
