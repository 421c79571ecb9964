"""Trace assembly and repair: every bad input gets a documented repair or a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import chain, spans

from bmeg.graphs import assemble
from bmeg.traces import TraceInputError, span_table


def parent_of(forest) -> dict[str, str | None]:
    ids = forest.spans["span_id"].to_pylist()
    return {ids[row]: (ids[p] if p >= 0 else None) for row, p in enumerate(forest.parent.tolist())}


def starts(forest) -> dict[str, int]:
    return dict(zip(forest.spans["span_id"].to_pylist(), forest.start_ns.tolist()))


def test_clean_trace_needs_no_repair():
    forest = assemble(spans([("a", None, 0, 100), ("b", "a", 10, 50), ("c", "b", 20, 10)]))
    assert parent_of(forest) == {"a": None, "b": "a", "c": "b"}
    assert forest.depth.tolist() == [0, 1, 2]
    assert forest.warnings == [] and forest.dropped == []


def test_traces_are_split_and_grouped():
    table = span_table(
        {
            "trace_id": ["x", "y", "x", "y"],
            "span_id": ["1", "1", "2", "2"],  # the same span ids in two traces are fine
            "parent_id": [None, None, "1", "1"],
            "service": ["s"] * 4,
            "operation": ["o"] * 4,
            "start_ns": [0, 0, 1, 1],
            "duration_ns": [9, 9, 1, 1],
        }
    )
    forest = assemble(table)
    assert forest.trace_ids == ["x", "y"]
    assert forest.trace_offsets.tolist() == [0, 2, 4]
    assert forest.parent.tolist() == [-1, 0, -1, 2]
    assert forest.warnings == []


def test_single_span_trace():
    forest = assemble(spans([("a", None, 5, 7)]))
    assert forest.root.tolist() == [0] and forest.parent.tolist() == [-1]


def test_duplicate_span_id_keeps_first_complete_copy():
    forest = assemble(spans([("a", None, 0, 100), ("b", "a", 10, 0), ("b", "a", 10, 40)]))
    assert forest.num_spans == 2
    assert forest.duration_ns.tolist() == [100, 40]  # the complete copy, not the 0-length one
    assert [(d.span_id, d.reason) for d in forest.dropped] == [("b", "duplicate span id")]
    assert any("span b" in w and "duplicate" in w for w in forest.warnings)


def test_a_repair_names_its_trace_and_span_as_fields_not_as_text():
    """Repairs are matched to traces by id: trace t10's repair never lands on t1."""
    import pyarrow as pa

    table = pa.concat_tables([spans([("a", None, 0, 100)], trace_id="t1"),
                              spans([("a", None, 0, 100), ("b", "a", 10, 40), ("b", "a", 10, 40)], trace_id="t10")])
    forest = assemble(table)
    assert [(r.trace_id, r.span_id, r.kind) for r in forest.repairs] == [("t10", "b", "duplicate")]
    assert forest.warnings == ["trace t10: span b: duplicate span id; kept the first complete copy, dropped one"]


def test_orphan_is_attached_to_root_with_its_timing():
    forest = assemble(spans([("a", None, 0, 100), ("b", "missing", 150, 10)]))
    assert parent_of(forest) == {"a": None, "b": "a"}
    assert starts(forest)["b"] == 150  # orphans are not skew-shifted
    assert any("span b" in w and "not in the trace" in w for w in forest.warnings)


def test_no_root_makes_earliest_orphan_root():
    forest = assemble(spans([("b", "gone", 20, 10), ("a", "gone", 10, 50), ("c", "a", 15, 5)]))
    assert parent_of(forest) == {"a": None, "b": "a", "c": "a"}
    assert any("span a" in w and "no root" in w for w in forest.warnings)


def test_self_parent_is_an_orphan():
    forest = assemble(spans([("a", None, 0, 100), ("b", "b", 10, 10)]))
    assert parent_of(forest) == {"a": None, "b": "a"}
    assert any("span b" in w and "its own parent" in w for w in forest.warnings)


def test_cycle_is_cut_at_the_edge_against_time_order():
    # x -> y -> x; y starts after x, so the link "x's parent is y" goes back in time.
    forest = assemble(spans([("r", None, 0, 100), ("x", "y", 10, 50), ("y", "x", 20, 10)]))
    assert parent_of(forest) == {"r": None, "x": "r", "y": "x"}
    assert any("span x" in w and "cycle" in w for w in forest.warnings)


def test_cycle_without_any_root():
    forest = assemble(spans([("p", "q", 0, 100), ("q", "p", 10, 20)]))
    assert parent_of(forest) == {"p": None, "q": "p"}
    assert forest.dropped == []


def test_several_roots_keep_the_earliest_longest():
    forest = assemble(spans([("late", None, 50, 10), ("short", None, 0, 10), ("long", None, 0, 90)]))
    assert parent_of(forest) == {"short": "long", "long": None, "late": "long"}
    assert sum("second root" in w for w in forest.warnings) == 2


