"""The planner: from a `Diagnosis` (and telemetry where there is some) decide, for each
bottlenecked service, the likely source of the trouble and the action that fixes it.

Which services: each anomalous trace blames one, from its critical path, where a caller's
wait is the callee's and the deepest slowed service is the likely cause (`gather_evidence`);
the confidence grows with the model's score behind the blame and the share of anomalous
traces that agree.

The rules, in the order they are tried (each decision says in words which one fired and why):
- background task: the service's tail (p99.9) moved but its median did not (GC pauses), so
  more capacity will not help: shed requests around the pauses.
- a service whose median is near its baseline gets no action (a few flagged traces are not a
  bottleneck).
- saturation: CPU utilization near the limit: scale out a stateless service (more replicas),
  scale up a stateful one (a store cannot simply be replicated); a limit under one core that
  is well used throttles every request: scale up to a core. Where the telemetry gives CFS
  throttling (the share of periods in which the quota ran out), a limit under one core
  throttled in at least `THROTTLED_SHARE` of them is scaled up to a core first, however busy:
  a request that meets a throttled period waits for the next one (up to a period, 100 ms by
  default), and more replicas with the same limit would wait alike.
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
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from bmeg.diagnosis import Diagnosis, MitigationHint, TraceDiagnosis
from bmeg.cluster.catalogue import Catalogue, Parameter, load_catalogue

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
    cpu_throttled: float | None = Field(None, ge=0, le=1, description="share of CFS periods in which the quota "
                                        "ran out (container_cpu_cfs_throttled_periods_total / _periods_total)")


#: the share of CFS periods throttled at which a container counts as CPU-throttled: the
#: threshold of kubernetes-mixin's CPUThrottlingHigh alert (25%)
THROTTLED_SHARE = 0.25


@dataclass(frozen=True)
class PlannerPolicy:
    saturated_utilization: float = 0.8  # at or above: saturation
    idle_utilization: float = 0.6  # below: latency is not explained by load
    throttled_utilization: float = 0.4  # at or above, with a limit under one core: throttling
    throttled_share: float = THROTTLED_SHARE  # CFS periods throttled at or above: throttling, however busy
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
    via_callers: float = 0.0  # part of `share` blamed first on callers that queue on it


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


def gather_evidence(diagnosis: Diagnosis, catalogue: Catalogue | None = None, explains: float = 0.25,
                    slow_ratio: float = PlannerPolicy.slow_ratio) -> list[Evidence]:
    """Services the anomalous traces blame (or, without any, the window ranking names), strongest first.

    Each anomalous trace blames one service: the one whose critical-path time grew most over
    its baseline, a call's wait counted as the callee's (see `_path_time`), then moved down
    to a callee whose own growth is at least `explains` of it and that is itself slowed
    (`slow_ratio`; a slow service makes its callers queue, so the deepest slow one is the
    likely cause). The blamed service gets the model's highest score among the nodes whose
    time it was credited with: the model flags the caller that waits, and the wait is the
    callee's. A trace without a critical path blames its top named bottleneck.

    Over the window, a service's blame moves to a service below it in the call graph that is
    blamed by at least `explains` as many traces: requests queued at an entry point (whose
    own paths may be fast below it) are victims of the slow service below, not causes.
    """
    catalogue = catalogue or _default_catalogue()
    anomalous = diagnosis.anomalous
    scores: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    edges: set[tuple[str, str]] = set()
    for trace in diagnosis.traces:
        path = _path_time(trace, catalogue)
        edges |= {(caller, callee) for caller, called in path.callees.items() for callee in called}
        for service, ratio in _ratios(trace, path).items():
            ratios.setdefault(service, []).append(ratio)
        blamed = _blame(trace, path, explains, slow_ratio) if trace.anomalous else None
        if blamed is not None:
            scores.setdefault(blamed[0], []).append(blamed[1])
    if not anomalous:
        for entry in diagnosis.ranking or []:
            if entry.bottleneck:
                scores[entry.service] = [entry.score]
    counts = {service: len(values) for service, values in scores.items()}
    via_callers = {service: 0 for service in scores}
    for service, target in _blame_moves(counts, descendants(edges), explains).items():
        via_callers[target] += counts[service]
        del via_callers[service]
    return _ranked([_evidence(service, scores[service], counts[service] + inherited, inherited, ratios, len(anomalous))
                    for service, inherited in via_callers.items()])


def named_evidence(diagnosis: Diagnosis) -> list[Evidence]:
    """Every service the diagnosis names a bottleneck in an anomalous trace (or, without any,
    in its window ranking), as named: what hints for a person reading it are about."""
    return _named_evidence(
        [[(entry.service, entry.score) for entry in trace.bottlenecks if entry.bottleneck] for trace in diagnosis.anomalous],
        [(entry.service, entry.score) for entry in diagnosis.ranking or [] if entry.bottleneck],
        [(latency.service, latency.ratio) for trace in diagnosis.traces for latency in trace.latencies
         if latency.ratio is not None])


def _named_evidence(named: list[list[tuple[str, float]]], ranked: list[tuple[str, float]],
                    ratios: list[tuple[str, float]]) -> list[Evidence]:
    """`named_evidence` from plain values: each anomalous trace's named (service, score) pairs,
    the window ranking's, and every trace's (service, latency ratio) pairs."""
    scores: dict[str, list[float]] = {}
    for trace in named:
        for service, score in trace:
            scores.setdefault(service, []).append(score)
    for service, score in ranked:
        if service not in scores:
            scores[service] = [score]
    by_service: dict[str, list[float]] = {}
    for service, ratio in ratios:
        by_service.setdefault(service, []).append(ratio)
    return _ranked([_evidence(service, values, len(values), 0, by_service, len(named)) for service, values in scores.items()])


def _evidence(service: str, scores: list[float], blamed: int, inherited: int, ratios: dict[str, list[float]],
              anomalous: int) -> Evidence:
    service_ratios = sorted(ratios.get(service, []))
    return Evidence(
        service=service,
        score=math.fsum(scores) / len(scores),  # `statistics.fmean`, without its type checks
        share=blamed / max(anomalous, 1),
        median_ratio=quantile_of_sorted(service_ratios, 0.5) if service_ratios else None,
        tail_ratio=quantile_of_sorted(service_ratios, 0.999) if service_ratios else None,
        via_callers=inherited / max(anomalous, 1),
    )


def quantile_of_sorted(values: list[float], q: float) -> float:
    """numpy's default (linear) quantile of values already sorted. Each anomalous trace the
    consumer publishes gets hints from a handful of values per service, where numpy's call
    overhead was a third of the diagnosing thread's time (py-spy, bench/stream.py --stages)."""
    position = (len(values) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def _ranked(evidence: list[Evidence]) -> list[Evidence]:
    return sorted(evidence, key=lambda e: (-e.score * e.share, e.service))


def _blame_moves(counts: dict[str, int], below: dict[str, set[str]], explains: float) -> dict[str, str]:
    """service -> the blamed service below it that takes its blame (the one blamed most;
    followed down, so a chain of callers ends at the deepest)."""
    moves = {}
    for service, count in counts.items():
        candidates = [other for other in below.get(service, set()) if counts.get(other, 0) >= explains * count]
        if candidates:
            moves[service] = max(candidates, key=lambda other: (counts[other], other))
    for service in list(moves):
        target, seen = moves[service], {service}
        while target in moves and target not in seen:
            seen.add(target)
            target = moves[target]
        moves[service] = target
    return {service: target for service, target in moves.items() if target != service}


def descendants(edges: set[tuple[str, str]]) -> dict[str, set[str]]:
    """Every service below each caller in a call graph given as (caller, callee) pairs."""
    children: dict[str, set[str]] = {}
    for caller, callee in edges:
        if caller != callee:
            children.setdefault(caller, set()).add(callee)
    found: dict[str, set[str]] = {}

    def walk(service: str, seen: frozenset) -> set[str]:
        if service in found:
            return found[service]
        reach = set()
        for child in children.get(service, ()):
            if child not in seen:
                reach |= {child} | walk(child, seen | {child})
        found[service] = reach
        return reach

    for service in list(children):
        walk(service, frozenset({service}))
    return found


@dataclass
class _PathTime:
    """One trace's critical-path time per service (µs), a call's wait counted as the callee's."""

    time_us: dict[str, float]
    credited_from: dict[str, set[str]]  # service -> services whose steps were counted as its
    callees: dict[str, set[str]]  # who calls whom on the path


def _path_time(trace: TraceDiagnosis, catalogue: Catalogue) -> _PathTime:
    """Steps come in time order, each span before its children, so a step followed by another
    service's step is the client side of a call into it: its time (the callee's queue and the
    network) is the callee's. Not so next to a store: stores are named by their client spans
    and call nobody, so a step before a store's is the caller's own work."""
    path = _PathTime({}, {}, {})
    steps = trace.critical_path
    for step, following in zip(steps, [*steps[1:], None]):
        owner = step.service
        if following is not None and following.service != owner:
            path.callees.setdefault(owner, set()).add(following.service)
            if not (_is_store(owner, catalogue) or _is_store(following.service, catalogue)):
                owner = following.service
        path.time_us[owner] = path.time_us.get(owner, 0.0) + step.exclusive_us
        path.credited_from.setdefault(owner, set()).add(step.service)
    return path


def _blame(trace: TraceDiagnosis, path: _PathTime, explains: float, slow_ratio: float) -> tuple[str, float] | None:
    """The service an anomalous trace blames, and the model's score behind it."""
    named = [entry for entry in trace.bottlenecks if entry.bottleneck]
    baseline = {latency.service: latency.baseline_us or 0.0 for latency in trace.latencies}
    excess = {service: time - baseline.get(service, 0.0) for service, time in path.time_us.items()}
    slowed = {service for service, time in path.time_us.items() if time >= slow_ratio * baseline.get(service, 0.0)}
    if not excess or max(excess.values()) <= 0:
        return (named[0].service, named[0].score) if named else None
    culprit = max(excess, key=excess.__getitem__)
    seen = {culprit}
    while True:
        deeper = [callee for callee in path.callees.get(culprit, set()) - seen
                  if callee in slowed and excess[callee] >= explains * excess[culprit]]
        if not deeper:
            break
        culprit = max(deeper, key=excess.__getitem__)
        seen.add(culprit)
    model = {entry.service: entry.score for entry in trace.bottlenecks}
    return culprit, max(model.get(service, 0.0) for service in path.credited_from[culprit])


def _ratios(trace: TraceDiagnosis, path: _PathTime) -> dict[str, float]:
    """Each service's time over its baseline: critical-path time where the trace has a path,
    exclusive time otherwise."""
    baseline = {latency.service: latency.baseline_us for latency in trace.latencies}
    if path.time_us:
        return {service: time / baseline[service] for service, time in path.time_us.items() if baseline.get(service)}
    return {latency.service: latency.ratio for latency in trace.latencies if latency.ratio is not None}


def _is_store(service: str, catalogue: Catalogue) -> bool:
    kind = catalogue.kind_of(service)
    return kind is not None and kind.name in STATEFUL_KINDS


def plan(
    diagnosis: Diagnosis,
    catalogue: Catalogue,
    telemetry: dict[str, ServiceTelemetry] | None = None,
    policy: PlannerPolicy = PlannerPolicy(),
) -> list[Decision]:
    """One decision per bottlenecked service, strongest evidence first."""
    telemetry = telemetry or {}
    return [_decide(e, catalogue, telemetry.get(e.service), policy)
            for e in gather_evidence(diagnosis, catalogue, slow_ratio=policy.slow_ratio)]


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

    def decide(source: Source, action: Action, certainty: float, why: str, **target) -> Decision:
        return Decision(evidence.service, source, action, round(strength * certainty, 4), f"{seen}; {why}", target, evidence)

    if _background_tail(evidence, policy):
        return decide("background", "shed", 0.7,
                      "its tail moved but its median did not, the signature of background pauses "
                      "(garbage collection): more capacity would not help; shed requests around them")
    if evidence.median_ratio is not None and evidence.median_ratio < policy.slow_ratio:
        return decide("unknown", "none", 0.0,
                      f"yet its time is near its baseline in most traces (under {policy.slow_ratio:g}x): "
                      "nothing to fix there")
    utilization = telemetry.cpu_utilization if telemetry else None
    if telemetry is None or utilization is None:
        replicas = (telemetry.replicas if telemetry else None) or 1
        return decide("unknown", "scale_out", 0.5,
                      "no utilization is known, so the source is unclear; scaling out helps both "
                      "saturation and a noisy neighbour", replicas=replicas + 1)
    cores = telemetry.cpu_limit_cores
    throttled = telemetry.cpu_throttled
    if cores is not None and cores < 1 and throttled is not None and throttled >= policy.throttled_share:
        return decide("saturation", "scale_up", 0.9,
                      f"its CPU limit of {cores:g} of a core ran out in {throttled:.0%} of the CFS periods "
                      f"({utilization:.0%} used): a request that meets a throttled period waits for the next "
                      "one, and replicas with the same limit would wait alike; raise it to one core",
                      cpu_cores=1.0)
    if utilization >= policy.saturated_utilization:
        return _saturation(decide, telemetry, utilization, _is_store(evidence.service, catalogue), policy)
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
                      f"one replica is {skew:.1f}x slower than the others while CPU is only "
                      f"{utilization:.0%} busy: a noisy neighbour on its node; move it away")
    if utilization < policy.idle_utilization:
        return decide("interference", "migrate", 0.6,
                      f"latency is up while CPU is only {utilization:.0%} busy and no parameter is off: "
                      "likely contention from a neighbour (LLC, memory bandwidth, I/O); move it away")
    return _saturation(decide, telemetry, utilization, _is_store(evidence.service, catalogue), policy,
                       certainty=0.6)


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
    """The slowest replica's p95 over the median of the others (not of all: with two
    replicas that median is halfway to the slow one)."""
    p95 = sorted(telemetry.replica_p95_ms or [])
    if len(p95) < 2 or np.median(p95[:-1]) <= 0:
        return None
    return float(p95[-1] / np.median(p95[:-1]))


