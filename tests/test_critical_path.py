"""Critical paths (CRISP semantics) on hand-worked traces and as properties of random traces."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_graphs_assemble import chain, spans

from bmeg.graphs import assemble, critical_paths, trace_paths
from bmeg.traces import span_table


def path_of(forest) -> list[tuple[str, int]]:
    """[(span id, exclusive ns)] along the first trace's path, in time order."""
    (path,) = trace_paths(forest)[:1]
    return [(step.operation.removeprefix("op-"), step.exclusive_ns) for step in path.steps]


def test_concurrent_children_follow_the_last_returned():
    #  a [0,100]: b [5,40], c [5,20], d [10,45], e [50,80], f [50,95] > g [60,90]
    forest = assemble(
        spans(
            [
                ("a", None, 0, 100),
                ("b", "a", 5, 35),
                ("c", "a", 5, 15),
                ("d", "a", 10, 35),
                ("e", "a", 50, 30),
                ("f", "a", 50, 45),
                ("g", "f", 60, 30),
            ]
        )
    )
    # f returned last; before f started (50) d returned last (45); nothing ended before 10.
    assert path_of(forest) == [("a", 20), ("d", 35), ("f", 15), ("g", 30)]


def test_async_child_outliving_its_parent_is_not_on_the_path():
    forest = assemble(
        spans(
            [
                ("r", None, 0, 100, "server"),
                ("p", "r", 10, 20, "producer"),
                ("q", "p", 40, 110, "consumer"),
                ("s", "r", 20, 40, "client"),
            ]
        )
    )
    assert path_of(forest) == [("r", 60), ("s", 40)]


def test_clock_skew_is_repaired_before_the_path():
    forest = assemble(
        spans(
            [
                ("r", None, 1000, 1000),
                ("c", "r", 1100, 800, "client"),
                ("s", "c", 900, 600, "server"),  # 200 ns early: shifted to 1100
                ("m", "s", 950, 100, "client"),  # moves with s to 1150
                ("x", "r", 1960, 60, "client"),  # ends 20 ns after r: pulled back to 1940
            ]
        )
    )
    assert path_of(forest) == [("r", 140), ("c", 200), ("s", 500), ("m", 100), ("x", 60)]


def test_orphan_before_root_window_is_clipped():
    # The orphan keeps its timing [-50, 30]; on the path it counts only from the root's start.
    forest = assemble(spans([("r", None, 0, 100), ("o", "gone", -50, 80), ("k", "r", 40, 50)]))
    assert path_of(forest) == [("r", 20), ("o", 30), ("k", 50)]


def test_single_span_path_is_the_span():
    forest = assemble(spans([("a", None, 3, 7)]))
    assert path_of(forest) == [("a", 7)]
    assert trace_paths(forest)[0].to_json() == {
        "trace_id": "t1",
        "total_us": 0.007,
        "path": [{"service": "svc-a", "operation": "op-a", "exclusive_us": 0.007}],
    }


def test_deep_chain_of_100k_spans():
    n = 100_000
    table = chain("deep", list(range(n)), [2 * (n - i) for i in range(n)])
    forest = assemble(table)
    paths = critical_paths(forest)
    assert paths.on_path.all()
    assert paths.exclusive_ns.sum() == 2 * n
    assert paths.exclusive_ns[-1] == 2  # the leaf's whole duration


def reference_path(forest) -> dict[int, int]:
    """Straightforward recursive CRISP, for small traces: row -> exclusive ns."""
    start, end, parent = forest.start_ns.tolist(), forest.end_ns.tolist(), forest.parent.tolist()
    children: dict[int, list[int]] = {}
    for row, up in enumerate(parent):
        children.setdefault(up, []).append(row)
    exclusive: dict[int, int] = {}

    def visit(row: int, low: int) -> None:
        cursor, covered = end[row], 0
        for child in sorted(children.get(row, []), key=lambda c: (-end[c], start[c], -c)):
            if end[child] > cursor:
                continue
            if end[child] <= low:
                break
            child_low = max(start[child], low)
            covered += end[child] - child_low
            visit(child, child_low)
            cursor = start[child]
            if start[child] <= low:
                break
        exclusive[row] = end[row] - low - covered

    for root in forest.root.tolist():
        visit(root, start[root])
    return exclusive


@st.composite
def random_traces(draw, max_spans: int = 30):
    """Span tables of a few traces with arbitrary (also skewed and async) times and kinds."""
    columns = {name: [] for name in ("trace_id", "span_id", "parent_id", "start_ns", "duration_ns", "kind")}
    for trace in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, max_spans))
        for i in range(n):
            columns["trace_id"].append(f"t{trace}")
            columns["span_id"].append(f"{i:x}")
            columns["parent_id"].append(None if i == 0 else f"{draw(st.integers(0, i - 1)):x}")
            columns["start_ns"].append(draw(st.integers(0, 200)))
            columns["duration_ns"].append(draw(st.integers(0, 200)))
            columns["kind"].append(draw(st.sampled_from(["server", "client", "producer", "consumer"])))
    count = len(columns["trace_id"])
    return span_table({**columns, "service": ["s"] * count, "operation": ["o"] * count})


@settings(max_examples=100, deadline=None)
@given(random_traces())
def test_path_properties(table):
    forest = assemble(table)
    paths = critical_paths(forest)
    for trace in range(forest.num_traces):
        rows = np.arange(forest.trace_offsets[trace], forest.trace_offsets[trace + 1])
        on_path = rows[paths.on_path[rows]]
        root = forest.root[trace]
        # Exclusive times along the path add up to the root's duration, none negative.
        assert paths.exclusive_ns[on_path].sum() == forest.duration_ns[root]
        assert (paths.exclusive_ns[rows] >= 0).all()
        # The path is closed under "parent of": every path span's ancestors are on it.
        assert all(paths.on_path[forest.parent[row]] for row in on_path if row != root)
    assert dict(zip(np.flatnonzero(paths.on_path).tolist(), paths.exclusive_ns[paths.on_path].tolist())) == (
        reference_path(forest)
    )
