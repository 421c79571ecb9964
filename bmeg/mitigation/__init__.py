"""Mitigation: plan actions from a diagnosis, tune parameters online, and act safely
(dry run, cooldown, budgets, verification, rollback, audit) on Kubernetes or the simulator."""

from bmeg.mitigation.audit import AuditLog, Record
from bmeg.cluster.catalogue import Catalogue, CatalogueError, Parameter, load_catalogue
from bmeg.mitigation.controller import Controller, Outcome
from bmeg.cluster.executor import ActionError, ActionForbidden, Applied, Executor, ServiceState
from bmeg.mitigation.planner import Decision, PlannerPolicy, ServiceTelemetry, plan, with_hints
from bmeg.mitigation.safety import Guard, Latencies, SafetyPolicy, load_policy
from bmeg.mitigation.tuning import HybridBandit, Judgement, judge, tune

__all__ = [
    "ActionError", "ActionForbidden", "Applied", "AuditLog", "Catalogue", "CatalogueError", "Controller",
    "Decision", "Executor", "Guard", "HybridBandit", "Judgement", "Latencies", "Outcome", "Parameter",
    "PlannerPolicy", "Record", "SafetyPolicy", "ServiceState", "ServiceTelemetry", "load_catalogue",
    "load_policy", "judge", "plan", "tune", "with_hints",
]
