"""The critical path of each trace, with CRISP semantics (Zhang et al., USENIX ATC'22).

From the root, follow the child that returned last before the parent ended, then the child
that returned last before that child started, and so on; recurse into each chosen child. A
span's exclusive critical-path time is its time on the path not covered by its chosen
children, so the exclusive times along a path add up to the root's duration.

Two steps, both over all traces at once:

1. numpy (O(n log n)): for every span, its *first* path child (the child with the latest end
   not after the span's end) and, for every child, the *next* path sibling (the sibling with
   the latest end not after this child's start). Ties on the end go to the longer child.
2. one iterative walk (no recursion, so deep traces are fine) over the path spans only,
   following those two pointers. A child that starts before its parent's window (an async or
   orphan child that kept its timing) is clipped to the window and ends the chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bmeg.graphs.assemble import SpanForest


@dataclass(frozen=True)
class CriticalPaths:
    """Per span of a forest: on the path or not, exclusive path time, and where its part starts."""

    on_path: np.ndarray  # bool [n]
    exclusive_ns: np.ndarray  # int64 [n], 0 off the path
    window_start_ns: np.ndarray  # int64 [n]: start of the span's stretch of the path (clipped)

    def path_rows(self, forest: SpanForest, trace: int) -> np.ndarray:
        """Rows on a trace's path, in time order (each span before its path children)."""
        rows = np.arange(*forest.trace_slice(trace).indices(forest.num_spans))
        rows = rows[self.on_path[rows]]
        return rows[np.lexsort((forest.depth[rows], self.window_start_ns[rows]))]


def critical_paths(forest: SpanForest) -> CriticalPaths:
    """The critical path of every trace of the forest."""
    first_child, next_sibling = _path_pointers(forest)
    n = forest.num_spans
    start = forest.start_ns.tolist()
    end = forest.end_ns.tolist()
    first = first_child.tolist()
    following = next_sibling.tolist()
    # Two stacks of ints rather than one of tuples: no allocations that wake the GC up.
    stack_rows = forest.root.tolist()
    stack_lows = forest.start_ns[forest.root].tolist()
    visited, lows, exclusive = [], [], []  # per path span, in visiting order
    while stack_rows:
        row, low = stack_rows.pop(), stack_lows.pop()
        covered = 0
        child = first[row]
        while child >= 0 and end[child] > low:
            child_low = max(start[child], low)
            covered += end[child] - child_low
            stack_rows.append(child)
            stack_lows.append(child_low)
            if start[child] <= low:
                break
            child = following[child]
        visited.append(row)
        lows.append(low)
        exclusive.append(end[row] - low - covered)
    paths = CriticalPaths(
        on_path=np.zeros(n, dtype=bool),
        exclusive_ns=np.zeros(n, dtype=np.int64),
        window_start_ns=np.zeros(n, dtype=np.int64),
    )
    paths.on_path[visited] = True
    paths.exclusive_ns[visited] = exclusive
    paths.window_start_ns[visited] = lows
    return paths


def _path_pointers(forest: SpanForest) -> tuple[np.ndarray, np.ndarray]:
    """first_child[row] and next_sibling[row] (-1 where none), see the module docstring."""
    n = forest.num_spans
    start, end, parent = forest.start_ns, forest.end_ns, forest.parent
    children = np.flatnonzero(parent >= 0)
    if len(children) == 0:
        return np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    # Children grouped by parent, by end; equal ends put the longer (earlier start) last.
    children = children[np.lexsort((-start[children], end[children], parent[children]))]
    # Replace times by their ranks so (parent, time) packs into one sortable int64.
    times, ranks = np.unique(np.concatenate([end, start]), return_inverse=True)
    end_rank, start_rank = ranks[:n], ranks[n:]
    width = np.int64(len(times) + 1)
    packed = parent[children] * width + end_rank[children]

    def last_child_ending_by(owner: np.ndarray, time_rank: np.ndarray, before: np.ndarray) -> np.ndarray:
        position = np.searchsorted(packed, owner * width + time_rank, side="right") - 1
        position = np.minimum(position, before)
        found = position >= 0
        found[found] &= parent[children[position[found]]] == owner[found]
        return np.where(found, children[np.maximum(position, 0)], -1)

    everyone = np.arange(n, dtype=np.int64)
    first_child = last_child_ending_by(everyone, end_rank, np.full(n, len(children) - 1))
    next_sibling = np.full(n, -1, dtype=np.int64)
    # Strictly earlier in the order than the child itself, so a chain always moves on.
    position_of_child = np.arange(len(children)) - 1
    next_sibling[children] = last_child_ending_by(parent[children], start_rank[children], position_of_child)
    return first_child, next_sibling


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
