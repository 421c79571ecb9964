"""Span table -> traces: group spans by trace, link parents, and repair what can be repaired.

`assemble` works on all traces of a table at once with numpy (sorting, `searchsorted`, pointer
jumping); Python loops run only over the few spans that need a repair. The result, a
`SpanForest`, keeps every span in flat arrays grouped by trace, so later stages (critical
path, features, PyG batches) stay vectorised too.

Repairs, each reported in `SpanForest.repairs` as a `Repair` (trace, span, kind, what was done):

- **Duplicate span ids** (within a trace): keep one copy, the first *complete* one (positive
  duration) in input order, else the first; the others are listed in `dropped`.
- **Missing parent** (orphan): attached to the trace's root. Its timing is kept as is (we do
  not know how it relates to the root), so it reaches the critical path only when it lies in
  the root's window.
- **Self-parent and cycles**: a cycle is broken at the edge that most violates time order
  (the child that starts furthest before its parent); that child then counts as an orphan.
- **Several roots**: the earliest root (ties: the longest) stays the root, the others are
  attached to it like orphans. **No root** (every span has a parent that is missing or
  cyclic): the earliest such span becomes the root.
- **Clock skew**: a child must not start before its parent (causality), and a *synchronous*
  child must also end by its parent's end. A child that breaks this is shifted, with its whole
  subtree, by the smallest amount that puts it into its parent's window (or at the parent's
  start when it is longer than the parent, which is also reported). A child is *asynchronous*,
  and keeps its end where it is, when it or its parent is a `producer`/`consumer` span, or when
  it starts at or after its parent's end (a FOLLOWS_FROM-like fire-and-forget call). Orphans
  and extra roots attached by the repairs above are never shifted.

Unrepairable input raises `TraceInputError` naming the trace and span: a negative duration, an
empty trace or span id. With `on_bad_trace="drop"` such a trace is dropped instead (all its
spans listed in `dropped`) so a stream of traces can go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.traces.errors import TraceInputError
from bmeg.traces.schema import conform

ASYNC_KINDS = ("producer", "consumer")


class DroppedSpan(NamedTuple):
    trace_id: str
    span_id: str
    reason: str


class Repair(NamedTuple):
    """One repair: the trace and span it touched, its kind, and what was done (a sentence)."""

    trace_id: str
    span_id: str
    kind: Literal["duplicate", "adopted", "made root", "clock skew"]
    detail: str

    def __str__(self) -> str:
        return f"trace {self.trace_id}: span {self.span_id}: {self.detail}"


@dataclass(frozen=True)
class SpanForest:
    """All spans of many traces, linked and repaired, in flat arrays.

    Spans are grouped by trace (traces in order of first appearance), in input order within a
    trace. Array index = row of `spans`.
    """

    spans: pa.Table  # the kept spans (SPAN_SCHEMA), original times
    trace_ids: list[str]
    trace_offsets: np.ndarray  # int64 [T+1]: spans of trace t are rows offsets[t]:offsets[t+1]
    trace_index: np.ndarray  # int64 [n]: trace of each span
    parent: np.ndarray  # int64 [n]: parent row, -1 for each trace's root
    root: np.ndarray  # int64 [T]: root row of each trace
    depth: np.ndarray  # int64 [n]: 0 for roots
    start_ns: np.ndarray  # int64 [n]: start after the clock-skew repair
    duration_ns: np.ndarray  # int64 [n]
    repairs: list[Repair] = field(default_factory=list)
    dropped: list[DroppedSpan] = field(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        """The repairs as sentences, for people."""
        return [str(repair) for repair in self.repairs]

    @property
    def num_spans(self) -> int:
        return len(self.parent)

    @property
    def num_traces(self) -> int:
        return len(self.trace_ids)

    # The derived arrays below are computed once per forest (its arrays are never changed after
    # `assemble`), read-only: a batch's features, SVM vectors and latencies all read them.
    @cached_property
    def end_ns(self) -> np.ndarray:
        return _read_only(self.start_ns + self.duration_ns)

    @cached_property
    def self_time_ns(self) -> np.ndarray:
        """Duration of each span not covered by the union of its children (clipped to the span)."""
        parent = self.parent
        children = np.flatnonzero(parent >= 0)
        owner = parent[children]
        start, end = self.start_ns, self.end_ns
        low = np.clip(start[children], start[owner], end[owner])
        high = np.clip(end[children], start[owner], end[owner])
        order = np.lexsort((low, owner))
        owner, low, high = owner[order], low[order], high[order]
        reach = _running_max_within_groups(owner, high)
        # What each child adds to the union: the part after everything its earlier siblings cover.
        earlier = np.r_[np.iinfo(np.int64).min, reach[:-1]]
        earlier[np.r_[True, owner[1:] != owner[:-1]]] = np.iinfo(np.int64).min
        added = np.maximum(high - np.maximum(low, earlier), 0)
        covered = np.bincount(owner, weights=added, minlength=self.num_spans)
        return _read_only(self.duration_ns - covered.astype(np.int64))

    def trace_slice(self, trace: int) -> slice:
        return slice(int(self.trace_offsets[trace]), int(self.trace_offsets[trace + 1]))


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


def _running_max_within_groups(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Running maximum of `values` restarting at each group (groups contiguous, sorted).

    Values are ranked so that (group, rank) packs into one int64 and a plain running max works.
    """
    if len(values) == 0:
        return values
    distinct, rank = np.unique(values, return_inverse=True)
    width = np.int64(len(distinct))
    packed = np.maximum.accumulate(group.astype(np.int64) * width + rank)
    return distinct[packed - group * width]


