"""The Kafka-free parts of serving: micro-batching, trace assembly, offset tracking."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.serving.assembler import TraceAssembler, split_by_trace
from bmeg.serving.batcher import MicroBatcher
from bmeg.serving.model import ModelSlot
from bmeg.serving.offsets import OffsetTracker
from bmeg.traces import TraceInputError, span_table
from test_serving_fixtures import StandInDetector


def spans_of(trace_ids: list[str], service: str = "api") -> pa.Table:
    n = len(trace_ids)
    return span_table({
        "trace_id": trace_ids, "span_id": [f"{i:016x}" for i in range(n)], "parent_id": [None] * n,
        "service": [service] * n, "operation": ["GET"] * n, "start_ns": [1_000] * n, "duration_ns": [500] * n,
    })


# -- micro-batching ----------------------------------------------------------------------
def run_concurrently(detector: StandInDetector, requests: list[tuple[pa.Table, bool]]) -> list:
    async def main():
        batcher = MicroBatcher(ModelSlot(detector), max_batch_spans=1_000)
        batcher.start()
        try:
            return await asyncio.gather(*(batcher.diagnose(spans, window) for spans, window in requests),
                                        return_exceptions=True)
        finally:
            await batcher.stop()

    return asyncio.run(main())


def test_requests_queued_while_the_model_is_busy_share_one_call():
    detector = StandInDetector(delay_s=0.1)

    async def main():
        batcher = MicroBatcher(ModelSlot(detector), max_batch_spans=1_000)
        batcher.start()
        first = asyncio.create_task(batcher.diagnose(spans_of(["t0"]), False))
        await asyncio.sleep(0.03)  # the model is now busy with t0
        rest = await asyncio.gather(*(batcher.diagnose(spans_of([f"t{i}"]), False) for i in range(1, 6)))
        await batcher.stop()
        return [await first, *rest]

    results = asyncio.run(main())
    assert [[t.trace_id for t in r.traces] for r in results] == [[f"t{i}"] for i in range(6)]
    assert detector.calls == [1, 5]


def test_a_bad_request_fails_alone_and_its_batch_mates_succeed():
    detector = StandInDetector(delay_s=0.05, fail_on=frozenset({"bad"}))
    results = run_concurrently(detector, [(spans_of(["t0"]), False), (spans_of(["t1"]), False),
                                          (spans_of(["bad"]), False), (spans_of(["t3"]), False)])

    assert isinstance(results[2], TraceInputError)
    assert [r.traces[0].trace_id for r in (results[0], results[1], results[3])] == ["t0", "t1", "t3"]


def test_window_requests_and_shared_trace_ids_are_never_mixed():
    detector = StandInDetector(delay_s=0.05)
    results = run_concurrently(detector, [(spans_of(["a"]), False), (spans_of(["b"]), False),
                                          (spans_of(["b"]), False), (spans_of(["c", "d"]), True)])

    assert [r.ranking is not None for r in results] == [False, False, False, True]
    assert [len(r.traces) for r in results] == [1, 1, 1, 2]
    assert detector.calls == [2, 1, 2]  # a+b together; the second b alone; the window alone


# -- assembly ----------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_trace_spread_over_messages_finishes_once_idle_with_all_its_sources():
    clock = Clock()
    assembler = TraceAssembler(idle_timeout_s=2.0, max_spans=100, clock=clock)
    assert assembler.add(spans_of(["a", "b", "a"]), ("p0", 1)) == 2
    clock.now = 1.5
    assembler.add(spans_of(["a"]), ("p1", 7))
    clock.now = 2.5  # b idle for 2.5 s, a for 1 s

    (b,) = assembler.finished()
    assert (b.trace_id, b.spans, b.sources) == ("b", 1, {("p0", 1)})
    clock.now = 3.6
    (a,) = assembler.finished()
    assert (a.trace_id, a.table().num_rows, a.sources) == ("a", 3, {("p0", 1), ("p1", 7)})
    assert len(assembler) == 0


def test_a_trace_at_the_span_cap_finishes_at_once():
    assembler = TraceAssembler(idle_timeout_s=60, max_spans=3, clock=Clock())
    assembler.add(spans_of(["big"] * 2 + ["small"]), ("p", 0))
    assert assembler.finished() == []
    assembler.add(spans_of(["big"]), ("p", 1))
    assert [t.trace_id for t in assembler.finished()] == ["big"]
    assert [t.trace_id for t in assembler.drain()] == ["small"]


@given(st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=40))
def test_split_by_trace_keeps_every_span_once(trace_ids):
    pieces = split_by_trace(spans_of(trace_ids))
    assert sorted(trace_id for trace_id, _ in pieces) == sorted(set(trace_ids))
    assert all(set(piece["trace_id"].to_pylist()) == {trace_id} for trace_id, piece in pieces)
    assert sum(piece.num_rows for _, piece in pieces) == len(trace_ids)


# -- offsets -----------------------------------------------------------------------------
def test_the_commit_point_stops_at_the_lowest_message_with_a_trace_pending():
    tracker = OffsetTracker()
    tracker.received("p", 0, 1)
    tracker.received("p", 1, 2)
    tracker.received("p", 2, 0)  # e.g. dead-lettered
    assert tracker.commit_points() == {"p": 0}
    tracker.release("p", 1)
    tracker.release("p", 0)
    assert tracker.commit_points() == {"p": 1}
    tracker.release("p", 1)
    assert tracker.commit_points() == {"p": 3}
    tracker.forget(["p"])
    assert tracker.commit_points() == {}


def test_offsets_must_arrive_in_order():
    tracker = OffsetTracker()
    tracker.received("p", 5, 1)
    with pytest.raises(ValueError, match="out of order"):
        tracker.received("p", 5, 1)


@settings(max_examples=100)
@given(st.data())
def test_never_commits_past_a_message_whose_trace_is_unpublished(data):
    """Random messages carry random traces; traces publish in random order. At every step the
    commit point of each partition is below every message that still has a trace pending."""
    tracker = OffsetTracker()
    clock = Clock()
    assembler = TraceAssembler(idle_timeout_s=0, max_spans=10_000, clock=clock)
    next_offset = {"p0": 0, "p1": 0}
    pending = []
    for _ in range(data.draw(st.integers(1, 25))):
        if data.draw(st.booleans()) or not len(assembler):
            partition = data.draw(st.sampled_from(["p0", "p1"]))
            offset = next_offset[partition]
            next_offset[partition] += 1
            traces = data.draw(st.lists(st.sampled_from("abcdef"), min_size=0, max_size=4))
            tracker.received(partition, offset, assembler.add(spans_of(traces), (partition, offset)) if traces else 0)
        else:
            clock.now += 1
            pending += assembler.finished()
            if pending:
                done = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
                for partition, offset in done.sources:
                    tracker.release(partition, offset)
        points = tracker.commit_points()
        for trace in [*pending, *assembler]:
            for partition, offset in trace.sources:
                assert points[partition] <= offset
