"""Simple per-trace signs that stage 1 reads beside its model (issue 12, session 40).

On real traces a bootstrapped DGCNN separates faulty traces from healthy ones poorly: a healthy
trace with one node's self time spiking (a scheduling hiccup, a store's slow answer) scores as
high as a trace under a CPU fault, so a threshold that flags 1% of healthy traces keeps few of
the faulty ones (docs/issue-12.md, session 40: 8% of the shop's labelled faulty traces, none of
its CPU faults'). Three signs that mean the same in every application, read from the model's own
node features (`bmeg.models.features`, the `relative` variants), each a number per trace:

- `end_to_end`: the root span's duration, as a robust z-score against its operation's normal
  (a fault on the request's path makes the whole request slower, a hiccup in one call rarely does);
- `call_pattern`: the largest change of any node's child count from its operation's normal
  (a call left out or added: a code fault that returns early, a retry);
- `error`: whether an error begins in the trace (a span in error with no child in error).

Each is calibrated like the model's threshold, on the application's held-back healthy traces
(`bmeg.training.calibration`); a trace is flagged when its model or any sign is above its threshold.
A detector whose thresholds have no sign (a model trained on labels, one bootstrapped without
`--signs`, one saved before) reads none. Not the default: on two fresh recordings (session 40) the
signs raised stage 1's recall on the labelled faulty traces from 0.41 to 0.63 (Go testbed) and from
0.35 to 0.72 (the shop), within 1% on the shop's healthy traffic at rest and with a core busy, but
flagged 1.35% of the testbed's traffic between its faults (the rule written before asked for at
most 1%); judged again on two more (session 41) they doubled recall again (0.37 -> 0.67, 0.28 -> 0.66)
but flagged 2.67% of the shop's traffic between faults under load, at precision 0.83.
`bench/healthy.py` scores them beside stage 1 on every run.
"""

from __future__ import annotations

import numpy as np

from bmeg.graphs import SpanForest

#: name: (the node feature it reads, how a trace reads it: its root's value, or its largest |value| or value)
SIGNS: dict[str, tuple[str, str]] = {
    "end_to_end": ("z_log_duration_us", "root"),
    "call_pattern": ("children_delta", "max abs"),
    "error": ("error_origin", "max"),
}


def sign_key(name: str) -> str:
    """The sign's threshold's key among a detector's thresholds."""
    return f"sign:{name}"


def trace_signs(forest: SpanForest, x: np.ndarray, feature_names: list[str]) -> dict[str, np.ndarray]:
    """Each sign per trace of `forest` (float64 [T]) from its node features `x` (columns
    `feature_names`); {} when the features lack them (the `thesis` and `full` variants)."""
    if any(feature not in feature_names for feature, _ in SIGNS.values()):
        return {}
    signs = {}
    for name, (feature, read) in SIGNS.items():
        column = x[:, feature_names.index(feature)].astype(np.float64)
        if read == "root":
            column = np.where(forest.parent < 0, column, -np.inf)
        elif read == "max abs":
            column = np.abs(column)
        # a trace's spans are one run of rows (`SpanForest.trace_offsets`): one reduction, cheap on the served path
        signs[name] = (np.maximum.reduceat(column, forest.trace_offsets[:-1]) if forest.num_traces
                       else np.empty(0))
    return signs


def signs_above(signs: dict[str, np.ndarray], thresholds: dict[str, float], traces: int) -> dict[str, np.ndarray]:
    """Per sign with a threshold: bool [T], the sign at or above it (as a model's score is)."""
    return {name: values >= thresholds[sign_key(name)] for name, values in signs.items()
            if sign_key(name) in thresholds and len(values) == traces}