def test_negative_duration_is_rejected_naming_trace_and_span():
    table = spans([("a", None, 0, 100), ("b", "a", 10, -5)], trace_id="bad")
    with pytest.raises(TraceInputError, match="trace bad, span b: negative duration -5 ns") as error:
        assemble(table)
    assert (error.value.trace_id, error.value.span_id) == ("bad", "b")


def test_bad_trace_can_be_dropped_so_others_go_on():
    table = span_table(
        {
            "trace_id": ["good", "bad", "bad"],
            "span_id": ["a", "a", "b"],
            "parent_id": [None, None, "a"],
            "service": ["s"] * 3,
            "operation": ["o"] * 3,
            "start_ns": [0, 0, 1],
            "duration_ns": [5, 5, -1],
        }
    )
    forest = assemble(table, on_bad_trace="drop")
    assert forest.trace_ids == ["good"]
    assert sorted((d.trace_id, d.span_id, d.reason) for d in forest.dropped) == [
        ("bad", "a", "its trace has an unrepairable span"),
        ("bad", "b", "negative duration"),
    ]


def test_empty_span_id_is_rejected():
    with pytest.raises(TraceInputError, match="missing span id"):
        assemble(spans([("", None, 0, 1)]))


def test_child_starting_before_parent_is_shifted_with_its_subtree():
    forest = assemble(
        spans([("r", None, 1000, 1000), ("s", "r", 900, 600), ("m", "s", 950, 100)])
    )
    assert starts(forest) == {"r": 1000, "s": 1000, "m": 1050}
    assert [w for w in forest.warnings if "clock skew" in w] == [
        "trace t1: span s: outside its parent r by clock skew; shifted it and its subtree by +0.1 us"
    ]


def test_sync_child_ending_after_parent_is_pulled_back():
    forest = assemble(spans([("r", None, 0, 100), ("c", "r", 60, 50, "client")]))
    assert starts(forest)["c"] == 50


def test_sync_child_longer_than_parent_starts_with_it():
    forest = assemble(spans([("r", None, 100, 50), ("c", "r", 90, 80, "client")]))
    assert starts(forest)["c"] == 100
    assert any("longer than its parent" in w for w in forest.warnings)


def test_async_children_keep_their_timing():
    forest = assemble(
        spans(
            [
                ("r", None, 0, 100, "server"),
                ("p", "r", 10, 20, "producer"),
                ("q", "p", 40, 110, "consumer"),  # outlives its producer and the root
                ("f", "r", 100, 30, "internal"),  # starts as the root ends: follows-from
            ]
        )
    )
    assert starts(forest) == {"r": 0, "p": 10, "q": 40, "f": 100}
    assert forest.warnings == []


def test_consumer_cannot_start_before_its_producer():
    forest = assemble(spans([("r", None, 0, 100, "producer"), ("q", "r", -30, 200, "consumer")]))
    assert starts(forest)["q"] == 0


def test_deep_chain_of_100k_spans():
    n = 100_000
    forest = assemble(chain("deep", list(range(n)), [2 * (n - i) for i in range(n)]))
    assert forest.depth.max() == n - 1
    assert np.array_equal(forest.parent[1:], np.arange(n - 1))


def test_skewed_deep_chain_of_100k_spans_is_repaired_iteratively():
    n = 100_000  # every child starts 1 ns before its parent: one long chain of shifts
    forest = assemble(chain("skew", [n - i for i in range(n)], [1] * n))
    assert set(forest.start_ns.tolist()) == {n}
    assert forest.depth.max() == n - 1


@st.composite
def messy_traces(draw):
    """Span tables with duplicate ids, missing parents, self-parents, cycles and several roots."""
    columns = {name: [] for name in ("trace_id", "span_id", "parent_id", "start_ns", "duration_ns")}
    for trace in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 25))
        ids = [f"{draw(st.integers(0, n)):x}" for _ in range(n)]  # collisions make duplicates
        for span_id in ids:
            columns["trace_id"].append(f"t{trace}")
            columns["span_id"].append(span_id)
            columns["parent_id"].append(draw(st.none() | st.sampled_from(ids) | st.just("nowhere")))
            columns["start_ns"].append(draw(st.integers(-100, 100)))
            columns["duration_ns"].append(draw(st.integers(0, 100)))
    count = len(columns["trace_id"])
    return span_table({**columns, "service": ["s"] * count, "operation": ["o"] * count})


@settings(max_examples=100, deadline=None)
@given(messy_traces())
def test_repair_never_loses_a_span_silently(table):
    forest = assemble(table)
    assert forest.num_spans + len(forest.dropped) == table.num_rows
    assert all(d.reason == "duplicate span id" for d in forest.dropped)
    # One root per trace, every parent in the span's own trace, and no cycles left.
    assert (forest.parent < 0).sum() == forest.num_traces
    linked = forest.parent >= 0
    assert np.array_equal(forest.trace_index[forest.parent[linked]], forest.trace_index[linked])
    assert np.array_equal(forest.depth[linked], forest.depth[forest.parent[linked]] + 1)
    ids = table["span_id"].to_pylist()
    if len(set(zip(table["trace_id"].to_pylist(), ids))) < len(ids) or forest.dropped:
        assert forest.warnings
