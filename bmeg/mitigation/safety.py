"""The controller's safety rules: dry run by default, a confidence threshold, per-service
cooldown, an hourly action budget, limits on replicas and resources, and verification of
every action (did the service's and the application's p95 improve?) with rollback when not.
With `one_change_at_a_time`, no action while another one awaits its verification: the
application's p95 that verification reads moves with every change, so two changes in one
verification window confound each other's verdicts, and a fix's effect takes a while to show
(a drained backlog first slows the services after the fixed one, which a rule on the live
traces would then blame).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bmeg.mitigation.planner import Decision
from bmeg.paths import shipped_folder

DEFAULT_POLICY = shipped_folder("bmeg.mitigation", ".") / "policy.yaml"
HOUR_S = 3600.0


class SafetyPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dry_run: bool = True
    confidence_threshold: float = Field(0.4, ge=0, le=1)
    cooldown_s: float = Field(300, ge=0)
    actions_per_hour: int = Field(6, ge=0)
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(10, ge=1)
    max_cpu_cores: float = Field(8, gt=0)
    max_memory_mb: float = Field(16384, gt=0)
    verify_after_s: float = Field(60, ge=0)
    min_improvement: float = Field(0.05, ge=0, lt=1)
    one_change_at_a_time: bool = False

    @model_validator(mode="after")
    def _replica_range(self) -> SafetyPolicy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        return self


def load_policy(path: str | Path = DEFAULT_POLICY, **overrides) -> SafetyPolicy:
    """The policy file with `overrides` (e.g. dry_run=False) on top; a bad file is a ValueError."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
        return SafetyPolicy.model_validate({**data, **overrides})
    except (OSError, yaml.YAMLError, ValidationError) as error:
        raise ValueError(f"bad mitigation policy {path}: {error}") from None


@dataclass(frozen=True)
class Latencies:
    """p95 latencies (ms) over a window: the application's and each service's."""

    app_p95_ms: float
    service_p95_ms: dict[str, float]


class Guard:
    """Decides whether a decision may become an action now, and clamps its target to the limits."""

    def __init__(self, policy: SafetyPolicy):
        self.policy = policy
        self.last_action: dict[str, float] = {}
        self.recent: deque[float] = deque()

    def refusal(self, decision: Decision, now: float) -> str | None:
        """Why the decision may not be acted on now, or None if it may."""
        policy = self.policy
        if decision.action == "none":
            return "nothing to do"
        if decision.confidence < policy.confidence_threshold:
            return f"confidence {decision.confidence:.2f} is below the threshold {policy.confidence_threshold:.2f}"
        last = self.last_action.get(decision.service)
        if last is not None and now - last < policy.cooldown_s:
            return f"cooling down: last action {now - last:.0f} s ago, cooldown {policy.cooldown_s:.0f} s"
        while self.recent and now - self.recent[0] >= HOUR_S:
            self.recent.popleft()
        if len(self.recent) >= policy.actions_per_hour:
            return f"hourly budget spent: {len(self.recent)} actions in the last hour (limit {policy.actions_per_hour})"
        return None

    def clamp(self, decision: Decision) -> dict[str, float | str]:
        """The decision's target within the policy's limits."""
        target = dict(decision.target)
        if "replicas" in target:
            target["replicas"] = int(min(max(int(target["replicas"]), self.policy.min_replicas), self.policy.max_replicas))
        if "cpu_cores" in target:
            target["cpu_cores"] = min(float(target["cpu_cores"]), self.policy.max_cpu_cores)
        if "memory_mb" in target:
            target["memory_mb"] = min(float(target["memory_mb"]), self.policy.max_memory_mb)
        return target

    def record(self, service: str, now: float) -> None:
        self.last_action[service] = now
        self.recent.append(now)


def improved(service: str, before: Latencies, after: Latencies, min_improvement: float) -> tuple[bool, str]:
    """Did both the service's and the application's p95 drop by at least `min_improvement`?"""
    checks = [("application", before.app_p95_ms, after.app_p95_ms)]
    if service in before.service_p95_ms and service in after.service_p95_ms:
        checks.append((service, before.service_p95_ms[service], after.service_p95_ms[service]))
    words, good = [], True
    for name, old, new in checks:
        change = (old - new) / old if old > 0 else 0.0
        good = good and change >= min_improvement
        words.append(f"{name} p95 {old:.1f} -> {new:.1f} ms ({-change:+.0%})")
    return good, "; ".join(words)
