"""Stage 1 calibrated on held-back healthy traces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.graphs import assemble
from bmeg.traces import span_table
from bmeg.traces.schema import empty_span_table
from bmeg.training.calibration import allowed_exceedances, calibrate_on_healthy, flagged_share, split_by_time
from builders import many_traces, tiny_detector


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 40), held_back=st.floats(0.05, 0.95))
def test_split_by_time_holds_back_the_latest_traces_whole(n, held_back):
    spans = span_table(many_traces(n))
    earlier, later = split_by_time(spans, held_back)
    assert earlier.num_rows + later.num_rows == spans.num_rows
    before, after = set(earlier["trace_id"].to_pylist()), set(later["trace_id"].to_pylist())
    assert not before & after and len(after) == min(max(round(n * held_back), 1), n - 1)
    # every held-back trace starts no earlier than every fitting trace
    assert later.group_by("trace_id").aggregate([("start_ns", "min")])["start_ns_min"].to_numpy().min() >= \
        earlier.group_by("trace_id").aggregate([("start_ns", "min")])["start_ns_min"].to_numpy().max()


def test_split_by_time_rejects_what_it_cannot_split():
    with pytest.raises(ValueError, match="between 0 and 1"):
        split_by_time(span_table(many_traces(5)), 1.0)
    with pytest.raises(ValueError, match="cannot be split"):
        split_by_time(span_table(many_traces(1)), 0.5)


def test_calibration_brings_false_alarms_to_the_target_and_only_raises_thresholds():
    from dataclasses import replace

    tiny = tiny_detector()
    healthy = assemble(span_table(many_traces(200)))
    # an operating point that flags every healthy trace
    detector = replace(tiny, thresholds={**tiny.thresholds, "graph": 0.0})
    assert flagged_share(detector, healthy) == 1.0
    calibrated, calibration = calibrate_on_healthy(detector, healthy, rate=0.05, confidence=None)
    assert calibration.flagged_before == 1.0 and calibration.flagged_after <= 0.05
    assert flagged_share(calibrated, healthy) == calibration.flagged_after
    assert calibrated.thresholds["graph"] > 0.0 and calibrated.thresholds["svm"] == 0.5  # no trace went to the SVM
    assert calibration.after == calibrated.thresholds
    # the detector given is left as it was: a new one carries the new thresholds
    assert detector.thresholds["graph"] == 0.0 and flagged_share(detector, healthy) == 1.0
    # a threshold that already meets the target is kept
    again, kept = calibrate_on_healthy(calibrated, healthy, rate=0.05, confidence=None)
    assert kept.after == calibrated.thresholds == again.thresholds
    with pytest.raises(ValueError, match="between 0 and 1"):
        calibrate_on_healthy(detector, healthy, rate=0.0)
    assert np.isnan(flagged_share(detector, assemble(empty_span_table())))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), rate=st.floats(0.001, 0.2), confidence=st.floats(0.5, 0.999))
def test_allowed_exceedances_is_the_clopper_pearson_count(n, rate, confidence):
    from scipy.stats import binom

    allowed = allowed_exceedances(n, rate, confidence)
    if allowed is None:
        assert binom.cdf(0, n, rate) > 1 - confidence - 1e-9
    else:
        assert binom.cdf(allowed, n, rate) <= 1 - confidence + 1e-9
        assert allowed == n or binom.cdf(allowed + 1, n, rate) > 1 - confidence - 1e-9


def test_the_bound_lets_fewer_healthy_traces_through_than_the_quantile_and_says_when_it_cannot():
    from dataclasses import replace

    tiny = tiny_detector()
    detector = replace(tiny, thresholds={**tiny.thresholds, "graph": 0.0})
    healthy = assemble(span_table(many_traces(400)))
    _, quantile = calibrate_on_healthy(detector, healthy, rate=0.05, confidence=None)
    bounded, bound = calibrate_on_healthy(detector, healthy, rate=0.05, confidence=0.95)
    assert bound.bound_met and bound.confidence == 0.95
    assert bound.flagged_after * 400 <= allowed_exceedances(400, 0.05, 0.95) < 0.05 * 400
    assert bounded.thresholds["graph"] >= quantile.after["graph"]
    # 40 traces cannot bound a 5% rate at 95% (0.95 ** 40 > 0.05): nothing held back stays flagged
    few = assemble(span_table(many_traces(40)))
    _, none = calibrate_on_healthy(detector, few, rate=0.05, confidence=0.95)
    assert not none.bound_met and none.flagged_after == 0.0
    with pytest.raises(ValueError, match="confidence"):
        calibrate_on_healthy(detector, few, rate=0.05, confidence=1.0)
