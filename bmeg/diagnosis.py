"""`Diagnosis`: the one typed result every output uses (CLI, REST, Kafka, mitigation).

A diagnosis covers one or more traces. For each trace: is it anomalous, how sure the model is,
which services are the bottlenecks (ranked), which model decided, and the evidence (critical
path, each service's latency against its normal baseline). With a window of traces it also
ranks services over the whole window.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import orjson
import pydantic_core
from pydantic import BaseModel, Field


class ServiceScore(BaseModel):
    service: str
    score: float = Field(description="Bottleneck score in [0, 1]; higher is more likely.")
    bottleneck: bool = Field(description="Score at or above the model's node threshold.")


class CriticalPathStep(BaseModel):
    service: str
    operation: str
    exclusive_us: float = Field(description="Time on the critical path not covered by its children.")


class ServiceLatency(BaseModel):
    service: str
    latency_us: float = Field(description="The service's exclusive time in this trace (sum over its spans).")
    baseline_us: float | None = Field(None, description="Median of the same in normal traces.")
    ratio: float | None = Field(None, description="latency_us / baseline_us.")


class MitigationHint(BaseModel):
    service: str
    action: Literal["scale_out", "scale_up", "retune", "migrate", "shed", "none"]
    reason: str


class TraceDiagnosis(BaseModel):
    trace_id: str
    spans: int
    total_us: float = Field(description="End-to-end latency of the root span.")
    anomalous: bool
    anomaly_score: float = Field(description="Probability the trace is affected by a bottleneck.")
    threshold: float = Field(description="Decision threshold the verdict used.")
    model: Literal["gnn", "svm"] = Field(description="Which model decided: the GNN stages or the SVM fallback.")
    route: str = Field("", description="Why the router chose that model (the graph's services and distinct paths "
                                       "against the router's cuts).")
    signs: list[str] = Field(default_factory=list, description="The simple signs above their calibrated thresholds "
                             "(end_to_end, call_pattern, error: `bmeg.models.signs`); stage 1 flags a trace when its "
                             "model's score or any sign is above its threshold.")
    bottlenecks: list[ServiceScore] = Field(default_factory=list, description="Services ranked by score.")
    critical_path: list[CriticalPathStep] = Field(default_factory=list)
    latencies: list[ServiceLatency] = Field(default_factory=list)
    mitigations: list[MitigationHint] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list, description="Repairs made to the input trace.")
    start_time: datetime | None = Field(None, description="When the trace's root span started (UTC).")
    partial: bool = Field(False, description="Assembled from a stream without its root or some parent spans "
                                             "(they never arrived): never handed to mitigation.")


class WindowHealth(BaseModel):
    """Whether anything changed in a window against a normal period, by bounds calibrated on that
    period's own held-back traces (`bmeg.models.window.HealthBound`)."""

    healthy: bool = Field(description="No shift above its bound: nothing changed, no service is a bottleneck.")
    time_shift: float = Field(description="The largest time shift of a service (log2 against the normal period).")
    time_bound: float
    gap_lead: float = Field(description="How far (log2) the largest call-gap shift leads the second largest.")
    gap_bound: float
    structure_excess: float = Field(description="The largest structure shift beyond the ranker's noise gate.")
    structure_bound: float
    service: str | None = Field(None, description="The service with the largest time shift.")
    calibration_traces: int = Field(description="Traces per held-back window the bounds were calibrated on.")
    calibration_windows: int


class Diagnosis(BaseModel):
    model_version: str
    application: str
    traces: list[TraceDiagnosis]
    ranking: list[ServiceScore] | None = Field(
        None, description="Services ranked over all the traces given (window mode)."
    )
    window_method: Literal["normal-period", "recent-traffic", "mean-node-score"] | None = Field(
        None, description="How the window was ranked (window mode): `normal-period`, bmeg's ranker against a "
                          "fault-free period of the application (the normal traces a `bmeg bootstrap` run keeps, "
                          "or `--normal`); `recent-traffic`, the same ranker against the latest traces the server "
                          "received before the window (its health still against the normal period); `mean-node-score`, the detector's mean node score, with no normal "
                          "period at hand (a `bmeg train` run): weaker, it follows where traces spend their time."
    )
    window_health: WindowHealth | None = Field(
        None, description="With `normal-period` or `recent-traffic`: whether the window changed at all; when healthy, no service "
                          "in `ranking` is marked a bottleneck."
    )

    @property
    def anomalous(self) -> list[TraceDiagnosis]:
        return [trace for trace in self.traces if trace.anomalous]


def single_trace_json(document: dict[str, Any], trace: dict[str, Any]) -> bytes:
    """The JSON of a one-trace `Diagnosis`: `trace`, one of `document["traces"]`, under
    `document`'s model. `document` is a diagnosis as plain values in `Diagnosis.model_dump()`'s
    layout (`Detector.diagnosis_document`); the bytes are those `model_dump_json()` writes
    (tested, edge values included), made without building the typed objects (the consumer's hot
    path) by orjson, ~2.5x faster on these dicts than pydantic's serialiser: UTC times end in
    `Z` as pydantic writes them, and a value orjson does not know (a numpy scalar) is first made
    plain by pydantic."""
    return orjson.dumps({"model_version": document["model_version"], "application": document["application"],
                         "traces": [trace], "ranking": None, "window_method": None,
                         "window_health": None},
                        default=pydantic_core.to_jsonable_python, option=orjson.OPT_UTC_Z)
