"""bmeg's window ranking with concurrent faults (issue 12, session 17): a caller that stops calling
after a callee's exception is not a structure change of its own, so it does not take the first place
from another fault in the same window."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.graphs.rpc import rpc_view
from bmeg.models.normal import NormalStats
from bmeg.models.window import combined_ranking, gnn_window_scores, structure_significant, with_normal_baselines
from bmeg.traces import span_table
from builders import tiny_detector

EPOCH = 1_700_000_000 * 10**9
#: `front`'s callees in the order it calls them: `svc2` first, `svc0` next, the rest only after it.
CALLEES = ["svc2", "svc0", "svc1", "svc3", "svc4", "svc5"]


def _front_calling(n: int, failed: set[int] = frozenset(), returned: set[int] = frozenset(),
                   svc2_gap_us: int = 200):
    """`n` traces: `front` calls each of `CALLEES` (a client span and the callee's server span, 1 ms
    of server time). In trace i of `failed`, `svc0` raises (an error in its span and in front's call
    of it) and front makes no further call; in trace i of `returned`, front returns after `svc0` with
    no error (an early return of its own). `svc2_gap_us`: the gap of front's call of svc2."""
    rows: dict[str, list] = {name: [] for name in ("trace_id", "span_id", "parent_id", "service", "operation",
                                                   "start_ns", "duration_ns", "status")}

    def span(trace, span_id, parent, service, operation, start, duration_us, status="ok"):
        for name, value in zip(rows, (trace, span_id, parent, service, operation, start, duration_us * 1000, status)):
            rows[name].append(value)

    for i in range(n):
        start, trace = EPOCH + i * 50_000_000, f"t{i}"
        stops = i in failed or i in returned
        span(trace, "f", None, "front", "GET /", start, 40_000, "error" if i in failed else "ok")
        for k, callee in enumerate(CALLEES[:2] if stops else CALLEES):
            gap = (svc2_gap_us if callee == "svc2" else 200) + i % 5
            status = "error" if i in failed and callee == "svc0" else "ok"
            offset = start + (100 + k * 5_000) * 1000
            span(trace, f"c{k}", "f", "front", f"call {callee}", offset, 1_000 + gap, status)
            span(trace, f"s{k}", f"c{k}", callee, "op", offset + gap // 2 * 1000, 1_000, status)
    return rpc_view(span_table(rows))


@settings(max_examples=20, deadline=None)
@given(stopped=st.integers(10, 40))
def test_a_caller_that_stops_after_a_failed_call_is_not_odd_and_one_that_returns_early_is(stopped):
    normal = NormalStats.from_forest(_front_calling(300))
    failing = normal.structure_tests(_front_calling(100, failed=set(range(stopped))))
    assert failing.loc["front", "p"] == 1.0 and not structure_significant(failing)["front"]
    assert structure_significant(failing)["svc0"]  # where the error began
    returning = normal.structure_tests(_front_calling(100, returned=set(range(stopped))))
    assert returning.loc["front", "p"] < 1e-9 and structure_significant(returning)["front"]


@pytest.fixture(scope="module")
def concurrent():
    """A window with two faults at once: svc0 raises in a fifth of the requests (front then stops
    calling) and front's calls of svc2 are 16x slower (a network delay), and its normal period."""
    normal = _front_calling(300)
    window = _front_calling(100, failed=set(range(0, 100, 5)), svc2_gap_us=3_200)
    detector = with_normal_baselines(tiny_detector(), normal)
    return NormalStats.from_forest(normal), window, gnn_window_scores(detector, window), gnn_window_scores(detector, normal)


def test_the_caller_of_an_excepting_service_no_longer_comes_before_a_concurrent_delay(concurrent):
    """Before, the test of counts put front (fewer calls than ever in a fifth of its requests)
    beside svc0 ahead of everything: with svc0's fault taken out of the ranking, front was first
    and the delayed svc2 second. Now the exception's service comes first and then the delay."""
    stats, window, window_scores, normal_scores = concurrent
    ranking = [service for service, _ in combined_ranking(stats, window, window_scores, normal_scores)]
    assert ranking[:2] == ["svc0", "svc2"]
