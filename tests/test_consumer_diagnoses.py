"""The diagnoses the consumer publishes are built for a whole batch at once (`Detector.diagnose`
on the batch's spans): each trace's evidence, scores and verdict must be those it gets when
diagnosed alone (scores up to float32 rounding)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pyarrow.compute as pc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.diagnosis import Diagnosis, TraceDiagnosis, single_trace_json
from bmeg.mitigation.planner import suggest, trace_hints
from bmeg.traces import span_table
from builders import many_traces, star_trace, tiny_detector


def _batch_with_an_odd_trace():
    """Six plain traces (one slow) and one with more services than the top five, a service the
    model does not know and a missing parent."""
    odd = star_trace("odd", [100, 300, 20, 40, 60, 80])
    odd["service"][2] = "brand-new-service"
    odd["parent_id"][3] = "missing-parent"
    spans = many_traces(6, slow=2)
    for key, values in odd.items():
        spans[key] += values
    return span_table(spans)


def test_a_trace_diagnosed_in_a_batch_gets_the_diagnosis_it_gets_alone():
    detector = tiny_detector()  # GNN stages only: no SVM window ties traces together
    table = _batch_with_an_odd_trace()

    batch = detector.diagnose(table)

    assert [trace.trace_id for trace in batch.traces] == [f"t{t:04d}" for t in range(6)] + ["odd"]
    for trace in batch.traces:
        (alone,) = detector.diagnose(table.filter(pc.equal(table["trace_id"], trace.trace_id))).traces
        assert _evidence(trace) == _evidence(alone)
    odd_diagnosis = batch.traces[-1]
    assert len(odd_diagnosis.bottlenecks) == 5 and len(odd_diagnosis.latencies) == 7
    assert {s.service for s in odd_diagnosis.bottlenecks} <= {s.service for s in odd_diagnosis.latencies}
    assert [s.score for s in odd_diagnosis.bottlenecks] == sorted((s.score for s in odd_diagnosis.bottlenecks), reverse=True)
    assert [s.latency_us for s in odd_diagnosis.latencies] == sorted((s.latency_us for s in odd_diagnosis.latencies), reverse=True)
    assert any("brand-new-service" in w for w in odd_diagnosis.warnings) and any("parent" in w for w in odd_diagnosis.warnings)
    assert all(not trace.warnings for trace in batch.traces[:-1])  # each warning on its own trace
    slow = batch.traces[2]
    assert slow.latencies[0].service == "svc1" and slow.latencies[0].ratio == slow.latencies[0].latency_us / 200.0
    assert all(s.baseline_us is None and s.ratio is None for s in slow.latencies[1:])  # only svc1 has a baseline


def test_a_traces_verdict_and_scores_do_not_depend_on_its_batch():
    """The consumer scores a batch in one model call: each trace's scores must be those it gets
    alone (up to float32 rounding in the batched matrix products), so its verdict is too."""
    detector = tiny_detector()
    table = _batch_with_an_odd_trace()
    batch = detector.diagnose(table)
    for trace in batch.traces:
        (alone,) = detector.diagnose(table.filter(pc.equal(table["trace_id"], trace.trace_id))).traces
        assert trace.anomalous == alone.anomalous
        assert trace.anomaly_score == pytest.approx(alone.anomaly_score, abs=1e-5)
        assert [s.service for s in trace.bottlenecks] == [s.service for s in alone.bottlenecks]
        assert [s.score for s in trace.bottlenecks] == pytest.approx([s.score for s in alone.bottlenecks], abs=1e-5)


def test_the_consumers_json_is_the_typed_diagnosis_byte_for_byte():
    detector = tiny_detector()
    document = detector.diagnosis_document(_batch_with_an_odd_trace(), window=True)
    diagnosis = Diagnosis.model_validate(document)
    assert diagnosis.model_dump() == document  # every field present (the order: below)
    for trace, typed in zip(document["traces"], diagnosis.traces, strict=True):
        one = Diagnosis(model_version=diagnosis.model_version, application=diagnosis.application, traces=[typed])
        assert single_trace_json(document, trace) == one.model_dump_json().encode()


_FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e-5, 1e16, 5e-324, 0.1 + 0.2])


@settings(max_examples=150, deadline=None)
@given(score=_FLOATS, latency=_FLOATS, text=st.text(), spans=st.integers(0, 2**63 - 1),
       start=st.datetimes(min_value=datetime(1970, 1, 2), timezones=st.just(UTC)) | st.none(),
       numpy_score=st.booleans())
def test_the_consumers_json_is_the_typed_diagnosis_byte_for_byte_at_the_edges(score, latency, text, spans, start,
                                                                                numpy_score):
    """Floats of every size (NaN and infinities: `null`, as pydantic writes them), any text,
    64-bit counts, times and numpy scalars: the bytes the typed diagnosis writes."""
    trace = {
        "trace_id": text, "spans": spans, "total_us": latency, "anomalous": True,
        "anomaly_score": np.float64(score) if numpy_score else score, "threshold": 0.5, "model": "gnn",
        "route": text, "signs": [text], "bottlenecks": [{"service": text, "score": score, "bottleneck": False}],
        "critical_path": [{"service": "a", "operation": text, "exclusive_us": latency}],
        "latencies": [{"service": "a", "latency_us": latency, "baseline_us": None, "ratio": score}],
        "mitigations": [], "warnings": [text], "start_time": start, "partial": False,
    }
    document = {"model_version": text, "application": "app", "traces": [trace], "ranking": None, "window_method": None}
    typed = Diagnosis.model_validate(document)
    assert single_trace_json(document, trace) == typed.model_dump_json().encode()


def test_an_anomalous_traces_hints_from_plain_values_are_those_suggest_gives_it():
    """The consumer publishes an anomalous trace with `trace_hints` laid into its plain values:
    the same bytes as the typed one-trace diagnosis through `suggest`."""
    # untrained: its scores vary from run to run; with these thresholds every trace is flagged
    # and every service it ranks is named, so each one gets hints
    detector = replace(tiny_detector(), thresholds={"graph": 0.0, "svm": 0.0, "node": 0.0, "svm_node": 0.0})
    document = detector.diagnosis_document(_batch_with_an_odd_trace())
    anomalous = [trace for trace in document["traces"] if trace["anomalous"]]
    assert len(anomalous) == 7
    for trace in anomalous:
        one = Diagnosis.model_validate({**document, "traces": [trace]})
        trace["mitigations"] = trace_hints(trace)
        assert single_trace_json(document, trace) == suggest(one).model_dump_json().encode()
    assert all(trace["mitigations"] for trace in anomalous)


def _evidence(trace: TraceDiagnosis) -> dict:
    """Everything but the model's scores and the top services they pick."""
    return trace.model_dump(exclude={"anomalous", "anomaly_score", "bottlenecks"})
