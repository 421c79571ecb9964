"""The planner: from a `Diagnosis` (and telemetry where there is some) decide, for each
bottlenecked service, the likely source of the trouble and the action that fixes it.

The rules, in the order they are tried (each decision says in words which one fired and why):
- background task: the service's tail (p99.9) moved but its median did not (GC pauses), so
  more capacity will not help: shed requests around the pauses.
- saturation: CPU utilization near the limit: scale out a stateless service (more replicas),
  scale up a stateful one (a store cannot simply be replicated); a limit under one core that
  is well used throttles every request: scale up to a core.
- misconfiguration: latency up with low utilization, and a parameter that matters sits at a
  known-bad value (far below its default in the catalogue's range): retune it.
- interference: latency up with low utilization (or only on some replicas), nothing
  misconfigured: a noisy neighbour; move the pods away from it.
- without telemetry the source is unknown: scale out, the generic action that helps
  saturation and dilutes interference, with a lower confidence.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from bmeg.diagnosis import Diagnosis, MitigationHint
from bmeg.mitigation.catalogue import Catalogue, Parameter, load_catalogue

Source = Literal["saturation", "interference", "misconfiguration", "background", "unknown"]
Action = Literal["scale_out", "scale_up", "retune", "migrate", "shed", "none"]

#: Kinds of service that keep state: scaled up, not out.
STATEFUL_KINDS = {"memcached", "redis", "mongodb"}


class ServiceTelemetry(BaseModel):
    """What the cluster knows about one service now; every field is optional."""

    replicas: int | None = None
    cpu_utilization: float | None = Field(None, ge=0, description="CPU used / CPU limit, over all replicas")
    cpu_limit_cores: float | None = Field(None, gt=0, description="per replica")
    memory_limit_mb: float | None = Field(None, gt=0, description="per replica")
    parameters: dict[str, float | str] = Field(default_factory=dict, description="current values of catalogued parameters")
    replica_p95_ms: list[float] | None = Field(None, description="p95 latency of each replica")


@dataclass(frozen=True)
class PlannerPolicy:
    saturated_utilization: float = 0.8  # at or above: saturation
    idle_utilization: float = 0.6  # below: latency is not explained by load
    throttled_utilization: float = 0.4  # at or above, with a limit under one core: throttling
    target_utilization: float = 0.6  # what a scaling action aims for
    slow_ratio: float = 1.5  # latency / baseline that counts as "up"
    tail_ratio: float = 4.0  # p99.9 / baseline that counts as a background-task tail
    replica_skew: float = 2.0  # slowest / median replica p95 that points at one bad node
    bad_parameter_unit: float = 0.1  # normalized distance below the default that marks a bad value


@dataclass
class Evidence:
    """What the diagnosis says about one service, over all the traces it covers."""

    service: str
    score: float  # mean bottleneck score where it is named a bottleneck
    share: float  # fraction of anomalous traces that name it
    median_ratio: float | None  # median latency / baseline over the traces
    tail_ratio: float | None  # p99.9 latency / baseline over the traces


@dataclass
class Decision:
    service: str
    source: Source
    action: Action
    confidence: float
    reason: str
    target: dict[str, float | str] = field(default_factory=dict)  # replicas, cpu_cores or one parameter
    evidence: Evidence | None = None

    def hint(self) -> MitigationHint:
        return MitigationHint(service=self.service, action=self.action, reason=self.reason)


def gather_evidence(diagnosis: Diagnosis) -> list[Evidence]:
    """Services named bottlenecks in anomalous traces (or in the window ranking), strongest first."""
    anomalous = diagnosis.anomalous
    scores: dict[str, list[float]] = {}
    for trace in anomalous:
        for entry in trace.bottlenecks:
            if entry.bottleneck:
                scores.setdefault(entry.service, []).append(entry.score)
    for entry in diagnosis.ranking or []:
        if entry.bottleneck and entry.service not in scores:
            scores[entry.service] = [entry.score]
    ratios: dict[str, list[float]] = {}
    for trace in diagnosis.traces:
        for latency in trace.latencies:
            if latency.ratio is not None:
                ratios.setdefault(latency.service, []).append(latency.ratio)
    evidence = []
    for service, values in scores.items():
        service_ratios = np.array(ratios.get(service, []))
        evidence.append(Evidence(
            service=service,
            score=float(np.mean(values)),
            share=len(values) / max(len(anomalous), 1),
            median_ratio=float(np.median(service_ratios)) if len(service_ratios) else None,
            tail_ratio=float(np.quantile(service_ratios, 0.999)) if len(service_ratios) else None,
        ))
    return sorted(evidence, key=lambda e: (-e.score * e.share, e.service))


def plan(
    diagnosis: Diagnosis,
    catalogue: Catalogue,
    telemetry: dict[str, ServiceTelemetry] | None = None,
    policy: PlannerPolicy = PlannerPolicy(),
) -> list[Decision]:
    """One decision per bottlenecked service, strongest evidence first."""
    telemetry = telemetry or {}
    return [_decide(e, catalogue, telemetry.get(e.service), policy) for e in gather_evidence(diagnosis)]


def with_hints(diagnosis: Diagnosis, decisions: list[Decision]) -> Diagnosis:
    """A copy of the diagnosis whose anomalous traces carry the hints for their bottlenecks."""
    hints = {decision.service: decision.hint() for decision in decisions}
    traces = []
    for trace in diagnosis.traces:
        named = [hints[b.service] for b in trace.bottlenecks if b.bottleneck and b.service in hints]
        traces.append(trace.model_copy(update={"mitigations": named}) if trace.anomalous else trace)
    return diagnosis.model_copy(update={"traces": traces})


def _decide(evidence: Evidence, catalogue: Catalogue, telemetry: ServiceTelemetry | None, policy: PlannerPolicy) -> Decision:
    strength = evidence.score * math.sqrt(evidence.share)
    seen = _latency_words(evidence)
    kind = catalogue.kind_of(evidence.service)
    stateful = kind is not None and kind.name in STATEFUL_KINDS

    def decide(source: Source, action: Action, certainty: float, why: str, **target) -> Decision:
        return Decision(evidence.service, source, action, round(strength * certainty, 4), f"{seen}; {why}", target, evidence)

    if _background_tail(evidence, policy):
        return decide("background", "shed", 0.7,
                      "its tail moved but its median did not, the signature of background pauses "
                      "(garbage collection): more capacity would not help; shed requests around them")
    utilization = telemetry.cpu_utilization if telemetry else None
    if telemetry is None or utilization is None:
        replicas = (telemetry.replicas if telemetry else None) or 1
        return decide("unknown", "scale_out", 0.5,
                      "no utilization is known, so the source is unclear; scaling out helps both "
                      "saturation and a noisy neighbour", replicas=replicas + 1)
    if utilization >= policy.saturated_utilization:
        return _saturation(decide, telemetry, utilization, stateful, policy)
    cores = telemetry.cpu_limit_cores
    if cores is not None and cores < 1 and utilization >= policy.throttled_utilization:
        return decide("saturation", "scale_up", 0.8,
                      f"its CPU limit is {cores:g} of a core and {utilization:.0%} used: a quota under one core "
                      "throttles every request (CFS), slowing them long before the limit is used up; "
                      "raise it to one core", cpu_cores=1.0)
    bad = _bad_parameter(catalogue, evidence.service, telemetry, policy)
    if bad is not None:
        parameter, current = bad
        return decide("misconfiguration", "retune", 0.85,
                      f"CPU is only {utilization:.0%} busy, yet {parameter.name} = {_show(current)} sits "
                      f"far below its default {_show(parameter.default)}: retune it "
                      f"({parameter.change}, {parameter.downtime_s:g} s down)",
                      **{parameter.name: parameter.default})
    skew = _replica_skew(telemetry)
    if skew is not None and skew >= policy.replica_skew:
        return decide("interference", "migrate", 0.8,
                      f"one replica is {skew:.1f}x slower than the median replica while CPU is only "
                      f"{utilization:.0%} busy: a noisy neighbour on its node; move it away")
    if utilization < policy.idle_utilization:
        return decide("interference", "migrate", 0.6,
                      f"latency is up while CPU is only {utilization:.0%} busy and no parameter is off: "
                      "likely contention from a neighbour (LLC, memory bandwidth, I/O); move it away")
    return _saturation(decide, telemetry, utilization, stateful, policy, certainty=0.6)


def _saturation(decide, telemetry: ServiceTelemetry, utilization: float, stateful: bool,
                policy: PlannerPolicy, certainty: float = 0.9) -> Decision:
    growth = max(utilization / policy.target_utilization, 1.25)
    if stateful and telemetry.cpu_limit_cores:
        cores = round(telemetry.cpu_limit_cores * growth, 2)
        return decide("saturation", "scale_up", certainty,
                      f"CPU is {utilization:.0%} of its limit and the service keeps state: raise the "
                      f"limit from {telemetry.cpu_limit_cores:g} to {cores:g} cores", cpu_cores=cores)
    replicas = telemetry.replicas or 1
    target = max(replicas + 1, math.ceil(replicas * growth))
    return decide("saturation", "scale_out", certainty,
                  f"CPU is {utilization:.0%} of its limit: scale out from {replicas} to {target} "
                  f"replicas to bring it near {policy.target_utilization:.0%}", replicas=target)


def _background_tail(evidence: Evidence, policy: PlannerPolicy) -> bool:
    return (evidence.median_ratio is not None and evidence.tail_ratio is not None
            and evidence.median_ratio < policy.slow_ratio and evidence.tail_ratio >= policy.tail_ratio)


def _bad_parameter(catalogue: Catalogue, service: str, telemetry: ServiceTelemetry,
                   policy: PlannerPolicy) -> tuple[Parameter, float] | None:
    """The most important numeric parameter whose current value lies far below its default."""
    found = []
    for name, current in telemetry.parameters.items():
        parameter = catalogue.parameters_for(service).get(name)
        if parameter is None or not parameter.numeric or parameter.importance <= 0 or isinstance(current, str):
            continue
        gap = parameter.to_unit(parameter.default) - parameter.to_unit(current)
        if gap >= policy.bad_parameter_unit:
            found.append((parameter.importance * gap, parameter, float(current)))
    if not found:
        return None
    _, parameter, current = max(found, key=lambda item: item[0])
    return parameter, current


def _replica_skew(telemetry: ServiceTelemetry) -> float | None:
    p95 = telemetry.replica_p95_ms
    if not p95 or len(p95) < 2 or np.median(p95) <= 0:
        return None
    return float(max(p95) / np.median(p95))


def _latency_words(evidence: Evidence) -> str:
    words = f"{evidence.service} is named a bottleneck in {evidence.share:.0%} of anomalous traces (score {evidence.score:.2f})"
    if evidence.median_ratio is not None:
        words += f", its latency at {evidence.median_ratio:.1f}x its baseline (median)"
    return words


def _show(value: float | str) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def suggest(diagnosis: Diagnosis, catalogue: Catalogue | None = None) -> Diagnosis:
    """The diagnosis with mitigation hints on its anomalous traces, for people reading it.

    No telemetry is known here, so the hints are the planner's cautious defaults; the controller
    (`bmeg mitigate`) decides with telemetry before acting.
    """
    if not diagnosis.anomalous:
        return diagnosis
    catalogue = catalogue or _default_catalogue()
    return with_hints(diagnosis, plan(diagnosis, catalogue))


@functools.cache
def _default_catalogue() -> Catalogue:
    return load_catalogue()