def _latency_words(evidence: Evidence) -> str:
    words = f"{evidence.service} is blamed for {evidence.share:.0%} of anomalous traces (score {evidence.score:.2f})"
    if evidence.via_callers:
        words += f", {evidence.via_callers:.0%} of them through callers queueing on it"
    if evidence.median_ratio is not None:
        words += f", its latency at {evidence.median_ratio:.1f}x its baseline (median)"
    return words


def _show(value: float | str) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def suggest(diagnosis: Diagnosis, catalogue: Catalogue | None = None) -> Diagnosis:
    """The diagnosis with mitigation hints on its anomalous traces, for people reading it.

    Each service the model names gets a hint (`named_evidence`). No telemetry is known here, so
    the hints are the planner's cautious defaults; the controller (`bmeg mitigate`) decides
    with telemetry, and from the blame of `gather_evidence`, before acting.
    """
    if not diagnosis.anomalous:
        return diagnosis
    catalogue = catalogue or _default_catalogue()
    return with_hints(diagnosis, [_decide(e, catalogue, None, PlannerPolicy()) for e in named_evidence(diagnosis)])


def trace_hints(trace: dict[str, Any]) -> list[dict[str, str]]:
    """The hints `suggest` gives one anomalous trace diagnosed alone, from the trace as plain
    values (one of `Detector.diagnosis_document`'s traces), as plain values: the Kafka consumer
    publishes every anomalous trace with its hints, and validating the typed diagnosis for
    `suggest` and dumping it again cost ~95 µs per trace (bench/stream.py, py-spy)."""
    named = [(entry["service"], entry["score"]) for entry in trace["bottlenecks"] if entry["bottleneck"]]
    ratios = [(latency["service"], latency["ratio"]) for latency in trace["latencies"] if latency["ratio"] is not None]
    catalogue = _default_catalogue()
    decisions = {e.service: _decide(e, catalogue, None, _DEFAULT_POLICY) for e in _named_evidence([named], [], ratios)}
    return [{"service": service, "action": decisions[service].action, "reason": decisions[service].reason}
            for service, _ in named if service in decisions]


_DEFAULT_POLICY = PlannerPolicy()  # frozen: built once (a frozen dataclass costs µs to build, per trace here)


@functools.cache
def _default_catalogue() -> Catalogue:
    return load_catalogue()
