"""Stage 1's simple per-trace signs (`bmeg.models.signs`): read from the relative features,
calibrated beside the model on the same healthy traces, within one shared false-alarm budget."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bmeg.graphs import assemble
from bmeg.models.signs import SIGNS, sign_key, trace_signs
from bmeg.traces import span_table
from bmeg.training.calibration import calibrate_on_healthy, flagged_share
from builders import many_traces, tiny_detector


def _traces(n: int, slow: int | None = None, error: int | None = None, short: int | None = None):
    """`many_traces`, with the `error` trace's second call failing and the `short` trace's last call left out."""
    spans = many_traces(n, slow)
    spans["status"] = ["ok"] * len(spans["trace_id"])
    if error is not None:
        spans["status"][spans["span_id"].index(f"t{error:04d}-c1")] = "error"
    if short is not None:
        drop = spans["span_id"].index(f"t{short:04d}-c2")
        spans = {key: values[:drop] + values[drop + 1:] for key, values in spans.items()}
    return assemble(span_table(spans))


def test_each_sign_reads_the_trace_it_is_about():
    detector = tiny_detector("relative-siblings")
    forest = _traces(30, slow=27, error=28, short=29)
    signs = trace_signs(forest, detector.encoder.transform(forest), detector.encoder.names)
    assert set(signs) == set(SIGNS) and all(len(values) == forest.num_traces for values in signs.values())
    row = {trace: forest.trace_ids.index(f"t{trace:04d}") for trace in (27, 28, 29)}
    assert signs["end_to_end"].argmax() == row[27] and signs["end_to_end"][row[27]] > 10
    assert np.flatnonzero(signs["error"] > 0).tolist() == [row[28]]
    assert np.flatnonzero(signs["call_pattern"] > 0).tolist() == [row[29]]
    full = tiny_detector("full")  # no baselines of duration, call pattern or error origin: no signs
    assert trace_signs(forest, full.encoder.transform(forest), full.encoder.names) == {}


def test_calibrated_signs_flag_what_the_model_misses_within_the_shared_budget(tmp_path):
    from bmeg.models.detector import Detector

    tiny = tiny_detector("relative-siblings")
    model_blind = replace(tiny, thresholds={**tiny.thresholds, "graph": 1.1})  # the DGCNN flags nothing
    healthy = _traces(400)
    calibrated, calibration = calibrate_on_healthy(model_blind, healthy, rate=0.04, confidence=None, signs=True)
    assert {sign_key(name) for name in SIGNS} <= set(calibrated.thresholds)
    assert calibration.per_threshold_rate == pytest.approx(0.01) and calibration.flagged_after <= 0.04
    assert flagged_share(calibrated, healthy) <= 0.04

    faulty = _traces(30, slow=27, error=28, short=29)
    diagnosis = calibrated.diagnose(faulty)
    flagged = {trace.trace_id: trace.signs for trace in diagnosis.traces if trace.anomalous}
    assert flagged == {"t0027": ["end_to_end"], "t0028": ["error"], "t0029": ["call_pattern"]}
    assert not model_blind.diagnose(faulty).traces[0].signs  # no sign threshold: no sign applied
    # the raw scores of a detector without sign thresholds carry the signs, so a calibrated detector's
    # route reads them (bench/healthy.py scores once and routes under each calibration)
    rerouted = calibrated.route(model_blind.score(faulty)).anomalous
    assert np.flatnonzero(rerouted).tolist() == [27, 28, 29]
    assert sum(trace.anomalous for trace in model_blind.diagnose(faulty).traces) == 0
    # calibrated again without signs: the signs' thresholds go, the model's stay
    again, _ = calibrate_on_healthy(calibrated, healthy, rate=0.04, confidence=None)
    assert not any(key.startswith("sign:") for key in again.thresholds) and again.thresholds["graph"] == 1.1
    # the checkpoint keeps them
    loaded = Detector.load(replace(calibrated, metrics={"calibration": calibration.to_dict()}).save(tmp_path).run_dir)
    assert loaded.thresholds == calibrated.thresholds
    with pytest.raises(ValueError, match="no signs"):
        calibrate_on_healthy(tiny_detector("full"), healthy, rate=0.04, signs=True)
