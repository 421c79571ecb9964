"""`KubernetesExecutor`: changes to Deployments on a real cluster, and their undoing, with the
official client (mitigation's actions; fault injection's saturation and misconfiguration).

- scale out: the Deployment's scale subresource (`patch_namespaced_deployment_scale`), unless an
  autoscaler owns its replicas: then the autoscaler's bounds change instead (a KEDA ScaledObject's
  `minReplicaCount`/`maxReplicaCount`, else an autoscaling/v2 HPA's `minReplicas`/`maxReplicas`;
  KEDA's own HPA is left to KEDA), since patching the replicas under an autoscaler starts a
  tug of war (it undoes the change, bmeg sees no improvement and rolls back);
- scale up: a strategic-merge patch of the container's CPU / memory limits;
- retune: an environment variable of the container, or a ConfigMap key plus a pod-template
  annotation that rolls the Deployment so the pods read the new value;
- migrate: a pod anti-affinity to the interference pods (label `bmeg.io/role=interference`,
  what `bmeg.faultinject.kubernetes` creates), which reschedules the pods away from them.

Every change annotates the Deployment with what changed and the previous value
(`bmeg.io/last-action`), so an operator sees it with `kubectl describe`, and returns an
`Applied` that `rollback` undoes. A 403 from RBAC becomes `ActionForbidden`. The calls made are
exactly those the controller's generated Role grants (`bmeg.mitigation.rbac`).

`api_client` connects from a kubeconfig, or, in a pod, with the pod's ServiceAccount
(`config.load_incluster_config()`'s loader).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.incluster_config import SERVICE_CERT_FILENAME, SERVICE_TOKEN_FILENAME, InClusterConfigLoader

from bmeg.cluster.catalogue import Catalogue, Parameter
from bmeg.cluster.executor import ActionError, ActionForbidden, Applied, ServiceState

STRATEGIC = "application/strategic-merge-patch+json"
ANNOTATION = "bmeg.io/last-action"
MIGRATED = "bmeg.io/migrated"
INTERFERENCE_LABELS = {"bmeg.io/role": "interference"}
KEDA = ("keda.sh", "v1alpha1", "scaledobjects")
KEDA_DEFAULT_MIN, KEDA_DEFAULT_MAX = 0, 100  # KEDA's defaults for minReplicaCount, maxReplicaCount


def api_client(kubeconfig: Path | None = None, environ: dict[str, str] | None = None,
               token_file: str = SERVICE_TOKEN_FILENAME, ca_file: str = SERVICE_CERT_FILENAME) -> client.ApiClient:
    """A client from `kubeconfig`, else the pod's own (in-cluster) configuration: its ServiceAccount's
    token and CA, the API server from `KUBERNETES_SERVICE_HOST`/`_PORT` (what
    `config.load_incluster_config()` reads; the files are parameters so tests can point them elsewhere)."""
    if kubeconfig is not None:
        return config.new_client_from_config(config_file=str(kubeconfig))
    environ = dict(os.environ if environ is None else environ)
    if "KUBERNETES_SERVICE_HOST" not in environ:
        raise ActionError("not in a pod (no KUBERNETES_SERVICE_HOST): give --kubeconfig")
    configuration = client.Configuration()
    try:
        InClusterConfigLoader(token_file, ca_file, environ=environ).load_and_set(configuration)
    except config.ConfigException as error:
        raise ActionError(f"in-cluster configuration: {error}") from None
    return client.ApiClient(configuration)


@dataclass(frozen=True)
class Autoscaler:
    """What owns a Deployment's replicas: an HPA or a KEDA ScaledObject, with its bounds."""

    kind: str  # "HorizontalPodAutoscaler" or "ScaledObject"
    name: str
    min_replicas: int
    max_replicas: int


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
        self.autoscaling = client.AutoscalingV2Api(api)
        self.custom = client.CustomObjectsApi(api)
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
    def autoscaler(self, service: str) -> Autoscaler | None:
        """The ScaledObject or HPA whose target is the Deployment `service`, if any."""
        try:
            scaled = self.custom.list_namespaced_custom_object(*KEDA[:2], self.namespace, KEDA[2])["items"]
        except ApiException as error:
            if error.status != 404:  # 404: KEDA is not installed
                raise self._error(f"list scaledobjects (for {service})", error) from None
            scaled = []
        for item in scaled:
            target, spec = item["spec"].get("scaleTargetRef", {}), item["spec"]
            if target.get("kind", "Deployment") == "Deployment" and target.get("name") == service:
                return Autoscaler("ScaledObject", item["metadata"]["name"], int(spec.get("minReplicaCount", KEDA_DEFAULT_MIN)),
                                  int(spec.get("maxReplicaCount", KEDA_DEFAULT_MAX)))
        hpas = self._call(f"list horizontalpodautoscalers (for {service})",
                          self.autoscaling.list_namespaced_horizontal_pod_autoscaler, self.namespace).items
        for hpa in hpas:
            target = hpa.spec.scale_target_ref
            if target.kind == "Deployment" and target.name == service:
                return Autoscaler("HorizontalPodAutoscaler", hpa.metadata.name, hpa.spec.min_replicas or 1,
                                  hpa.spec.max_replicas)
        return None

    def scale(self, service: str, replicas: int) -> Applied:
        before = self.state(service)
        replicas = int(replicas)
        owner = self.autoscaler(service)
        if owner is None:
            self._patch_scale(service, replicas)
            applied = Applied(service, "scale", {"replicas": before.replicas}, {"replicas": replicas})
        else:  # more replicas: raise the floor; fewer: lower the ceiling
            low, high = ((replicas, max(owner.max_replicas, replicas)) if replicas >= before.replicas
                         else (min(owner.min_replicas, replicas), replicas))
            self._patch_bounds(owner, low, high)
            named = f"{owner.kind}/{owner.name}"
            applied = Applied(service, "scale",
                              {"replicas": before.replicas, "autoscaler": named, "min_replicas": owner.min_replicas,
                               "max_replicas": owner.max_replicas},
                              {"replicas": replicas, "autoscaler": named, "min_replicas": low, "max_replicas": high})
        self._annotate(applied)
        return applied

    def _patch_scale(self, service: str, replicas: int) -> None:
        self._call(f"scale deployment {service}", self.apps.patch_namespaced_deployment_scale, service, self.namespace,
                   {"spec": {"replicas": replicas}}, _content_type=STRATEGIC)

    def _patch_bounds(self, owner: Autoscaler, low: int, high: int) -> None:
        what = f"patch {owner.kind} {owner.name} (it owns the replicas)"
        if owner.kind == "ScaledObject":
            self._call(what, self.custom.patch_namespaced_custom_object, *KEDA[:2], self.namespace, KEDA[2], owner.name,
                       {"spec": {"minReplicaCount": low, "maxReplicaCount": high}})
        else:
            self._call(what, self.autoscaling.patch_namespaced_horizontal_pod_autoscaler, owner.name, self.namespace,
                       {"spec": {"minReplicas": low, "maxReplicas": high}})

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
        if applied.action == "scale" and "autoscaler" in applied.previous:
            kind, _, name = str(applied.previous["autoscaler"]).partition("/")
            owner = Autoscaler(kind, name, int(applied.new["min_replicas"]), int(applied.new["max_replicas"]))
            self._patch_bounds(owner, int(applied.previous["min_replicas"]), int(applied.previous["max_replicas"]))
            undone = Applied(service, "scale", dict(applied.new), dict(applied.previous))
        elif applied.action == "scale":
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
            raise self._error(what, error) from None

    def _error(self, what: str, error: ApiException) -> ActionError:
        message = _api_message(error)
        if error.status == 403:
            return ActionForbidden(f"{what} in namespace {self.namespace}: forbidden: {message}")
        return ActionError(f"{what} in namespace {self.namespace}: HTTP {error.status}: {message}")


def _parameter_text(parameter: Parameter, value: float | str) -> str:
    if parameter.type == "integer":
        return str(int(round(float(value))))
    return str(value) if parameter.type == "categorical" else f"{float(value):g}"


def _api_message(error: ApiException) -> str:
    try:
        return json.loads(error.body).get("message", error.reason)
    except (TypeError, ValueError):
        return str(error.reason)
