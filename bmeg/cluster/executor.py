"""What an executor does to a service, whatever it acts on (a Kubernetes cluster, the simulator).

Every change returns an `Applied` record with the values before and after: the mitigation
controller audits it and hands it back to `rollback` when verification fails, and a fault-injection
campaign hands it back when its fault ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from bmeg.cluster.catalogue import Parameter


class ActionError(RuntimeError):
    """An action could not be applied (the message says which and why)."""


class ActionForbidden(ActionError):
    """The executor's identity may not do this (Kubernetes RBAC said 403)."""


@dataclass
class ServiceState:
    service: str
    replicas: int
    cpu_cores: float | None = None  # limit per replica
    memory_mb: float | None = None  # limit per replica
    parameters: dict[str, float | str] = field(default_factory=dict)
    migrated: bool = False  # already kept away from noisy neighbours


@dataclass
class Applied:
    """One change made: `previous` and `new` hold the same keys (replicas, cpu_cores, a parameter...)."""

    service: str
    action: str
    previous: dict[str, float | str | bool | None]
    new: dict[str, float | str | bool | None]
    parameter: Parameter | None = None  # the parameter a retune changed


class Executor(Protocol):
    def state(self, service: str) -> ServiceState: ...

    def scale(self, service: str, replicas: int) -> Applied: ...

    def set_resources(self, service: str, *, cpu_cores: float | None = None, memory_mb: float | None = None) -> Applied: ...

    def set_parameter(self, service: str, parameter: Parameter, value: float | str) -> Applied: ...

    def migrate(self, service: str) -> Applied: ...

    def rollback(self, applied: Applied) -> Applied: ...


@runtime_checkable
class Prober(Protocol):
    """An executor that can try a parameter value without applying it (the simulator runs
    short probe windows): the controller's retune then searches online instead of setting
    the catalogue's default."""

    def probe(self, service: str, parameter: Parameter, value: float) -> Sequence[float]:
        """The application's p95 latency (ms) on each of several replicas with `value`."""
        ...
