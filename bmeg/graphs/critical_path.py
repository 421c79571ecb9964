"""The critical path of each trace, as CRISP computes it (Zhang et al., USENIX ATC'22).

From the root, follow the child that returned last, then the child that returned last before
that one started, and so on; recurse into each chosen child. Each chosen span owns a *window*
of the path, and its exclusive time is its window not covered by its chosen children's
windows, so the exclusive times along a path add up to the root's duration, none negative.
The rules, CRISP's (`graph.py`: `sanitizeOverflowingChildren`, `computeCriticalPath`,
`happensBefore`):

1. **Children are clipped to their parent's window.** A child that outlives its parent (an
   async child, an orphan that kept its timing) counts only up to the parent's window end; one
   that starts before it, from the window start. A child wholly outside (it starts at or after
   the window's end, or ends at or before its start) is not on the path.
2. **The last child to return goes first**, by clipped end (ties: the longer child, then the
   first in the table).
3. **The next one happened before it**: the child that returned last at or before the
   current one started; or, before that, a child that *overlaps* the current one slightly
   (CRISP's allowance for clock skew: it started earlier, ended less than
   `OVERLAP_ALLOWANCE` of the parent's window after the current one started, and no other
   child starts or ends within that overlap). **A critical child that overlaps the next one
   counts up to that one's start**, and so does its own path below it.
4. The chain ends when a child reaches the window's start.

Where CRISP differs, and why: CRISP counts an overlapping child whole and clamps exclusive
times at zero, so its times need not add up; windows here make them add up exactly. CRISP
keeps a server span longer than its lone client parent unclipped; `assemble` has already
moved such skewed children into their parent's window. A start time of 0 is an ordinary time.

One numpy sort groups children by parent, by end; the walk is iterative (no recursion, so
deep traces are fine) and visits the path spans only, each with a few binary searches over its
children (`bisect` on the sorted ends and starts).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np

from bmeg.graphs.assemble import SpanForest

#: CRISP's default `overlap_allowance`: the overlap of two sibling calls, as a share of their
#: parent's window, still read as one after the other (clock skew between hosts).
OVERLAP_ALLOWANCE = 0.01


@dataclass(frozen=True)
class CriticalPaths:
    """Per span of a forest: on the path or not, exclusive path time, and its window."""

    on_path: np.ndarray  # bool [n]
    exclusive_ns: np.ndarray  # int64 [n], 0 off the path
    window_start_ns: np.ndarray  # int64 [n]: start of the span's stretch of the path (clipped)
    window_end_ns: np.ndarray  # int64 [n]: its end (clipped to the parent, or the next child's start)

    def path_rows(self, forest: SpanForest, trace: int) -> np.ndarray:
        """Rows on a trace's path, in time order (each span before its path children)."""
        rows = np.arange(*forest.trace_slice(trace).indices(forest.num_spans))
        rows = rows[self.on_path[rows]]
        return rows[np.lexsort((forest.depth[rows], self.window_start_ns[rows]))]


@dataclass(frozen=True)
class _Children:
    """Children grouped by parent and sorted by end (equal ends: the longer last); the
    children of row r are positions begin[r]:stop[r] of `rows`, `ends`, and of `starts`
    (their starts, sorted on their own)."""

    rows: list[int]
    ends: list[int]
    starts: list[int]
    begin: list[int]
    stop: list[int]


