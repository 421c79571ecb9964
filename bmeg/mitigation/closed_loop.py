"""The closed loop on the simulator: `bmeg mitigate --sim socialnet --scenario FILE`.

The simulated application runs window by window; a normal phase first gives the baselines,
then the scenario's faults start. Three runs see the same faults and seeds:
- without mitigation (the fault's full effect);
- with the controller: each window's traces go to the detector, its diagnosis and the
  window's telemetry to the controller, which acts on the simulator (and verifies, and rolls
  back) before the next window;
- with an HPA-like baseline that scales each service on CPU utilization alone
  (desired = ceil(replicas * utilization / target), as the Kubernetes HPA computes it).

The report's p95 "after mitigation" counts the fault's windows from the controller's last
kept action on (applied and not rolled back: the state the controller settled on), so the
windows before it could act do not hide whether the action worked; the HPA is measured the
same way from its last scaling, and both whole-fault-period figures are reported too.
`recovery_s` says how long getting there took.

The detector is a trained `bmeg.models.detector.Detector` when one is given (the planner
turns its per-trace verdicts and critical paths into evidence, see `gather_evidence`). Without one the
loop uses `SlowestLeafDetector`, a transparent rule: services whose window p95 exclusive time
is well above its normal p95, keeping only those with no service below them in the call
graph that is slowed down by a comparable factor (latency spreads upstream, so the deepest
slow service is the likely cause); scores are log slowdowns relative to the largest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Callable, Collection
from typing import Protocol

import numpy as np
import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from bmeg.diagnosis import Diagnosis, ServiceScore
from bmeg.faultinject import Fault, Scenario, TopologySpec, calibrate, plan_faults
from bmeg.graphs import assemble, node_services
from bmeg.mitigation.audit import AuditLog
from bmeg.cluster.catalogue import Catalogue
from bmeg.mitigation.controller import Controller
from bmeg.cluster.executor import Executor
from bmeg.mitigation.planner import descendants
from bmeg.mitigation.safety import Latencies, SafetyPolicy
from bmeg.mitigation.simulated import SimulatedApp, Window


class TraceDetector(Protocol):
    def diagnose(self, spans: pa.Table, window: bool = False) -> Diagnosis: ...


class WindowRule(Protocol):
    """A rule that diagnoses a window without a model (`SlowestLeafDetector`)."""

    def diagnose_window(self, window: Window, edges: set[tuple[str, str]]) -> Diagnosis: ...


@dataclass
class SlowestLeafDetector:
    """The fallback detector (see the module's words); `baseline_p95_us` per service.

    On a real machine (`by_excess`, `min_samples`): scheduling noise doubles a 0.2-ms span's
    time without hurting anyone, so the causes are scored by their excess time (p95 over its
    normal, in µs) rather than the log of their slowdown, and a service seen in fewer than
    `min_samples` traces of the window (whose p95 is the largest of a handful) is left out.
    `candidates`, when given, are the only services that can be causes (the ones a controller
    can act on): a slower store elsewhere then does not shrink their scores."""

    application: str
    baseline_p95_us: dict[str, float]
    slow_ratio: float = 2.0
    min_excess_us: float = 1000.0  # ignore services slower by less than a millisecond
    explains: float = 0.25  # share of a caller's slowdown (p95 / normal p95) a slow callee must have to explain it
    by_excess: bool = False
    min_samples: int = 1
    candidates: frozenset[str] | None = None

    def diagnose_window(self, window: Window, edges: set[tuple[str, str]]) -> Diagnosis:
        grouped = window.service_latency.groupby("service")["us"]
        counts = grouped.size()
        p95 = grouped.quantile(0.95)
        ratio = {s: us / self.baseline_p95_us[s] for s, us in p95.items()
                 if self.baseline_p95_us.get(s, 0) > 0 and counts[s] >= self.min_samples}
        slow = {s for s, r in ratio.items() if r >= self.slow_ratio and p95[s] - self.baseline_p95_us[s] >= self.min_excess_us}
        below = descendants(edges)
        # back-pressure amplifies: a caller's queue can grow far beyond its slow callee's
        # latency, so a callee explains a caller once its slowdown is of the same order
        causes = {s for s in slow if not any(ratio[d] >= self.explains * ratio[s] for d in below.get(s, set()) & slow)}
        if self.candidates is not None:
            causes &= self.candidates
        weight = {s: (p95[s] - self.baseline_p95_us[s]) if self.by_excess else math.log(ratio[s]) for s in causes}
        top = max(weight.values(), default=1.0)
        ranking = [ServiceScore(service=s, score=round(weight[s] / top, 4) if s in causes else 0.0,
                                bottleneck=s in causes)
                   for s in sorted(ratio, key=lambda s: -ratio[s])]
        return Diagnosis(model_version="slowest-leaf-rule", application=self.application, traces=[], ranking=ranking)


@dataclass
class LoopSettings:
    window_s: float = 2.5
    normal_s: float = 10.0
    seed: int = 0
    hpa_target_utilization: float = 0.6
    hpa_tolerance: float = 0.1


@dataclass
class RunTrace:
    """One run's windows: (start, end, p95, p99) and what was done when."""

    windows: list[tuple[float, float, float, float]] = field(default_factory=list)
    actions: list[dict] = field(default_factory=list)


@dataclass
class LoopReport:
    scenario: str
    faults: list[dict]
    p95_normal_ms: float
    p99_normal_ms: float
    p95_fault_ms: float
    p99_fault_ms: float
    p95_mitigated_ms: float  # over the fault windows after the last kept action (see `_after_last_action`)
    p99_mitigated_ms: float
    p95_hpa_ms: float  # the same for the HPA baseline, after its last scaling
    p99_hpa_ms: float
    mitigated_from_s: float | None  # where those windows start (None: no kept action, the whole fault period)
    hpa_from_s: float | None
    p95_fault_period_mitigated_ms: float  # over every window that overlaps a fault, the first ones included
    p99_fault_period_mitigated_ms: float
    p95_fault_period_hpa_ms: float
    p99_fault_period_hpa_ms: float
    recovery_s: float | None
    recovery_hpa_s: float | None
    recovery_unmitigated_s: float | None
    actions: list[dict]
    hpa_actions: list[dict]
    detector: str
    timeline: dict[str, list[tuple[float, float, float, float]]]
    window_method: str | None = None  # how the detector ranked a window (`WindowDetector`); None: the rule


def run_closed_loop(topology: TopologySpec, scenario: Scenario, catalogue: Catalogue, policy: SafetyPolicy,
                    settings: LoopSettings = LoopSettings(), detector: TraceDetector | None = None,
                    progress: bool = False) -> LoopReport:
    faults = [_shift(f, settings.normal_s) for f in plan_faults(scenario, topology, np.random.default_rng(settings.seed))]
    thresholds = calibrate(topology, settings.seed, duration_s=10.0)
    end_s = settings.normal_s + scenario.duration_s
    starts = np.arange(0.0, end_s, settings.window_s)

    def app() -> SimulatedApp:
        return SimulatedApp(topology, faults, catalogue, thresholds, seed=settings.seed)

    bar = tqdm(total=3 * len(starts), desc=f"closed loop {scenario.name}", disable=not progress)
    unmitigated = _run(app(), starts, settings, bar, act=None)
    normal = [w for w in unmitigated.windows_raw if w.end_s <= settings.normal_s]
    baseline = pd.concat([w.service_latency for w in normal]).groupby("service")["us"].quantile(0.95).to_dict()
    fallback = SlowestLeafDetector(topology.name, baseline)
    controlled_app, hpa_app = app(), app()
    controlled = _run(controlled_app, starts, settings, bar, controller_step(controlled_app, catalogue, policy, detector, fallback))
    hpa = _run(hpa_app, starts, settings, bar, hpa_step(hpa_app, policy, settings.hpa_target_utilization, settings.hpa_tolerance))
    bar.close()


    def fault_windows(run: _Run) -> list[Window]:
        return [w for w in run.windows_raw if _overlaps(w, faults)]

    p95_normal, p99_normal = _quantiles(normal)
    p95_fault, p99_fault = _quantiles(fault_windows(unmitigated))
    mitigated_from, hpa_from = _last_kept_action_s(controlled.actions), _last_kept_action_s(hpa.actions)
    p95_mitigated, p99_mitigated = _quantiles(_after(fault_windows(controlled), mitigated_from))
    p95_hpa, p99_hpa = _quantiles(_after(fault_windows(hpa), hpa_from))
    p95_period_mitigated, p99_period_mitigated = _quantiles(fault_windows(controlled))
    p95_period_hpa, p99_period_hpa = _quantiles(fault_windows(hpa))
    first_fault = min((f.start_s for f in faults), default=settings.normal_s)
    return LoopReport(
        scenario=scenario.name,
        faults=[{"service": f.service, "source": f.source, "start_s": f.start_s, "end_s": f.end_s, **f.parameters} for f in faults],
        p95_normal_ms=p95_normal, p99_normal_ms=p99_normal, p95_fault_ms=p95_fault, p99_fault_ms=p99_fault,
        p95_mitigated_ms=p95_mitigated, p99_mitigated_ms=p99_mitigated, p95_hpa_ms=p95_hpa, p99_hpa_ms=p99_hpa,
        mitigated_from_s=mitigated_from, hpa_from_s=hpa_from,
        p95_fault_period_mitigated_ms=p95_period_mitigated, p99_fault_period_mitigated_ms=p99_period_mitigated,
        p95_fault_period_hpa_ms=p95_period_hpa, p99_fault_period_hpa_ms=p99_period_hpa,
        recovery_s=_recovery(controlled, faults, first_fault, p95_normal),
        recovery_hpa_s=_recovery(hpa, faults, first_fault, p95_normal),
        recovery_unmitigated_s=_recovery(unmitigated, faults, first_fault, p95_normal),
        actions=controlled.actions, hpa_actions=hpa.actions,
        detector=getattr(detector, "version", None) or "slowest-leaf-rule",
        window_method=getattr(detector, "window_method", None),
        timeline={"unmitigated": unmitigated.windows, "mitigated": controlled.windows, "hpa": hpa.windows},
    )


@dataclass
class _Run(RunTrace):
    windows_raw: list[Window] = field(default_factory=list)


def _run(app: SimulatedApp, starts: np.ndarray, settings: LoopSettings, bar, act) -> _Run:
    run = _Run()
    for start in starts.tolist():
        window = app.run_window(start, start + settings.window_s)
        run.windows_raw.append(window)
        run.windows.append((window.start_s, window.end_s, window.p95_ms, _quantile(window.trace_latency_ms, 0.99)))
        if act is not None and start + settings.window_s > settings.normal_s:
            run.actions.extend(act(window))
        bar.update()
    return run


def controller_step(executor: Executor, catalogue: Catalogue, policy: SafetyPolicy, detector: TraceDetector | None,
                    fallback: WindowRule, audit: AuditLog | None = None,
                    services: Collection[str] | None = None,
                    remeasure: Callable[[Window], Latencies] | None = None) -> Callable[[Window], list[dict]]:
    """One control step per window: verify the actions due (rolling back those that did not
    help), diagnose the window (the detector, else the fallback rule), act on the plan (on
    `services` only, when given). Returns what was done, as records for the report.

    `remeasure`, where traces arrive late (live spans), gives the latencies of an action's
    window as known now: verification then compares the window before the action with the
    one after it as both are known at verification time, not the before-window as it looked
    when its slowest traces had not arrived (which made a right action look useless)."""
    controller = Controller(executor, catalogue, policy, audit or AuditLog(), services=services)
    records: dict[int, dict] = {}  # id(Applied) -> its action's record, marked when rolled back
    decided_on: dict[int, Window] = {}  # id(Applied) -> the window it was decided on

    def step(window: Window) -> list[dict]:
        now = window.end_s
        done = []
        if remeasure is not None:
            for pending in controller.pending:
                if now >= pending.due and id(pending.applied) in decided_on:
                    pending.before = remeasure(decided_on.pop(id(pending.applied)))
        for applied, good, words in controller.verify(now, window.latencies):
            done.append({"time_s": now, "service": applied.service, "action": f"verify {applied.action}",
                         "status": "kept" if good else "rolled back", "detail": words})
            record = records.pop(id(applied))
            if not good:
                record["rolled_back_s"] = now
        if detector is not None:
            diagnosis = detector.diagnose(window.spans, window=True)
        else:
            diagnosis = fallback.diagnose_window(window, service_edges(window.spans))
        for outcome in controller.handle(diagnosis, now, window.latencies, window.telemetry):
            done.append({"time_s": now, "service": outcome.decision.service, "action": outcome.decision.action,
                         "source": outcome.decision.source, "confidence": outcome.decision.confidence,
                         "status": outcome.status, "detail": outcome.detail, "reason": outcome.decision.reason})
            if outcome.applied is not None:
                records[id(outcome.applied)] = done[-1]
                decided_on[id(outcome.applied)] = window
        return done

    return step


def hpa_step(executor: Executor, policy: SafetyPolicy, target_utilization: float,
             tolerance: float) -> Callable[[Window], list[dict]]:
    """The HPA baseline's step: desired = ceil(replicas * utilization / target) per service,
    acted on when the ratio is beyond the tolerance; CPU utilization is all it looks at."""
    def step(window: Window) -> list[dict]:
        done = []
        for service, telemetry in window.telemetry.items():
            if telemetry.cpu_utilization is None or telemetry.replicas is None:
                continue
            ratio = telemetry.cpu_utilization / target_utilization
            if ratio <= 1 + tolerance:  # the HPA's scale-down waits 5 minutes: never here
                continue
            desired = min(policy.max_replicas, math.ceil(telemetry.replicas * ratio))
            if desired > telemetry.replicas:
                executor.scale(service, desired)
                done.append({"time_s": window.end_s, "service": service, "action": "scale_out",
                             "status": "applied", "detail": f"{telemetry.replicas} -> {desired} replicas "
                             f"(CPU {telemetry.cpu_utilization:.0%} of the limit)"})
        return done

    return step


def service_edges(spans: pa.Table) -> set[tuple[str, str]]:
    """(caller, callee) service pairs of the spans' call graphs."""
    forest = assemble(spans, on_bad_trace="drop")
    services = node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False)
    child = np.flatnonzero(forest.parent >= 0)
    return set(zip(services[forest.parent[child]].tolist(), services[child].tolist()))


