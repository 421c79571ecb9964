"""Labels of real testbed traces: calibrated on fault-free traces, a node is a bottleneck only
when its service was under a fault when it ran and the fault shows."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.faultinject.testbed.labels import AppliedFault, calibrate, label, node_frame
from bmeg.traces.schema import span_table

MS = 1_000_000


def _trace(number: int, start: int, text_ms: float, gap_ms: float = 0.2, db_ms: float = 1.0) -> dict[str, list]:
    """nginx -> (client) -> text-service server -> postgres client span."""
    tid = f"{number:032x}"
    ids = [f"{number:012x}{i:04x}" for i in range(4)]
    text = int(text_ms * MS)
    gap = int(gap_ms * MS)
    db = int(db_ms * MS)
    return {
        "trace_id": [tid] * 4, "span_id": ids, "parent_id": [None, ids[0], ids[1], ids[2]],
        "service": ["nginx-web-server", "nginx-web-server", "text-service", "text-service"],
        "operation": ["/compose", "POST text", "compose_text", "INSERT urls"],
        "start_ns": [start, start + MS // 10, start + MS // 10 + gap // 2, start + MS // 10 + gap // 2 + MS // 10],
        "duration_ns": [text + gap + MS // 5, text + gap, text, db],
        "kind": ["server", "client", "server", "client"],
        "status": ["unset"] * 4, "peer_service": [None] * 4, "db_system": [None, None, None, "postgresql"],
        "instance": ["a"] * 4,
    }


def _table(traces: list[dict]):
    columns = {key: sum((t[key] for t in traces), []) for key in traces[0]}
    return span_table(columns)


def _normal(count: int, rng) -> list[dict]:
    return [_trace(i, i * 10 * MS, float(rng.uniform(2, 3))) for i in range(count)]


def test_slow_node_under_a_fault_is_the_bottleneck_and_propagation_is_not():
    rng = np.random.default_rng(0)
    normal = _normal(100, rng)
    t0 = 100 * 10 * MS
    slow_in_fault = _trace(1000, t0 + MS, 20.0)
    fast_in_fault = _trace(1001, t0 + 2 * MS, 2.5)
    slow_outside = _trace(1002, t0 + 200 * MS, 20.0)
    delayed_edge = _trace(1003, t0 + 3 * MS, 2.5, gap_ms=40.0)  # a proxy delay into text-service
    frame = node_frame(_table(normal + [slow_in_fault, fast_in_fault, slow_outside, delayed_edge]))
    calibration = calibrate(frame, frame.start_ns < t0)
    fault = AppliedFault(0, "text-service", "interference", "single", t0, t0 + 100 * MS, {"factor": 4})
    labels = label(frame, [fault], calibration)
    ids = frame.forest.trace_ids
    anomalous = {ids[i] for i in np.flatnonzero(labels.trace_anomalous)}
    assert anomalous == {f"{1000:032x}", f"{1003:032x}"}
    assert {ids[i] for i in np.flatnonzero(labels.trace_exposed)} == {f"{n:032x}" for n in (1000, 1001, 1003)}
    bottleneck_services = set(frame.node_service[labels.span_bottleneck].tolist())
    assert bottleneck_services == {"text-service"}  # nginx's slower spans are propagation
    assert labels.trace_faults[ids.index(f"{1000:032x}")] == (0,)


def test_a_sources_aftermath_exposes_the_nodes_just_after_its_end_and_no_later():
    rng = np.random.default_rng(1)
    normal = _normal(100, rng)
    t0 = 100 * 10 * MS
    fault = AppliedFault(0, "text-service", "interference", "single", t0, t0 + 100 * MS, {"factor": 4})
    draining = _trace(1000, t0 + 150 * MS, 20.0)  # 50 ms after the end: within a 0.1-s aftermath
    later = _trace(1001, t0 + 300 * MS, 20.0)
    frame = node_frame(_table(normal + [draining, later]))
    calibration = calibrate(frame, frame.start_ns < t0)
    ids = frame.forest.trace_ids
    for aftermath, expected in [(None, set()), ({"network": 1.0}, set()), ({"interference": 0.1}, {f"{1000:032x}"})]:
        labels = label(frame, [fault], calibration, aftermath)
        assert {ids[i] for i in np.flatnonzero(labels.trace_anomalous)} == expected


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=0, max_value=5))
def test_no_fault_no_label(extra):
    rng = np.random.default_rng(extra)
    traces = _normal(40 + extra, rng)
    frame = node_frame(_table(traces))
    calibration = calibrate(frame, np.ones(len(frame.key), dtype=bool))
    labels = label(frame, [], calibration)
    assert not labels.trace_anomalous.any() and not labels.span_bottleneck.any() and not labels.trace_exposed.any()


def test_a_stricter_quantile_labels_a_subset_and_the_recording_keeps_the_campaigns_traces():
    """`label_recording` (what a campaign writes, and `bench/label_noise.py relabel`): bounds at a
    higher quantile label no trace the default ones do not, and the tables hold only the traces
    begun after the calibration period, a node row per node."""
    from bmeg.faultinject.testbed.campaign import label_recording

    rng = np.random.default_rng(1)
    normal = _normal(198, rng) + [_trace(198 + i, (198 + i) * 10 * MS, 10.0) for i in range(2)]  # a rare 10 ms
    t0 = 200 * 10 * MS
    # under the fault, text-service takes 6 ms (past the p99, ~3 ms, not the p99.9, ~9 ms) or 20 ms
    faulty = [_trace(1000 + i, t0 + i * MS, 6.0 if i % 2 else 20.0) for i in range(60)]
    spans = _table(normal + faulty)
    fault = AppliedFault(0, "text-service", "interference", "single", t0, t0 + 100 * MS, {"factor": 4})
    default, strict = (label_recording(spans, [fault], t0, 60.0, high) for high in (0.99, 0.999))
    assert default.traces.num_rows == strict.traces.num_rows == 60
    assert default.nodes.num_rows == 60 * 3  # nginx's server, text-service's server, the store's client span
    loose, tight = (np.asarray(r.traces["anomalous"]) for r in (default, strict))
    assert loose.sum() == 60 and tight.sum() == 30 and not (tight & ~loose).any()
