"""Stage 1 calibrated on the application's own healthy traffic.

A detector trained on synthetic traces (a twin) chooses its stage-1 threshold for precision on
*synthetic* validation traces; on the real application the healthy traces score differently,
and a threshold that flags 1% of synthetic normal traces can flag 10-40% of real ones. So, for
a target false-alarm rate α, each stage-1 threshold (the DGCNN's and the SVM's, each on the
traces the router sends it) is raised, in a new detector, to the (1 - α) quantile of the scores of held-back
real healthy traces, where it is below that: the synthetic operating point is kept where it
already meets the target, so recall is lost only where it must be.

`split_by_time` cuts a normal period into the part the twin and the baselines are fitted
from and the later part held back for calibration (later, not random: the calibration traces
then come from minutes the model has not seen, as the live traffic will).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.graphs import SpanForest

#: The share of healthy traces stage 1 may flag.
DEFAULT_FALSE_ALARM_RATE = 0.01


def split_by_time(spans: pa.Table, held_back: float) -> tuple[pa.Table, pa.Table]:
    """(earlier, later) spans: the later part holds the `held_back` share of the traces by start
    time (ties in trace-id order), at least one trace in each part."""
    if not 0.0 < held_back < 1.0:
        raise ValueError(f"held_back must be between 0 and 1, not {held_back}")
    first = spans.group_by("trace_id").aggregate([("start_ns", "min")])
    starts = first["start_ns_min"].to_numpy()
    if len(starts) < 2:
        raise ValueError(f"{len(starts)} trace(s) cannot be split into a fitting and a held-back part")
    count = min(max(round(len(starts) * held_back), 1), len(starts) - 1)
    ids = first["trace_id"].to_numpy(zero_copy_only=False)
    later = pa.array(ids[np.lexsort((ids, starts))[len(starts) - count:]])
    is_later = pc.is_in(spans["trace_id"], later)
    return spans.filter(pc.invert(is_later)), spans.filter(is_later)


@dataclass(frozen=True)
class Calibration:
    rate: float  # target false-alarm rate
    traces: int  # held-back healthy traces
    before: dict[str, float]  # thresholds before
    after: dict[str, float]
    flagged_before: float  # share of the held-back traces flagged before
    flagged_after: float

    def to_dict(self) -> dict:
        return {"target_false_alarm_rate": self.rate, "healthy_traces": self.traces, "thresholds_before": self.before,
                "thresholds_after": self.after, "flagged_before": self.flagged_before,
                "flagged_after": self.flagged_after}


def calibrate_on_healthy(detector, healthy: SpanForest, rate: float = DEFAULT_FALSE_ALARM_RATE):
    """(the detector with its stage-1 thresholds raised so that at most about `rate` of the
    `healthy` traces are flagged, what changed). The detector given is left as it was: a
    `Detector` is immutable (a served model may be read by another thread meanwhile)."""
    if not 0.0 < rate < 1.0:
        raise ValueError(f"the false-alarm rate must be between 0 and 1, not {rate}")
    if healthy.num_traces == 0:
        raise ValueError("no healthy traces to calibrate stage 1 on")
    scores = detector.score(healthy, all_models=True)
    before = dict(detector.thresholds)
    after = dict(before)
    for key, to_model in (("graph", ~scores.to_svm), ("svm", scores.to_svm)):
        if to_model.any():
            quantile = float(np.quantile(scores.anomaly[to_model], 1.0 - rate, method="higher"))
            # strictly above the quantile's score: `anomalous` is score >= threshold
            after[key] = max(before[key], float(np.nextafter(quantile, np.inf)))
    calibrated = replace(detector, thresholds=after)
    flagged_after = float(calibrated.route(scores).anomalous.mean())
    calibration = Calibration(rate, healthy.num_traces, before, dict(after), float(scores.anomalous.mean()),
                              flagged_after)
    return calibrated, calibration


def flagged_share(detector, healthy: SpanForest) -> float:
    """The share of `healthy` traces stage 1 flags anomalous."""
    return float(detector.score(healthy).anomalous.mean()) if healthy.num_traces else float("nan")
