"""`KubernetesExecutor`: mitigation actions on a real cluster, with the official client.

- scale out: the Deployment's scale subresource (`patch_namespaced_deployment_scale`);
- scale up: a strategic-merge patch of the container's CPU / memory limits;
- retune: an environment variable of the container, or a ConfigMap key plus a pod-template
  annotation that rolls the Deployment so the pods read the new value;
- migrate: a pod anti-affinity to the interference pods (label `bmeg.io/role=interference`,
  what `bmeg.faultinject.kubernetes` creates), which reschedules the pods away from them.

Every change annotates the Deployment with what changed and the previous value
(`bmeg.io/last-action`), so an operator sees it with `kubectl describe`, and returns an
`Applied` that `rollback` undoes. A 403 from RBAC becomes `ActionForbidden`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from bmeg.mitigation.catalogue import Catalogue, Parameter
from bmeg.mitigation.executor import ActionError, ActionForbidden, Applied, ServiceState

STRATEGIC = "application/strategic-merge-patch+json"
ANNOTATION = "bmeg.io/last-action"
MIGRATED = "bmeg.io/migrated"
INTERFERENCE_LABELS = {"bmeg.io/role": "interference"}


def cpu_cores(quantity: str | None) -> float | None:
    """A Kubernetes CPU quantity ("500m", "2") in cores."""
    if quantity is None:
        return None
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


_MEMORY_UNITS = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024**2, "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}


def memory_mb(quantity: str | None) -> float | None:
    """A Kubernetes memory quantity ("64Mi", "2Gi", "1000000") in MiB."""
    if quantity is None:
        return None
    text = str(quantity)
    for suffix in sorted(_MEMORY_UNITS, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _MEMORY_UNITS[suffix]
    return float(text) / 2**20


def _cpu_quantity(cores: float) -> str:
    return f"{round(cores * 1000)}m"


def _memory_quantity(mb: float) -> str:
    return f"{round(mb)}Mi"


class KubernetesExecutor:
    def __init__(self, api: client.ApiClient, namespace: str, catalogue: Catalogue, manager: str = "bmeg-mitigation"):
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.catalogue = catalogue
        self.manager = manager

    # ---- reading ------------------------------------------------------------------------
    def state(self, service: str) -> ServiceState:
        deployment = self._call(f"get deployment {service}", self.apps.read_namespaced_deployment, service, self.namespace)
        container = self._container(service, deployment)
        limits = (container.resources.limits if container.resources else None) or {}
        env = {item.name: item.value for item in container.env or []}
        parameters: dict[str, float | str] = {}
        for parameter in self.catalogue.parameters_for(service).values():
            value = env.get(parameter.env) if parameter.env else self._configmap_value(parameter)
            if value is not None:
                parameters[parameter.name] = value if parameter.type == "categorical" else float(value)
        annotations = deployment.metadata.annotations or {}
        return ServiceState(service, deployment.spec.replicas or 0, cpu_cores(limits.get("cpu")),
                            memory_mb(limits.get("memory")), parameters, annotations.get(MIGRATED) == "true")

    def _configmap_value(self, parameter: Parameter) -> str | None:
        try:
            configmap = self.core.read_namespaced_config_map(parameter.configmap.name, self.namespace)
        except ApiException:
            return None  # absent or unreadable: the value is unknown, not an error
        return (configmap.data or {}).get(parameter.configmap.key)

    # ---- actions ------------------------------------------------------------------------
    def scale(self, service: str, replicas: int) -> Applied:
        before = self.state(service)
        self._call(f"scale deployment {service}", self.apps.patch_namespaced_deployment_scale, service, self.namespace,
                   {"spec": {"replicas": int(replicas)}}, _content_type=STRATEGIC)
        applied = Applied(service, "scale", {"replicas": before.replicas}, {"replicas": int(replicas)})
        self._annotate(applied)
        return applied

    def set_resources(self, service: str, *, cpu_cores: float | None = None, memory_mb: float | None = None) -> Applied:
        before = self.state(service)
        new = {key: value for key, value in (("cpu_cores", cpu_cores), ("memory_mb", memory_mb)) if value is not None}
        if not new:
            raise ActionError(f"set_resources on {service} names no resource")
        previous = {key: getattr(before, key) for key in new}
        self._patch_limits(service, new)
        applied = Applied(service, "resources", previous, new)
        self._annotate(applied)
        return applied

    def _patch_limits(self, service: str, values: dict[str, float | None]) -> None:
        limits: dict[str, str | None] = {}  # None removes a limit
        if "cpu_cores" in values:
            limits["cpu"] = None if values["cpu_cores"] is None else _cpu_quantity(values["cpu_cores"])
        if "memory_mb" in values:
            limits["memory"] = None if values["memory_mb"] is None else _memory_quantity(values["memory_mb"])
        self._patch_container(service, {"resources": {"limits": limits}})

    def set_parameter(self, service: str, parameter: Parameter, value: float | str) -> Applied:
        value = parameter.check(value)
        before = self.state(service).parameters.get(parameter.name)
        self._write_parameter(service, parameter, value)
        applied = Applied(service, "parameter", {parameter.name: before}, {parameter.name: value}, parameter)
        self._annotate(applied)
        return applied

    def _write_parameter(self, service: str, parameter: Parameter, value: float | str | None) -> None:
        text = None if value is None else _parameter_text(parameter, value)
        if parameter.env:
            entry = {"name": parameter.env, "$patch": "delete"} if text is None else {"name": parameter.env, "value": text}
            self._patch_container(service, {"env": [entry]})
            return
        name, key = parameter.configmap.name, parameter.configmap.key
        self._call(f"patch configmap {name}", self.core.patch_namespaced_config_map, name, self.namespace,
                   {"data": {key: text}}, _content_type=STRATEGIC)
        # the pods read the ConfigMap at start: a changed template annotation rolls them
        self._patch_deployment(service, {"spec": {"template": {"metadata": {"annotations": {
            f"bmeg.io/config-{name}-{key}": text if text is not None else "removed"}}}}})

    def migrate(self, service: str) -> Applied:
        deployment = self._call(f"get deployment {service}", self.apps.read_namespaced_deployment, service, self.namespace)
        previous = deployment.spec.template.spec.affinity
        previous_json = json.dumps(self.apps.api_client.sanitize_for_serialization(previous)) if previous else None
        away = {"labelSelector": {"matchLabels": INTERFERENCE_LABELS}, "topologyKey": "kubernetes.io/hostname"}
        self._patch_deployment(service, {
            "metadata": {"annotations": {MIGRATED: "true"}},
            "spec": {"template": {"spec": {"affinity": {"podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [away]}}}}},
        })
        applied = Applied(service, "migrate", {"affinity": previous_json}, {"affinity": json.dumps({"podAntiAffinity": away})})
        self._annotate(applied)
        return applied

    def rollback(self, applied: Applied) -> Applied:
        service = applied.service
        if applied.action == "scale":
            undone = self.scale(service, int(applied.previous["replicas"]))
        elif applied.action == "resources":
            self._patch_limits(service, dict(applied.previous))
            undone = Applied(service, "resources", dict(applied.new), dict(applied.previous))
        elif applied.action == "parameter":
            (name, value), = applied.previous.items()
            self._write_parameter(service, applied.parameter, value)
            undone = Applied(service, "parameter", dict(applied.new), dict(applied.previous), applied.parameter)
        elif applied.action == "migrate":
            previous = applied.previous["affinity"]
            self._patch_deployment(service, {
                "metadata": {"annotations": {MIGRATED: None}},
                "spec": {"template": {"spec": {"affinity": json.loads(previous) if previous else None}}},
            })
            undone = Applied(service, "migrate", dict(applied.new), dict(applied.previous))
        else:
            raise ActionError(f"cannot roll back unknown action {applied.action!r}")
        self._annotate(undone, rollback=True)
        return undone

    # ---- plumbing -----------------------------------------------------------------------
    def _container(self, service: str, deployment) -> client.V1Container:
        containers = deployment.spec.template.spec.containers
        kind = self.catalogue.kind_of(service)
        wanted = kind.container if kind else None
        for container in containers:
            if wanted is None or container.name == wanted:
                return container
        raise ActionError(f"deployment {service} has no container {wanted!r} (has {[c.name for c in containers]})")

    def _patch_container(self, service: str, fields: dict[str, Any]) -> None:
        deployment = self._call(f"get deployment {service}", self.apps.read_namespaced_deployment, service, self.namespace)
        name = self._container(service, deployment).name
        self._patch_deployment(service, {"spec": {"template": {"spec": {"containers": [{"name": name, **fields}]}}}})

    def _patch_deployment(self, service: str, body: dict) -> None:
        self._call(f"patch deployment {service}", self.apps.patch_namespaced_deployment, service, self.namespace,
                   body, field_manager=self.manager, _content_type=STRATEGIC)

    def _annotate(self, applied: Applied, rollback: bool = False) -> None:
        record = {"action": applied.action, "previous": applied.previous, "new": applied.new,
                  "rollback": rollback, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self._patch_deployment(applied.service, {"metadata": {"annotations": {ANNOTATION: json.dumps(record, default=str)}}})

    def _call(self, what: str, method, *args, **kwargs):
        try:
            return method(*args, **kwargs)
        except ApiException as error:
            message = _api_message(error)
            if error.status == 403:
                raise ActionForbidden(f"{what} in namespace {self.namespace}: forbidden: {message}") from None
            raise ActionError(f"{what} in namespace {self.namespace}: HTTP {error.status}: {message}") from None


def _parameter_text(parameter: Parameter, value: float | str) -> str:
    if parameter.type == "integer":
        return str(int(round(float(value))))
    return str(value) if parameter.type == "categorical" else f"{float(value):g}"


def _api_message(error: ApiException) -> str:
    try:
        return json.loads(error.body).get("message", error.reason)
    except (TypeError, ValueError):
        return str(error.reason)