def _shift(fault: Fault, by_s: float) -> Fault:
    return Fault(fault.service, fault.source, fault.kind, fault.start_s + by_s, fault.end_s + by_s, dict(fault.parameters))


def _overlaps(window: Window, faults: list[Fault]) -> bool:
    return any(f.start_s < window.end_s and window.start_s < f.end_s for f in faults)


def _last_kept_action_s(actions: list[dict]) -> float | None:
    """When the last action that was applied and not rolled back took effect (the next
    window starts then); None when nothing was kept."""
    kept = [a["time_s"] for a in actions if a["status"] == "applied" and "rolled_back_s" not in a]
    return max(kept, default=None)


def _after(windows: list[Window], from_s: float | None) -> list[Window]:
    """The windows from `from_s` on (all of them when None)."""
    return windows if from_s is None else [w for w in windows if w.start_s >= from_s]


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else float("nan")


def _quantiles(windows: list[Window]) -> tuple[float, float]:
    if not windows:
        return float("nan"), float("nan")
    latencies = np.concatenate([w.trace_latency_ms for w in windows])
    return _quantile(latencies, 0.95), _quantile(latencies, 0.99)


def _recovery(run: _Run, faults: list[Fault], first_fault_s: float, p95_normal_ms: float, slack: float = 1.5) -> float | None:
    """Seconds from the first fault until the p95 is back within `slack` of normal for the
    rest of the faults' time (None: never while they last)."""
    during = [w for w in run.windows_raw if _overlaps(w, faults)]
    for index, window in enumerate(during):
        if all(w.p95_ms <= slack * p95_normal_ms for w in during[index:]):
            return max(0.0, window.start_s - first_fault_s)
    return None
