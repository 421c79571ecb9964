"""Critical paths (CRISP semantics) on hand-worked traces and as properties of random traces."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from builders import chain, spans

from bmeg.graphs import assemble, critical_paths, trace_paths
from bmeg.graphs.critical_path import OVERLAP_ALLOWANCE
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


def test_child_outliving_its_parent_counts_up_to_the_parent_end():
    # CRISP rule 1: q (an async consumer child) runs past r's end; it is clipped, not dropped.
    forest = assemble(spans([("r", None, 0, 100, "server"), ("p", "r", 10, 20, "client"),
                             ("q", "r", 60, 90, "consumer")]))  # fmt: skip
    assert path_of(forest) == [("r", 40), ("p", 20), ("q", 40)]
    paths = critical_paths(forest)
    assert paths.window_end_ns[paths.on_path].max() == 100


def test_child_wholly_after_its_parent_is_not_on_the_path():
    forest = assemble(spans([("r", None, 0, 100), ("p", "r", 10, 20, "producer"), ("q", "p", 40, 50, "consumer")]))
    assert path_of(forest) == [("r", 80), ("p", 20)]


def test_slightly_overlapping_critical_child_counts_up_to_the_next_start():
    # b ends 0.5 ns (0.5% of a's 100 ns) after c starts: within CRISP's 1% allowance, b is
    # on the path and counts up to c's start; its own child d is clipped to that window too.
    forest = assemble(spans([("a", None, 0, 1000), ("b", "a", 0, 505), ("c", "a", 500, 500),
                             ("d", "b", 400, 105)]))  # fmt: skip
    assert path_of(forest) == [("a", 0), ("b", 400), ("d", 100), ("c", 500)]


def test_overlap_beyond_the_allowance_or_with_a_third_event_is_concurrency():
    wide = assemble(spans([("a", None, 0, 1000), ("b", "a", 0, 520), ("c", "a", 500, 500)]))
    assert path_of(wide) == [("a", 500), ("c", 500)]
    # e starts inside the b/c overlap: b and c ran side by side, b is not before c.
    third = assemble(spans([("a", None, 0, 1000), ("b", "a", 0, 505), ("c", "a", 500, 500), ("e", "a", 502, 1)]))
    assert path_of(third) == [("a", 500), ("c", 500)]
    # x ends just as c starts: an event in the overlap too; x, not b, comes before c.
    touching = assemble(spans([("a", None, 0, 1000), ("b", "a", 0, 505), ("x", "a", 10, 490), ("c", "a", 500, 500)]))
    assert path_of(touching) == [("a", 10), ("x", 490), ("c", 500)]
    # y ends with b, inside the overlap: neither is before c.
    both = assemble(spans([("a", None, 0, 1000), ("b", "a", 0, 505), ("y", "a", 100, 405), ("c", "a", 500, 500)]))
    assert path_of(both) == [("a", 500), ("c", 500)]
    allowed = critical_paths(wide, overlap_allowance=0.05)
    assert allowed.exclusive_ns[allowed.on_path].tolist() == [0, 500, 500]


def test_start_time_zero_is_a_time():
    # Jaeger's epoch: a trace may start at 0; the path does not take 0 for "unset".
    forest = assemble(spans([("a", None, 0, 10), ("b", "a", 0, 4), ("c", "a", 4, 6)]))
    assert path_of(forest) == [("a", 0), ("b", 4), ("c", 6)]


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


def reference_path(forest, allowance: float = OVERLAP_ALLOWANCE) -> dict[int, int]:
    """CRISP's recursion written plainly, for small traces: row -> exclusive ns. Clip the
    children to the window (drop those outside), take them latest end first, each that
    happens before the last one taken, and give each its window."""
    start, end, parent = forest.start_ns.tolist(), forest.end_ns.tolist(), forest.parent.tolist()
    children: dict[int, list[int]] = {}
    for row, up in enumerate(parent):
        children.setdefault(up, []).append(row)
    exclusive: dict[int, int] = {}

    def visit(row: int, low: int, high: int) -> None:
        kept = [(max(start[c], low), min(end[c], high), c) for c in children.get(row, [])
                if start[c] < high and end[c] > low]  # fmt: skip
        kept.sort(key=lambda k: (-k[1], start[k[2]], k[2]))
        taken: list[tuple[int, int, int]] = []  # (low, high, row), windows
        for c_low, c_high, child in kept:
            if taken:
                l_low, l_high, _ = taken[-1]
                if c_high > l_low:  # not over before the last one started: an allowed overlap?
                    events = [t for k_low, k_high, k in kept for t in (start[k], end[k])]
                    in_overlap = sum(l_low <= t <= c_high for t in events)
                    if not (c_high < l_high and c_low < l_low and c_high - l_low < allowance * (high - low)
                            and in_overlap == 2):  # fmt: skip
                        continue
                    c_high = l_low
            taken.append((c_low, c_high, child))
        for c_low, c_high, child in taken:
            visit(child, c_low, c_high)
        exclusive[row] = high - low - sum(c_high - c_low for c_low, c_high, _ in taken)

    for root in forest.root.tolist():
        visit(root, start[root], end[root])
    return exclusive


@st.composite
def random_traces(draw, max_spans: int = 30, max_time: int = 200, max_parent: int | None = None):
    """Span tables of a few traces with arbitrary (also skewed and async) times and kinds;
    a small `max_time` makes equal times (ties, touching and barely overlapping calls) common,
    a small `max_parent` (parents among the first spans) many siblings."""
    columns = {name: [] for name in ("trace_id", "span_id", "parent_id", "start_ns", "duration_ns", "kind")}
    for trace in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, max_spans))
        for i in range(n):
            columns["trace_id"].append(f"t{trace}")
            columns["span_id"].append(f"{i:x}")
            up = i - 1 if max_parent is None else min(i - 1, max_parent)
            columns["parent_id"].append(None if i == 0 else f"{draw(st.integers(0, up)):x}")
            columns["start_ns"].append(draw(st.integers(0, max_time)))
            columns["duration_ns"].append(draw(st.integers(0, max_time)))
            columns["kind"].append(draw(st.sampled_from(["server", "client", "producer", "consumer"])))
    count = len(columns["trace_id"])
    return span_table({**columns, "service": ["s"] * count, "operation": ["o"] * count})


@settings(max_examples=500, deadline=None)
@given(random_traces() | random_traces(max_spans=12, max_time=12, max_parent=1)
       | random_traces(max_spans=8, max_time=8, max_parent=0),
       st.sampled_from([0.0, OVERLAP_ALLOWANCE, 0.2, 1.0]))  # fmt: skip
def test_path_properties(table, allowance):
    """Exclusive times add up to the root's duration, none negative, as CRISP's recursion says
    (the larger allowances make rule 3's overlaps common in traces of 0-200 ns)."""
    forest = assemble(table)
    paths = critical_paths(forest, overlap_allowance=allowance)
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
        reference_path(forest, allowance)
    )
    windows = paths.window_end_ns - paths.window_start_ns
    assert (windows[paths.on_path] >= 0).all()