def assemble(table: pa.Table, *, on_bad_trace: Literal["raise", "drop"] = "raise") -> SpanForest:
    """Group a span table into traces, link parents and repair (see the module docstring)."""
    table = conform(table).combine_chunks()
    dropped: list[DroppedSpan] = []
    repairs: list[Repair] = []
    table = _reject_bad_traces(table, on_bad_trace, dropped)
    if table.num_rows == 0:
        return _empty_forest(table, repairs, dropped)

    trace_code, trace_ids = _encode(table["trace_id"])
    start = table["start_ns"].to_numpy()
    duration = table["duration_ns"].to_numpy()

    kept, key, parent_key = _dedupe(table, trace_code, duration, dropped, repairs)
    if kept is not None:
        table, key, parent_key = table.take(pa.array(kept)), key[kept], parent_key[kept]
        start, duration, trace_code = start[kept], duration[kept], trace_code[kept]
    # Traces are numbered in order of first appearance, so trace codes are now sorted.
    trace_index = trace_code.astype(np.int64)
    trace_offsets = np.searchsorted(trace_index, np.arange(len(trace_ids) + 1)).astype(np.int64)
    names = _SpanNames(trace_ids, trace_index, table["span_id"])

    parent, orphans = _link_parents(key, parent_key)
    _break_cycles(parent, orphans, start, names)
    root, adopted = _choose_roots(
        parent, orphans, trace_index, len(trace_ids), start, duration, names, repairs
    )
    depth = _depth(parent)
    start = _repair_clock_skew(table, parent, adopted, depth, trace_offsets, start, duration, names, repairs)
    return SpanForest(
        spans=table,
        trace_ids=list(trace_ids),
        trace_offsets=trace_offsets,
        trace_index=trace_index,
        parent=parent,
        root=root,
        depth=depth,
        start_ns=start,
        duration_ns=duration,
        repairs=repairs,
        dropped=dropped,
    )


class _SpanNames:
    """Names rows for repairs and errors: "trace T: span S"."""

    def __init__(self, trace_ids: list[str], trace_index: np.ndarray, span_ids: pa.ChunkedArray):
        self.trace_ids, self.trace_index, self.span_ids = trace_ids, trace_index, span_ids

    def span_id(self, row: int) -> str:
        return self.span_ids[int(row)].as_py()

    def span(self, row: int) -> str:
        return f"trace {self.trace_ids[self.trace_index[row]]}: span {self.span_id(row)}"

    def repair(self, row: int, kind, detail: str) -> Repair:
        return Repair(self.trace_ids[self.trace_index[row]], self.span_id(row), kind, detail)


