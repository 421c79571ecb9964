"""The Kafka-free parts of serving: micro-batching, trace assembly, offset tracking."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.serving.assembler import TraceAssembler, split_by_trace
from bmeg.serving.batcher import MicroBatcher
from bmeg.serving.payloads import Answer, Limits, Payload, RequestRefused, diagnose_payloads
from bmeg.serving.model import ModelSlot
from bmeg.serving.offsets import OffsetTracker
from bmeg.traces import span_table, to_otlp_proto_bytes
from serving_fixtures import StandInDetector


def spans_of(trace_ids: list[str], service: str = "api", parent: str | None = None) -> pa.Table:
    """One span per trace id given, each a root (`parent` None) or a child of `parent`."""
    n = len(trace_ids)
    return span_table({
        "trace_id": trace_ids, "span_id": [f"{i:016x}" for i in range(n)], "parent_id": [parent] * n,
        "service": [service] * n, "operation": ["GET"] * n, "start_ns": [1_000] * n, "duration_ns": [500] * n,
    })


# -- micro-batching ----------------------------------------------------------------------
LIMITS = Limits(max_spans=100, max_batch_spans=1_000)


def tid(name: str) -> str:
    """A trace id (32 hex digits) for a short name."""
    return name.encode().hex().rjust(32, "0")


def payload_of(names: list[str]) -> Payload:
    return Payload(to_otlp_proto_bytes(spans_of([tid(name) for name in names])), "application/x-protobuf")


def trace_names(answer: Answer) -> list[str]:
    return [bytes.fromhex(t.trace_id.lstrip("0")).decode() for t in answer.diagnosis.traces]


def run_concurrently(detector: StandInDetector, requests: list[tuple[list[str], bool]]) -> list:
    async def main():
        batcher = MicroBatcher(ModelSlot(detector), LIMITS, max_batch_bytes=1_000_000)
        batcher.start()
        try:
            return await asyncio.gather(*(batcher.diagnose(payload_of(names), window) for names, window in requests),
                                        return_exceptions=True)
        finally:
            await batcher.stop()

    return asyncio.run(main())


def test_requests_queued_while_the_model_is_busy_share_one_call():
    detector = StandInDetector(delay_s=0.1)

    async def main():
        batcher = MicroBatcher(ModelSlot(detector), LIMITS, max_batch_bytes=1_000_000)
        batcher.start()
        first = asyncio.create_task(batcher.diagnose(payload_of(["t0"]), False))
        await asyncio.sleep(0.03)  # the model is now busy with t0
        rest = await asyncio.gather(*(batcher.diagnose(payload_of([f"t{i}"]), False) for i in range(1, 6)))
        await batcher.stop()
        return [await first, *rest]

    results = asyncio.run(main())
    assert [trace_names(r) for r in results] == [[f"t{i}"] for i in range(6)]
    assert detector.calls == [1, 5]


def test_under_load_calls_are_spaced_so_requests_share_them_and_an_idle_server_answers_at_once():
    detector = StandInDetector()

    async def main():
        # an interval long beside a loaded machine's scheduling delays (0.3 s was once missed at load 13)
        batcher = MicroBatcher(ModelSlot(detector), LIMITS, max_batch_bytes=1_000_000, min_interval_s=1.0)
        batcher.start()
        started = asyncio.get_running_loop().time()
        first = await batcher.diagnose(payload_of(["t0"]), False)
        idle_answer_s = asyncio.get_running_loop().time() - started

        async def later(i: int):
            await asyncio.sleep(0.02 * i)  # all arrive within the 1 s after the first call
            return await batcher.diagnose(payload_of([f"t{i}"]), False)

        rest = await asyncio.gather(*(later(i) for i in range(1, 5)))
        await batcher.stop()
        return idle_answer_s, [first, *rest]

    idle_answer_s, results = asyncio.run(main())
    assert idle_answer_s < 1.0  # the first request did not wait for the interval
    assert [trace_names(r) for r in results] == [[f"t{i}"] for i in range(5)]
    assert detector.calls == [1, 4]


def test_a_bad_request_fails_alone_with_its_status_and_its_batch_mates_succeed():
    detector = StandInDetector(delay_s=0.05, fail_on=frozenset({tid("bad")}))
    results = run_concurrently(detector, [(["t0"], False), (["t1"], False), (["bad"], False), (["t3"], False)])

    assert isinstance(results[2], RequestRefused) and results[2].status == 422
    assert "refused by the stand-in" in results[2].message
    assert [trace_names(results[i]) for i in (0, 1, 3)] == [["t0"], ["t1"], ["t3"]]


def test_window_requests_and_shared_trace_ids_are_never_mixed():
    detector = StandInDetector(delay_s=0.05)
    results = run_concurrently(detector, [(["a"], False), (["b"], False), (["b"], False), (["c", "d"], True)])

    assert [r.diagnosis.ranking is not None for r in results] == [False, False, False, True]
    assert [len(r.diagnosis.traces) for r in results] == [1, 1, 1, 2]
    assert detector.calls == [2, 1, 2]  # a+b together; the second b alone; the window alone


def test_payloads_that_do_not_parse_or_pass_the_span_limit_are_refused_with_their_status():
    detector = StandInDetector()
    too_many = Payload(to_otlp_proto_bytes(spans_of([tid("big")] * 101)), "application/x-protobuf")
    answers = diagnose_payloads(detector, [Payload(b"\x0a\xff", "application/x-protobuf"), too_many,
                                           Payload(b"{\"resourceSpans\": []}", "application/json"), payload_of(["ok"])], False, LIMITS)

    assert [(a.status, a.message.split(":")[0]) for a in answers[:3]] == [
        (400, "malformed trace payload"), (413, "101 spans is over the limit of 100 per request (BMEG_MAX_SPANS)"),
        (400, "the payload holds no spans")]
    assert trace_names(answers[3]) == ["ok"] and detector.calls == [1]


# -- assembly ----------------------------------------------------------------------------
ABSENT = "00000000000000ff"  # a parent span that never arrives


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_trace_spread_over_messages_finishes_once_idle_with_all_its_sources():
    clock = Clock()
    assembler = TraceAssembler(idle_timeout_s=2.0, max_spans=100, clock=clock)
    assert assembler.add(spans_of(["a", "b", "a"], parent=ABSENT), ("p0", 1)).traces == 2
    clock.now = 1.5
    assembler.add(spans_of(["a"], parent=ABSENT), ("p1", 7))
    clock.now = 2.5  # b idle for 2.5 s, a for 1 s

    (b,) = assembler.finished()
    assert (b.trace_id, b.spans, b.sources) == ("b", 1, {("p0", 1)})
    clock.now = 3.6
    (a,) = assembler.finished()
    assert (a.trace_id, a.table().num_rows, a.sources) == ("a", 3, {("p0", 1), ("p1", 7)})
    assert a.partial and b.partial  # their root never came
    assert len(assembler) == 0


def test_a_trace_at_the_span_cap_finishes_at_once():
    assembler = TraceAssembler(idle_timeout_s=60, max_spans=3, clock=Clock())
    assembler.add(spans_of(["big"] * 2 + ["small"], parent=ABSENT), ("p", 0))
    assert assembler.finished() == []
    assembler.add(spans_of(["big"], parent=ABSENT), ("p", 1))
    assert [t.trace_id for t in assembler.finished()] == ["big"]
    assert [t.trace_id for t in assembler.drain()] == ["small"]


def test_beyond_max_open_traces_the_least_recently_touched_finishes_early():
    clock = Clock()
    assembler = TraceAssembler(idle_timeout_s=60, clock=clock, max_open=2)
    assembler.add(spans_of(["a", "b"], parent=ABSENT), ("p", 0))
    assembler.add(spans_of(["a"], parent=ABSENT), ("p", 1))  # a touched last: b is the oldest
    assembler.add(spans_of(["c"], parent=ABSENT), ("p", 2))
    assert len(assembler) == 3 and assembler.evicted == 1
    (b,) = assembler.finished()  # long before the idle timeout
    assert (b.trace_id, b.partial) == ("b", True)
    assert sorted(t.trace_id for t in assembler.drain()) == ["a", "c"]
    with pytest.raises(ValueError, match="max_open"):
        TraceAssembler(max_open=0)


@given(st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=40))
def test_split_by_trace_keeps_every_span_once(trace_ids):
    pieces = split_by_trace(spans_of(trace_ids))
    assert sorted(trace_id for trace_id, _ in pieces) == sorted(set(trace_ids))
    assert all(set(piece["trace_id"].to_pylist()) == {trace_id} for trace_id, piece in pieces)
    assert sum(piece.num_rows for _, piece in pieces) == len(trace_ids)


# -- offsets -----------------------------------------------------------------------------
def test_the_commit_point_stops_at_the_lowest_message_with_a_trace_pending():
    tracker = OffsetTracker()
    first, second, third = (tracker.source("p", offset) for offset in range(3))
    tracker.received(first, 1)
    tracker.received(second, 2)
    tracker.received(third, 0)  # e.g. dead-lettered
    assert tracker.commit_points() == {"p": 0}
    tracker.release(second)
    tracker.release(first)
    assert tracker.commit_points() == {"p": 1}
    tracker.release(second)
    assert tracker.commit_points() == {"p": 3}
    tracker.forget(["p"])
    assert tracker.commit_points() == {}


def test_offsets_must_arrive_in_order():
    tracker = OffsetTracker()
    tracker.received(tracker.source("p", 5), 1)
    with pytest.raises(ValueError, match="out of order"):
        tracker.received(tracker.source("p", 5), 1)


def test_a_trace_of_a_revoked_assignment_does_not_release_the_message_read_again():
    tracker = OffsetTracker()
    before = tracker.source("p", 0)
    tracker.received(before, 1)  # its trace is being diagnosed when a rebalance takes "p" away
    polled_before = tracker.source("p", 1)
    tracker.forget(["p"])
    tracker.received(polled_before, 1)  # polled before the rebalance: not tracked any more
    assert tracker.commit_points() == {}
    again = tracker.source("p", 0)  # "p" comes back: the message is read again
    tracker.received(again, 1)
    tracker.release(before)  # the old trace is published: a no-op now
    assert tracker.commit_points() == {"p": 0}
    tracker.release(again)
    assert tracker.commit_points() == {"p": 1}


def test_a_message_read_again_after_a_rebalance_is_known_as_read_before():
    tracker = OffsetTracker()
    assert not tracker.received(tracker.source("p", 0), 1, last_offset=3)  # offsets 0-3 read as one
    assert not tracker.received(tracker.source("p", 4), 1)
    tracker.forget(["p"])  # taken away before a commit; the new owner resumes from offset 2
    assert tracker.received(tracker.source("p", 2), 1)
    assert tracker.received(tracker.source("p", 4), 0)
    assert not tracker.received(tracker.source("p", 5), 1)  # new
    assert not tracker.received(tracker.source("q", 2), 1)  # another partition's offsets are its own


@settings(max_examples=100, deadline=None)  # an example took 251 ms on the loaded 2-core machine
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
        action = data.draw(st.sampled_from(["receive", "receive", "publish", "rebalance"]))
        partition = data.draw(st.sampled_from(["p0", "p1"]))
        if action == "receive" or not len(assembler) and not pending:
            source = tracker.source(partition, next_offset[partition])
            next_offset[partition] += 1
            traces = data.draw(st.lists(st.sampled_from("abcdef"), min_size=0, max_size=4))
            tracker.received(source, assembler.add(spans_of(traces, parent=ABSENT), source).traces if traces else 0)
        elif action == "publish":
            clock.now += 1
            pending += assembler.finished()
            if pending:
                done = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
                for source in done.sources:
                    tracker.release(source)
        else:  # taken away and given back: read again from the furthest point it could have committed
            next_offset[partition] = tracker.commit_points().get(partition, next_offset[partition])
            tracker.forget([partition])
        points = tracker.commit_points()
        for trace in [*pending, *assembler]:
            for source in trace.sources:
                if source.assignment == tracker.source(source.partition, 0).assignment:
                    assert points[source.partition] <= source.offset


def test_traces_assembled_from_revoked_partitions_alone_are_dropped():
    tracker = OffsetTracker()
    assembler = TraceAssembler(idle_timeout_s=60, max_spans=10_000)
    from_p0, from_p1 = tracker.source("p0", 0), tracker.source("p1", 0)
    assembler.add(spans_of(["a", "b"]), from_p0)
    assembler.add(spans_of(["b", "c"]), from_p1)
    tracker.forget(["p0"])
    dropped = assembler.discard(lambda trace: not any(map(tracker.is_current, trace.sources)))
    assert dropped == 1
    assert sorted(trace.trace_id for trace in assembler) == ["b", "c"]  # "b" also has spans from p1
