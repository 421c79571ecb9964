"""The mitigation controller: diagnosis in, safe actions out, each one verified.

`Controller.handle` plans from a diagnosis, asks the guard, and (unless dry-run) applies the
action through the executor; `Controller.verify` looks at actions whose verification window
has passed and rolls back those that did not improve the p95 latencies. Where the executor
can probe (the simulator), a retune's value comes from an online HybridBandits search around
the current value, each candidate judged TUNA-style on several replicas (`search_around`);
elsewhere it is the catalogue's default the planner proposed. Everything it
decides or does goes to the audit log. Given the application's `services` (its topology), it
acts on nothing else: a service name comes from spans, which anyone who can send a trace
writes, so a name outside the topology is refused, never looked up. Time is passed in (`now`, seconds), so the same code
runs against wall-clock time on a cluster and simulated time on the simulator.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from bmeg.diagnosis import Diagnosis
from bmeg.mitigation.audit import AuditLog
from bmeg.cluster.catalogue import Catalogue
from bmeg.cluster.executor import ActionError, ActionForbidden, Applied, Executor, Prober
from bmeg.mitigation.planner import Decision, PlannerPolicy, ServiceTelemetry, plan
from bmeg.mitigation.safety import Guard, Latencies, SafetyPolicy, improved
from bmeg.mitigation.tuning import search_around


@dataclass
class Outcome:
    """What became of one decision: applied, dry-run, refused (why) or failed (why)."""

    decision: Decision
    status: str  # "applied", "dry-run", "advice" (nothing to execute), "refused", "failed"
    detail: str
    applied: Applied | None = None


@dataclass
class Pending:
    applied: Applied
    action: str  # the planner's action that made it
    before: Latencies
    due: float


class Controller:
    def __init__(self, executor: Executor, catalogue: Catalogue, policy: SafetyPolicy, audit: AuditLog,
                 planner_policy: PlannerPolicy = PlannerPolicy(), services: Collection[str] | None = None):
        self.executor = executor
        self.services = None if services is None else frozenset(services)  # None: any (the simulator's own)
        self.catalogue = catalogue
        self.policy = policy
        self.audit = audit
        self.planner_policy = planner_policy
        self.guard = Guard(policy)
        self.pending: list[Pending] = []
        self.rolled_back: set[tuple[str, str]] = set()  # (service, planner action) that did not help

    def handle(self, diagnosis: Diagnosis, now: float, latencies: Latencies | None = None,
               telemetry: dict[str, ServiceTelemetry] | None = None) -> list[Outcome]:
        """Plan from the diagnosis and act on each decision the guard allows."""
        decisions = plan(diagnosis, self.catalogue, telemetry, self.planner_policy)
        return [self._act(decision, now, latencies) for decision in decisions]

    def _act(self, decision: Decision, now: float, latencies: Latencies | None) -> Outcome:
        dry = self.policy.dry_run
        self.audit.append("decision", decision.service, decision.action, decision.source, dry_run=dry, at=now,
                          details={"confidence": decision.confidence, "reason": decision.reason, "target": decision.target})
        refusal = self.guard.refusal(decision, now)
        if self.services is not None and decision.service not in self.services:
            refusal = "not a service of the application's topology: bmeg acts only on those"
        if refusal is None and decision.service in {p.applied.service for p in self.pending}:
            refusal = "an earlier action on it is still being verified"
        if refusal is None and self.policy.one_change_at_a_time and self.pending:
            first = self.pending[0].applied
            refusal = f"one change at a time: the {first.action} of {first.service} is still being verified"
        if refusal is None and (decision.service, decision.action) in self.rolled_back:
            refusal = f"a {decision.action} on it was rolled back before: not repeating it"
        if refusal is not None:
            self.audit.append("refused", decision.service, decision.action, refusal, dry_run=dry, at=now)
            return Outcome(decision, "refused", refusal)
        if decision.action == "shed":  # no executor sheds load: the decision's words are for a person
            self.audit.append("refused", decision.service, decision.action, "advice for an operator", dry_run=dry, at=now)
            return Outcome(decision, "advice", "advice for an operator: shed requests around the pauses")
        target = self.guard.clamp(decision)
        if dry:
            detail = f"dry run: would {decision.action} {decision.service} to {target}"
            self.audit.append("action", decision.service, decision.action, "dry-run", dry_run=True, at=now, details={"target": target})
            self.guard.record(decision.service, now)
            return Outcome(decision, "dry-run", detail)
        tried: list[dict] = []
        try:
            if decision.action == "retune":
                target, tried = self._search(decision, target)
            applied = self._apply(decision, target)
        except ActionError as error:
            reason = f"{'forbidden' if isinstance(error, ActionForbidden) else 'failed'}: {error}"
            self.audit.append("error", decision.service, decision.action, reason, dry_run=False, at=now, details={"target": target})
            return Outcome(decision, "failed", reason)
        self.guard.record(decision.service, now)
        self.audit.append("action", decision.service, decision.action, "applied", dry_run=False, at=now,
                          details={"previous": applied.previous, "new": applied.new, **({"search": tried} if tried else {})})
        if latencies is not None:
            self.pending.append(Pending(applied, decision.action, latencies, now + self.policy.verify_after_s))
        searched = f" (online search, {len(tried)} candidates tried on replicas)" if tried else ""
        return Outcome(decision, "applied", f"{applied.previous} -> {applied.new}{searched}", applied)

    def _apply(self, decision: Decision, target: dict) -> Applied:
        service, executor = decision.service, self.executor
        if decision.action == "scale_out":
            return executor.scale(service, int(target["replicas"]))
        if decision.action == "scale_up":
            return executor.set_resources(service, cpu_cores=target.get("cpu_cores"), memory_mb=target.get("memory_mb"))
        if decision.action == "retune":
            (name, value), = target.items()
            return executor.set_parameter(service, self.catalogue.parameter(service, name), value)
        if decision.action == "migrate":
            return executor.migrate(service)
        raise ActionError(f"no executor supports {decision.action!r}")

    def _search(self, decision: Decision, target: dict) -> tuple[dict, list[dict]]:
        """A retune's target found by online search around the current value (HybridBandits,
        each candidate judged on several replicas) where the executor can probe; the planner's
        target otherwise, or when every candidate was unstable. Also the candidates tried."""
        (name, fallback), = target.items()
        service, parameter = decision.service, self.catalogue.parameter(decision.service, name)
        if not (isinstance(self.executor, Prober) and parameter.numeric):
            return target, []
        prober = self.executor
        current = self.executor.state(service).parameters.get(name, parameter.default)
        tried: list[dict] = []

        def measure(value: float) -> list[float]:
            p95 = list(prober.probe(service, parameter, value))
            tried.append({"value": value, "p95_ms": [round(x, 2) for x in p95]})
            return p95

        best = search_around(parameter, float(current), measure)
        return {name: best.values[name] if best is not None else fallback}, tried

    def verify(self, now: float, latencies: Latencies) -> list[tuple[Applied, bool, str]]:
        """Judge every action whose window has passed; roll back those that did not help."""
        results, still = [], []
        for pending in self.pending:
            if now < pending.due:
                still.append(pending)
                continue
            service = pending.applied.service
            good, words = improved(service, pending.before, latencies, self.policy.min_improvement)
            self.audit.append("verification", service, pending.applied.action, "improved" if good else "no improvement",
                              dry_run=False, at=now, details={"detail": words})
            if not good:
                self._rollback(pending.applied, now, words)
                self.rolled_back.add((service, pending.action))
            results.append((pending.applied, good, words))
        self.pending = still
        return results

    def _rollback(self, applied: Applied, now: float, why: str) -> None:
        try:
            undone = self.executor.rollback(applied)
        except ActionError as error:
            self.audit.append("error", applied.service, f"rollback {applied.action}", str(error), dry_run=False, at=now)
            return
        self.audit.append("rollback", applied.service, applied.action, "rolled back", dry_run=False, at=now,
                          details={"restored": undone.new, "why": why})
