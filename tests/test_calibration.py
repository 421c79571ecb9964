"""Stage 1 calibrated on held-back healthy traces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.graphs import assemble
from bmeg.traces import span_table
from bmeg.traces.schema import empty_span_table
from bmeg.training.calibration import calibrate_on_healthy, flagged_share, split_by_time
from tests.test_models import _tiny_detector, many_traces


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

    tiny = _tiny_detector()
    healthy = assemble(span_table(many_traces(200)))
    # an operating point that flags every healthy trace
    detector = replace(tiny, thresholds={**tiny.thresholds, "graph": 0.0})
    assert flagged_share(detector, healthy) == 1.0
    calibrated, calibration = calibrate_on_healthy(detector, healthy, rate=0.05)
    assert calibration.flagged_before == 1.0 and calibration.flagged_after <= 0.05
    assert flagged_share(calibrated, healthy) == calibration.flagged_after
    assert calibrated.thresholds["graph"] > 0.0 and calibrated.thresholds["svm"] == 0.5  # no trace went to the SVM
    assert calibration.after == calibrated.thresholds
    # the detector given is left as it was: a new one carries the new thresholds
    assert detector.thresholds["graph"] == 0.0 and flagged_share(detector, healthy) == 1.0
    # a threshold that already meets the target is kept
    again, kept = calibrate_on_healthy(calibrated, healthy, rate=0.05)
    assert kept.after == calibrated.thresholds == again.thresholds
    with pytest.raises(ValueError, match="between 0 and 1"):
        calibrate_on_healthy(detector, healthy, rate=0.0)
    assert np.isnan(flagged_share(detector, assemble(empty_span_table())))
