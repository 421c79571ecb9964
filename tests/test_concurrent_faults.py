"""bmeg's window ranking with concurrent faults (issue 12, session 17): a caller that stops calling
after a callee's exception is not a structure change of its own, so it does not take the first place
from another fault in the same window."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.models.normal import NormalStats
from bmeg.models.window import combined_ranking, gnn_window_scores, structure_significant, with_normal_baselines
from builders import front_calling, tiny_detector


@settings(max_examples=20, deadline=None)
@given(stopped=st.integers(10, 40))
def test_a_caller_that_stops_after_a_failed_call_is_not_odd_and_one_that_returns_early_is(stopped):
    normal = NormalStats.from_forest(front_calling(300))
    failing = normal.structure_tests(front_calling(100, failed=set(range(stopped))))
    assert failing.loc["front", "p"] == 1.0 and not structure_significant(failing)["front"]
    assert structure_significant(failing)["svc0"]  # where the error began
    returning = normal.structure_tests(front_calling(100, returned=set(range(stopped))))
    assert returning.loc["front", "p"] < 1e-9 and structure_significant(returning)["front"]


@pytest.fixture(scope="module")
def concurrent():
    """A window with two faults at once: svc0 raises in a fifth of the requests (front then stops
    calling) and front's calls of svc2 are 16x slower (a network delay), and its normal period."""
    normal = front_calling(300)
    window = front_calling(100, failed=set(range(0, 100, 5)), svc2_gap_us=3_200)
    detector = with_normal_baselines(tiny_detector(), normal)
    return NormalStats.from_forest(normal), window, gnn_window_scores(detector, window), gnn_window_scores(detector, normal)


def test_the_caller_of_an_excepting_service_no_longer_comes_before_a_concurrent_delay(concurrent):
    """Before, the test of counts put front (fewer calls than ever in a fifth of its requests)
    beside svc0 ahead of everything: with svc0's fault taken out of the ranking, front was first
    and the delayed svc2 second. Now the two faults come first: the decisive call gap (svc2's 16x
    slower calls) and then the exception's service (session 41: the decisive gap before the gates)."""
    stats, window, window_scores, normal_scores = concurrent
    ranking = [service for service, _ in combined_ranking(stats, window, window_scores, normal_scores)]
    assert ranking[:2] == ["svc2", "svc0"]