def critical_paths(forest: SpanForest, overlap_allowance: float = OVERLAP_ALLOWANCE) -> CriticalPaths:
    """The critical path of every trace of the forest (module docstring)."""
    children = _children(forest)
    begin, stop, ends, rows = children.begin, children.stop, children.ends, children.rows
    start, end = forest.start_ns.tolist(), forest.end_ns.tolist()
    # Three stacks of ints rather than one of tuples: no allocations that wake the GC up.
    stack_rows = forest.root.tolist()
    stack_lows = [start[root] for root in stack_rows]
    stack_highs = [end[root] for root in stack_rows]
    visited, lows, highs, exclusive = [], [], [], []  # per path span, in visiting order
    while stack_rows:
        row, low, high = stack_rows.pop(), stack_lows.pop(), stack_highs.pop()
        visited.append(row)
        lows.append(low)
        highs.append(high)
        first, last = begin[row], stop[row]
        if first == last:
            exclusive.append(high - low)
            continue
        # Rule 2: children ending at or after `high` are clipped to end there; of those, the
        # one starting first (the longest) wins, if it starts inside the window (rule 1).
        at_end = bisect_left(ends, high, first, last)
        position, clipped_end = -1, high
        if at_end < last:
            longest = min(range(at_end, last), key=lambda p: (start[rows[p]], rows[p]))
            if start[rows[longest]] < high:
                position = longest
        if position < 0:
            position = at_end - 1 if at_end > first else -1
            clipped_end = ends[position]
        covered = 0
        slack = overlap_allowance * (high - low)
        while position >= 0 and clipped_end > low:
            child = rows[position]
            child_start = start[child]
            child_low = child_start if child_start > low else low
            covered += clipped_end - child_low
            stack_rows.append(child)
            stack_lows.append(child_low)
            stack_highs.append(clipped_end)
            if child_start <= low:
                break  # rule 4
            # Rule 3: the last child ending by child_start, unless one just after it (a slight
            # overlap; it ended later) qualifies.
            after = bisect_right(ends, child_start, first, position)
            if (
                after < position
                and ends[after] < clipped_end
                and ends[after] - child_start < slack
                and start[rows[after]] < child_start
                and ends[after + 1] > ends[after]  # no other end in the overlap (`after + 1 <= position`)
                and (after == first or ends[after - 1] < child_start)  # nor at its start
                and _starts_within(children, row, child_start, ends[after]) == 1  # the current one's only
            ):
                position, clipped_end = after, child_start
            elif after > first:
                position = after - 1
                clipped_end = ends[position]
            else:
                position = -1
        exclusive.append(high - low - covered)
    n = forest.num_spans
    paths = CriticalPaths(
        on_path=np.zeros(n, dtype=bool),
        exclusive_ns=np.zeros(n, dtype=np.int64),
        window_start_ns=np.zeros(n, dtype=np.int64),
        window_end_ns=np.zeros(n, dtype=np.int64),
    )
    paths.on_path[visited] = True
    paths.exclusive_ns[visited] = exclusive
    paths.window_start_ns[visited] = lows
    paths.window_end_ns[visited] = highs
    return paths


def _starts_within(children: _Children, row: int, low: int, high: int) -> int:
    """How many children of `row` start in [low, high]."""
    first, stop = children.begin[row], children.stop[row]
    return bisect_right(children.starts, high, first, stop) - bisect_left(children.starts, low, first, stop)


def _children(forest: SpanForest) -> _Children:
    n = forest.num_spans
    start, end, parent = forest.start_ns, forest.end_ns, forest.parent
    rows = np.flatnonzero(parent >= 0)
    # The last of equal ends is the longest child, and of those the first in the table.
    by_end = rows[np.lexsort((-rows, -start[rows], end[rows], parent[rows]))]
    by_start = rows[np.lexsort((start[rows], parent[rows]))]
    grouped = parent[by_end]
    everyone = np.arange(n)
    return _Children(
        rows=by_end.tolist(),
        ends=end[by_end].tolist(),
        starts=start[by_start].tolist(),
        begin=np.searchsorted(grouped, everyone, side="left").tolist(),
        stop=np.searchsorted(grouped, everyone, side="right").tolist(),
    )


@dataclass(frozen=True)
class PathStep:
    row: int
    service: str
    operation: str
    exclusive_ns: int


@dataclass(frozen=True)
class TracePath:
    trace_id: str
    total_ns: int
    steps: list[PathStep]

    def to_json(self) -> dict:
        return {
            "trace_id": self.trace_id,
            "total_us": self.total_ns / 1000,
            "path": [
                {"service": s.service, "operation": s.operation, "exclusive_us": s.exclusive_ns / 1000}
                for s in self.steps
            ],
        }


def trace_paths(forest: SpanForest, paths: CriticalPaths | None = None) -> list[TracePath]:
    """Each trace's critical path as named steps (for printing and explanations)."""
    paths = paths or critical_paths(forest)
    services = forest.spans["service"].to_pylist()
    operations = forest.spans["operation"].to_pylist()
    result = []
    for trace, trace_id in enumerate(forest.trace_ids):
        steps = [
            PathStep(row, services[row], operations[row], int(paths.exclusive_ns[row]))
            for row in paths.path_rows(forest, trace).tolist()
        ]
        root = forest.root[trace]
        result.append(TracePath(trace_id, int(forest.duration_ns[root]), steps))
    return result
