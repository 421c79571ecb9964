"""Stage 1 calibrated on the application's own healthy traffic.

A detector trained on synthetic traces (a twin) chooses its stage-1 threshold for precision on
*synthetic* validation traces; on the real application the healthy traces score differently,
and a threshold that flags 1% of synthetic normal traces can flag 10-40% of real ones. So, for
a target false-alarm rate α, each stage-1 threshold (the DGCNN's and the SVM's, each on the
traces the router sends it) is raised, in a new detector, until few enough of the held-back
real healthy traces score above it, where it is below that: the synthetic operating point is
kept where it already meets the target, so recall is lost only where it must be.

How few: with `confidence` c (default 0.95), at most j of the n held-back traces may stay
above the threshold, j the largest count for which the one-sided Clopper-Pearson bound of the
false-alarm rate is still at most α (equivalently: Binomial(n, α) gives j or fewer with
probability at most 1 - c). The plain (1 - α) quantile lets about α·n through, so fresh healthy
traffic is flagged above α about half the time (measured on the testbed: docs/issue-12.md);
with n = 488 and α = 1% the bound allows 1 where the quantile allowed 4. Where n is too small
for any (n < 299 at α = 1%), the threshold goes above every held-back score and the
calibration says the target is not guaranteed (`bound_met`). `confidence=None` is the plain
quantile.

With `signs`, the simple per-trace signs (`bmeg.models.signs`) get thresholds too, set the same
way on the same traces, and the false-alarm budget is shared: each of the k thresholds (the
model's and the signs') at α / k, so that a trace flagged by any of them stays within α.

`split_by_time` cuts a normal period into the part the twin and the baselines are fitted
from and the later part held back for calibration (later, not random: the calibration traces
then come from minutes the model has not seen, as the live traffic will).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from scipy.special import gammaln

from bmeg.graphs import SpanForest
from bmeg.models.signs import sign_key
from bmeg.traces.schema import trace_starts

#: The share of healthy traces stage 1 may flag.
DEFAULT_FALSE_ALARM_RATE = 0.01
#: A sign's threshold's key starts so (`bmeg.models.signs.sign_key`): calibrated again from scratch.
SIGN_PREFIX = sign_key("")
#: How sure the calibration must be that fresh healthy traffic is flagged at most that often.
DEFAULT_CONFIDENCE = 0.95


def split_by_time(spans: pa.Table, held_back: float) -> tuple[pa.Table, pa.Table]:
    """(earlier, later) spans: the later part holds the `held_back` share of the traces by start
    time (ties in trace-id order), at least one trace in each part."""
    if not 0.0 < held_back < 1.0:
        raise ValueError(f"held_back must be between 0 and 1, not {held_back}")
    first = trace_starts(spans)
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
    per_threshold_rate: float  # each threshold's share of `rate` (its model's and its signs')
    confidence: float | None = DEFAULT_CONFIDENCE  # None: the plain quantile
    bound_met: bool = True  # the held-back traces were enough to bound the rate at `confidence`

    def to_dict(self) -> dict:
        return {"target_false_alarm_rate": self.rate, "healthy_traces": self.traces, "thresholds_before": self.before,
                "thresholds_after": self.after, "flagged_before": self.flagged_before,
                "flagged_after": self.flagged_after, "confidence": self.confidence, "bound_met": self.bound_met,
                "per_threshold_rate": self.per_threshold_rate}


def allowed_exceedances(n: int, rate: float, confidence: float) -> int | None:
    """The most of `n` healthy traces that may score above the threshold while the one-sided
    Clopper-Pearson bound (at `confidence`) of the false-alarm rate stays at most `rate`:
    the largest j with P(Binomial(n, rate) <= j) <= 1 - confidence; None when not even 0 is."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"the confidence must be between 0 and 1, not {confidence}")
    j = np.arange(n + 1)
    log_pmf = (gammaln(n + 1) - gammaln(j + 1) - gammaln(n - j + 1)
               + j * np.log(rate) + (n - j) * np.log1p(-rate))
    cdf = np.cumsum(np.exp(log_pmf))
    fine = np.flatnonzero(cdf <= 1.0 - confidence)
    return int(fine[-1]) if len(fine) else None


def _threshold(scores: np.ndarray, rate: float, confidence: float | None) -> tuple[float, bool]:
    """(the lowest threshold the rule allows for these healthy scores, whether the bound holds)."""
    if confidence is None:
        above = float(np.quantile(scores, 1.0 - rate, method="higher"))
        bound_met = True
    else:
        allowed = allowed_exceedances(len(scores), rate, confidence)
        ordered = np.sort(scores)[::-1]
        above, bound_met = (float(ordered[0]), False) if allowed is None else (float(ordered[allowed]), True)
    # strictly above that score: `anomalous` is score >= threshold
    return float(np.nextafter(above, np.inf)), bound_met


def calibrate_on_healthy(detector, healthy: SpanForest, rate: float = DEFAULT_FALSE_ALARM_RATE,
                         confidence: float | None = DEFAULT_CONFIDENCE, signs: bool = False):
    """(the detector with its stage-1 thresholds raised so that fresh healthy traffic like
    `healthy` is flagged at most `rate` of the time, at `confidence`; what changed); with `signs`,
    also a threshold per sign, each of the model's and the signs' at `rate` over their number. The
    detector given is left as it was: a `Detector` is immutable (a served model may be read by
    another thread meanwhile)."""
    if not 0.0 < rate < 1.0:
        raise ValueError(f"the false-alarm rate must be between 0 and 1, not {rate}")
    if healthy.num_traces == 0:
        raise ValueError("no healthy traces to calibrate stage 1 on")
    scores = detector.score(healthy, all_models=True)
    before = {key: value for key, value in detector.thresholds.items() if not key.startswith(SIGN_PREFIX)}
    after = dict(before)
    bound_met = True
    read = scores.signs if signs else {}
    if signs and not read:
        raise ValueError(f"the {detector.encoder.variant!r} features have no signs to calibrate (`bmeg.models.signs`)")
    share = rate / (1 + len(read))
    for key, to_model in (("graph", ~scores.to_svm), ("svm", scores.to_svm)):
        if to_model.any():
            threshold, met = _threshold(scores.anomaly[to_model], share, confidence)
            after[key] = max(before[key], threshold)
            bound_met &= met
    for name, values in read.items():
        after[sign_key(name)], met = _threshold(values, share, confidence)
        bound_met &= met
    calibrated = replace(detector, thresholds=after)
    flagged_after = float(calibrated.route(scores).anomalous.mean())
    calibration = Calibration(rate, healthy.num_traces, before, dict(after), float(scores.anomalous.mean()),
                              flagged_after, share, confidence, bound_met)
    return calibrated, calibration


def flagged_share(detector, healthy: SpanForest) -> float:
    """The share of `healthy` traces stage 1 flags anomalous."""
    return float(detector.score(healthy).anomalous.mean()) if healthy.num_traces else float("nan")