def _encode(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[str]]:
    """Integer codes (first appearance order) and the distinct values of a string column."""
    encoded = pc.dictionary_encode(column)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    return encoded.indices.to_numpy(), encoded.dictionary.to_pylist()


def _reject_bad_traces(table: pa.Table, on_bad_trace: str, dropped: list[DroppedSpan]) -> pa.Table:
    """Raise (or drop the trace) for what no repair can fix: negative durations, empty ids."""
    problems = [
        (pc.less(table["duration_ns"], 0), "negative duration"),
        (pc.fill_null(pc.equal(table["span_id"], ""), True), "missing span id"),
        (pc.fill_null(pc.equal(table["trace_id"], ""), True), "missing trace id"),
    ]
    bad_rows = np.zeros(table.num_rows, dtype=bool)
    reasons = np.empty(table.num_rows, dtype=object)
    for mask, reason in problems:
        rows = mask.to_numpy(zero_copy_only=False)
        reasons[rows & ~bad_rows] = reason
        bad_rows |= rows
    if not bad_rows.any():
        return table
    trace_ids = table["trace_id"].to_numpy(zero_copy_only=False)
    span_ids = table["span_id"].to_numpy(zero_copy_only=False)
    if on_bad_trace == "raise":
        row = int(np.flatnonzero(bad_rows)[0])
        detail = f" {table['duration_ns'][row].as_py()} ns" if reasons[row] == "negative duration" else ""
        raise TraceInputError(
            f"{reasons[row]}{detail}; the span cannot be repaired",
            trace_id=trace_ids[row] or "(empty)",
            span_id=span_ids[row] or "(empty)",
        )
    bad_traces = set(trace_ids[bad_rows])
    drop = np.isin(trace_ids, list(bad_traces))
    for row in np.flatnonzero(drop).tolist():
        why = reasons[row] or "its trace has an unrepairable span"
        dropped.append(DroppedSpan(trace_ids[row], span_ids[row], why))
    return table.filter(pa.array(~drop))


def _dedupe(
    table: pa.Table,
    trace_code: np.ndarray,
    duration: np.ndarray,
    dropped: list[DroppedSpan],
    repairs: list[Repair],
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """Rows to keep, grouped by trace (None: all rows, already grouped), and each row's span
    and parent keys (-1: no parent).

    A key packs (trace, span id) into one int64, so parents resolve with one searchsorted.
    Span and parent ids share one dictionary (one hashing pass over both columns).
    """
    n = table.num_rows
    ids = pa.concat_arrays([table["span_id"].combine_chunks(), table["parent_id"].combine_chunks()])
    encoded = pc.dictionary_encode(ids)
    codes = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    span_code, parent_code = codes[:n], codes[n:]
    trace = trace_code.astype(np.int64)
    width = np.int64(len(encoded.dictionary))
    key = trace * width + span_code
    parent_key = np.where(parent_code >= 0, trace * width + parent_code, -1)

    keep = None
    if np.bincount(span_code, minlength=width).max(initial=0) > 1:  # an id occurs twice: check
        rows = np.arange(n)
        by_key = np.lexsort((rows, duration <= 0, key))  # first complete copy first
        first_copy = np.r_[True, key[by_key][1:] != key[by_key][:-1]]
        if not first_copy.all():
            _report_duplicates(table, by_key, first_copy, dropped, repairs)
            keep = np.zeros(n, dtype=bool)
            keep[by_key[first_copy]] = True
    if keep is None and (np.diff(trace_code) >= 0).all():
        return None, key, parent_key
    order = np.argsort(trace_code, kind="stable")
    return (order if keep is None else order[keep[order]]), key, parent_key


def _report_duplicates(table, by_key, first_copy, dropped, repairs) -> None:
    trace_ids = table["trace_id"].to_numpy(zero_copy_only=False)
    span_ids = table["span_id"].to_numpy(zero_copy_only=False)
    for position in np.flatnonzero(~first_copy):
        row = by_key[position]
        dropped.append(DroppedSpan(trace_ids[row], span_ids[row], "duplicate span id"))
        repairs.append(Repair(trace_ids[row], span_ids[row], "duplicate",
                              "duplicate span id; kept the first complete copy, dropped one"))


def _link_parents(key: np.ndarray, parent_key: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
    """Parent row of each row (-1: none), and the orphans: row -> why its parent link is gone."""
    by_key = np.argsort(key, kind="stable")
    sorted_keys = key[by_key]
    position = np.minimum(np.searchsorted(sorted_keys, parent_key), len(key) - 1)
    found = (parent_key >= 0) & (sorted_keys[position] == parent_key)
    parent = np.where(found, by_key[position], -1).astype(np.int64)
    missing = np.flatnonzero((parent_key != -1) & ~found).tolist()
    orphans = dict.fromkeys(missing, "its parent is not in the trace")
    self_parent = parent == np.arange(len(parent))
    orphans.update(dict.fromkeys(np.flatnonzero(self_parent).tolist(), "it is its own parent"))
    parent[self_parent] = -1
    return parent, orphans


def _top_ancestor(parent: np.ndarray) -> np.ndarray:
    """Each row's topmost ancestor by pointer jumping (O(n log depth)); cycles never settle."""
    pointer = np.where(parent >= 0, parent, np.arange(len(parent)))
    for _ in range(int(np.ceil(np.log2(max(len(parent), 2)))) + 1):
        jumped = pointer[pointer]
        if np.array_equal(jumped, pointer):
            break
        pointer = jumped
    return pointer


def _break_cycles(
    parent: np.ndarray, orphans: dict[int, str], start: np.ndarray, names: _SpanNames
) -> None:
    """Cut each parent cycle at the edge whose child starts furthest before its parent."""
    stuck = np.flatnonzero(parent[_top_ancestor(parent)] >= 0)  # never reach a parentless row
    visited: set[int] = set()
    for first in stuck.tolist():
        walk: dict[int, int] = {}  # row -> position on this walk up the parents
        row = first
        while row not in visited and row not in walk and row >= 0:
            walk[row] = len(walk)
            row = int(parent[row])
        if row in walk:  # closed a new cycle
            cycle = list(walk)[walk[row]:]
            child = max(cycle, key=lambda r: (start[parent[r]] - start[r], -r))
            orphans[child] = (
                f"its link to its parent {names.span_id(parent[child])} closed a cycle "
                f"of {len(cycle)} spans, so was cut"
            )
            parent[child] = -1
        visited.update(walk)


def _choose_roots(
    parent: np.ndarray,
    orphans: dict[int, str],
    trace_index: np.ndarray,
    num_traces: int,
    start: np.ndarray,
    duration: np.ndarray,
    names: _SpanNames,
    repairs: list[Repair],
) -> tuple[np.ndarray, np.ndarray]:
    """One root per trace; other parentless rows (extra roots, orphans) are attached to it.

    Returns the root row of each trace and a mask of the attached ("adopted") rows.
    """
    orphan = np.zeros(len(parent), dtype=bool)
    orphan[list(orphans)] = True
    candidates = np.flatnonzero(parent < 0)
    # Prefer real roots over orphans, then the earliest, then the longest.
    preference = candidates[
        np.lexsort((-duration[candidates], start[candidates], orphan[candidates], trace_index[candidates]))
    ]
    first_of_trace = np.r_[True, trace_index[preference][1:] != trace_index[preference][:-1]]
    root = np.empty(num_traces, dtype=np.int64)
    root[trace_index[preference[first_of_trace]]] = preference[first_of_trace]
    adopted = np.zeros(len(parent), dtype=bool)
    others = preference[~first_of_trace]
    adopted[others] = True
    parent[others] = root[trace_index[others]]
    for row in others.tolist():
        why = orphans.get(row, "a second root span")
        repairs.append(names.repair(row, "adopted", f"{why}; attached it to the root {names.span_id(parent[row])}"))
    for row in root[orphan[root]].tolist():
        repairs.append(names.repair(
            row, "made root", f"{orphans[row]}; the trace has no root span, so made it (the earliest) the root"))
    return root, adopted


def _depth(parent: np.ndarray) -> np.ndarray:
    """Number of ancestors of each row, by pointer jumping (list ranking), O(n log depth)."""
    depth = (parent >= 0).astype(np.int64)
    pointer = parent.copy()
    while True:
        linked = np.flatnonzero(pointer >= 0)
        if len(linked) == 0:
            return depth
        ancestors = pointer[linked]
        depth[linked] += depth[ancestors]  # fancy indexing reads the old values first
        pointer[linked] = pointer[ancestors]


def _repair_clock_skew(
    spans: pa.Table,
    parent: np.ndarray,
    adopted: np.ndarray,
    depth: np.ndarray,
    trace_offsets: np.ndarray,
    start: np.ndarray,
    duration: np.ndarray,
    names: _SpanNames,
    repairs: list[Repair],
) -> np.ndarray:
    """Shift skewed children (and their subtrees) into their parent's window; returns starts."""
    kind = spans["kind"]
    is_async_kind = pc.is_in(kind, value_set=pa.array(ASYNC_KINDS)).to_numpy(zero_copy_only=False)
    has_parent = parent >= 0
    p = np.where(has_parent, parent, 0)
    end = start + duration
    synchronous = ~(is_async_kind | is_async_kind[p]) & (start < end[p])
    skewed = has_parent & ~adopted & ((start < start[p]) | (synchronous & (end > end[p])))
    if not skewed.any():
        return start
    start = start.copy()
    skewed_traces = np.unique(np.searchsorted(trace_offsets, np.flatnonzero(skewed), side="right") - 1)
    for trace in skewed_traces.tolist():
        rows = np.arange(trace_offsets[trace], trace_offsets[trace + 1])
        top_down = rows[np.argsort(depth[rows], kind="stable")]
        _shift_trace(top_down, parent, adopted, is_async_kind, start, duration, names, repairs)
    return start


def _shift_trace(top_down, parent, adopted, is_async_kind, start, duration, names, repairs) -> None:
    """Sequential skew repair of one trace, parents before children (starts change in place)."""
    shift = dict.fromkeys(top_down.tolist(), 0)
    for row in top_down.tolist():
        up = int(parent[row])
        if up < 0 or adopted[row]:
            continue
        child_start = int(start[row]) + shift[up]
        parent_start = int(start[up]) + shift[up]
        parent_end = parent_start + int(duration[up])
        child_end = child_start + int(duration[row])
        synchronous = not (is_async_kind[row] or is_async_kind[up]) and child_start < parent_end
        delta = 0
        if child_start < parent_start:
            delta = parent_start - child_start
        elif synchronous and child_end > parent_end:
            delta = max(parent_end - child_end, parent_start - child_start)
        shift[row] = shift[up] + delta
        if delta:
            too_long = " (it is longer than its parent, so it now starts with it)" if (
                synchronous and duration[row] > duration[up]
            ) else ""
            repairs.append(names.repair(row, "clock skew", f"outside its parent {names.span_id(up)} by clock skew; "
                                        f"shifted it and its subtree by {delta / 1000:+.1f} us{too_long}"))
    for row, total in shift.items():
        start[row] += total


def _empty_forest(table: pa.Table, repairs: list[Repair], dropped: list[DroppedSpan]) -> SpanForest:
    empty = np.zeros(0, dtype=np.int64)
    return SpanForest(
        spans=table,
        trace_ids=[],
        trace_offsets=np.zeros(1, dtype=np.int64),
        trace_index=empty,
        parent=empty,
        root=empty,
        depth=empty,
        start_ns=empty,
        duration_ns=empty,
        repairs=repairs,
        dropped=dropped,
    )
