"""The real-cluster backend of fault injection: a campaign of faults on Kubernetes.

- interference: a stress pod (stress-ng-like image, configurable) scheduled next to the
  target's pods by a required pod affinity to them, labelled `bmeg.io/role=interference`. It
  meets the restricted Pod Security profile (`interference_pod`): non-root, seccomp
  `RuntimeDefault`, every capability dropped, no privilege escalation, a read-only root
  filesystem, and CPU and memory limits (its CPU limit is the stress it was asked for);
- network (only with `allow_privileged=True`): `tc netem` delay and rate in each of the target's
  pods, from an ephemeral container that shares the pod's network namespace. `tc` needs
  `NET_ADMIN` as root, which the baseline and restricted profiles refuse, so this is the one fault
  that needs privilege: the campaign refuses it unless told, and the API server refuses it unless
  the namespace's `pod-security.kubernetes.io/enforce` label is `privileged` (the namespace's own
  opt-in). Ephemeral containers cannot be removed: the container deletes its qdisc when its time
  is up, and the undo (at the fault's end, or early) adds one more that deletes it;
- saturation: the target's CPU limit shrunk to `capacity` of itself, or its replicas cut;
- misconfiguration: a catalogued parameter set to a known-bad value (`pool_size` for the
  parameter the catalogue maps to a pool, `hit_ratio` as the smallest cache memory).

Every fault is undone when it ends and whatever happens: the campaign restores the
Deployments and deletes its pods in a `finally`, and SIGTERM is turned into an exception so a
killed campaign cleans up too. The traces of the campaign's window come from the Jaeger query
API into a span table (`bmeg.traces.fetch`). `app_deployments` writes an application's Deployments
from its topology.
"""

from __future__ import annotations

import math
import signal
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from bmeg.faultinject.scenario import Fault
from bmeg.faultinject.spec import TopologySpec
from bmeg.cluster.catalogue import Catalogue
from bmeg.cluster.executor import Applied
from bmeg.cluster.kubernetes import INTERFERENCE_LABELS, KubernetesExecutor

DEFAULT_STRESS_IMAGE = "ghcr.io/colinianking/stress-ng:latest"
DEFAULT_NETEM_IMAGE = "nicolaka/netshoot:latest"  # has iproute2's tc
SUPPORTED_SOURCES = ("interference", "saturation", "misconfiguration", "network")
#: Faults that need a privilege the restricted profile refuses (opt-in: `allow_privileged`).
PRIVILEGED_SOURCES = ("network",)
#: A stressor's memory limit: stress-ng's CPU stressors use a few MiB.
STRESS_MEMORY = "64Mi"
#: A user with no rights, for containers that need none (stress-ng's image runs as root otherwise).
NOBODY = 65534


class CampaignInterrupted(RuntimeError):
    """The campaign got SIGTERM; it cleaned up before this propagated."""


@dataclass
class Injected:
    """What one fault did, so it can be undone: changes to roll back and pods to delete
    (emptied once undone; `log` keeps what was done)."""

    fault: Fault
    changes: list[Applied] = field(default_factory=list)
    pods: list[str] = field(default_factory=list)
    shaped: list[str] = field(default_factory=list)  # pods whose network a netem container shapes
    log: list[str] = field(default_factory=list)


@dataclass
class KubernetesCampaign:
    api: client.ApiClient
    namespace: str
    catalogue: Catalogue
    stress_image: str = DEFAULT_STRESS_IMAGE
    stress_args: Callable[[Fault], list[str]] | None = None  # default: CPU stressors by the fault's factor
    netem_image: str = DEFAULT_NETEM_IMAGE
    allow_privileged: bool = False  # network faults: NET_ADMIN in the target's pods (module docstring)
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.executor = KubernetesExecutor(self.api, self.namespace, self.catalogue, manager="bmeg-faultinject")

    def run(self, faults: list[Fault]) -> list[Injected]:
        """Inject each fault at its start, undo it at its end (times in seconds from now)."""
        for fault in faults:
            if fault.source not in SUPPORTED_SOURCES:
                raise ValueError(f"fault on {fault.service}: {fault.source!r} faults are not supported on "
                                 f"Kubernetes by this backend (supported: {', '.join(SUPPORTED_SOURCES)})")
            if fault.source == "network" and fault.parameter("inbound"):
                raise ValueError(f"fault on {fault.service}: an inbound network delay needs a proxy in front of "
                                 "the service; this backend's tc netem delays what the pod sends (inbound: 0)")
            if fault.source in PRIVILEGED_SOURCES and not self.allow_privileged:
                raise ValueError(f"fault on {fault.service}: {fault.source!r} faults need NET_ADMIN as root in the "
                                 "target's pods (tc), beyond the restricted Pod Security profile; allow them "
                                 "explicitly (allow_privileged=True) in a namespace labelled "
                                 "pod-security.kubernetes.io/enforce=privileged")
        events = sorted([(f.start_s, 1, i) for i, f in enumerate(faults)] + [(f.end_s, 0, i) for i, f in enumerate(faults)])
        active: dict[int, Injected] = {}
        done: list[Injected] = []
        began = time.monotonic()
        with _sigterm_raises():
            try:
                for at, starts, index in events:
                    self.sleep(max(0.0, at - (time.monotonic() - began)))
                    if starts:
                        active[index] = self.inject(faults[index])
                    else:
                        injected = active.pop(index)
                        self.undo(injected)
                        done.append(injected)
            finally:
                for injected in active.values():
                    self.undo(injected)
        return done

    def inject(self, fault: Fault) -> Injected:
        injected = Injected(fault)
        try:
            if fault.source == "interference":
                injected.pods.append(self._interference_pod(fault))
                injected.log.append(f"created pod {injected.pods[-1]}")
            elif fault.source == "network":
                self._shape_network(fault, injected.shaped)
                injected.log.append(f"tc netem in pods {', '.join(injected.shaped)}")
            else:
                change = self._saturate(fault) if fault.source == "saturation" else self._misconfigure(fault)
                injected.changes.append(change)
                injected.log.append(f"{change.action} {change.previous} -> {change.new}")
        except BaseException:
            self.undo(injected)
            raise
        return injected

    def undo(self, injected: Injected) -> None:
        """Roll back the changes (newest first) and delete the pods; absent pods are fine."""
        for applied in reversed(injected.changes):
            self.executor.rollback(applied)
        injected.changes.clear()
        for name in injected.pods:
            try:
                self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
            except ApiException as error:
                if error.status != 404:
                    raise
        injected.pods.clear()
        for pod in injected.shaped:  # a netem container cannot be removed: one more clears its qdisc now
            try:
                self._add_ephemeral(pod, "bmeg-netem-undo", ["tc qdisc del dev eth0 root || true"])
            except ApiException as error:
                if error.status != 404:  # a pod gone took its qdisc with it
                    raise
        injected.shaped.clear()

    def _interference_pod(self, fault: Fault) -> str:
        deployment = self.apps.read_namespaced_deployment(fault.service, self.namespace)
        name = f"bmeg-interference-{fault.service}-{uuid.uuid4().hex[:6]}"[:63]
        duration = max(1, math.ceil(fault.end_s - fault.start_s))
        args = self.stress_args(fault) if self.stress_args else _cpu_stress(fault, duration)
        pod = interference_pod(name, fault.service, deployment.spec.selector.match_labels, self.stress_image, args,
                               duration, cpu_cores=_stress_workers(fault))
        self.core.create_namespaced_pod(self.namespace, pod)
        return name

    def _shape_network(self, fault: Fault, shaped: list[str]) -> None:
        """A netem container in each of the target's pods; each pod shaped is added to `shaped`
        at once, so a failure part way undoes those already shaped."""
        deployment = self.apps.read_namespaced_deployment(fault.service, self.namespace)
        selector = ",".join(f"{k}={v}" for k, v in deployment.spec.selector.match_labels.items())
        pods = [p.metadata.name for p in self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
                if p.metadata.deletion_timestamp is None]
        if not pods:
            raise ValueError(f"network fault on {fault.service}: it has no pods to shape")
        duration = max(1, math.ceil(fault.end_s - fault.start_s))
        script = f"tc qdisc replace dev eth0 root {netem_arguments(fault)} && sleep {duration}; tc qdisc del dev eth0 root"
        for pod in pods:
            self._add_ephemeral(pod, "bmeg-netem", [script])
            shaped.append(pod)

    def _add_ephemeral(self, pod: str, prefix: str, script: list[str]) -> None:
        current = self.core.read_namespaced_pod(pod, self.namespace).spec.ephemeral_containers or []
        container = {
            "name": f"{prefix}-{uuid.uuid4().hex[:6]}", "image": self.netem_image, "command": ["sh", "-c", *script],
            # tc changes the pod's network namespace: NET_ADMIN, as root (the opt-in of the module docstring)
            "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}},
        }
        body = {"spec": {"ephemeralContainers": [self.api.sanitize_for_serialization(c) for c in current] + [container]}}
        self.core.patch_namespaced_pod_ephemeralcontainers(pod, self.namespace, body)

    def _saturate(self, fault: Fault) -> Applied:
        capacity, replicas = fault.parameter("capacity"), fault.parameter("replicas")
        if replicas is not None:
            return self.executor.scale(fault.service, int(replicas))
        if capacity is None:
            raise ValueError(f"saturation on {fault.service}: a cluster's fault cuts the CPU limit to `capacity` "
                             "of itself; `quota` (relative to measured use) is the simulator's and the testbed's")
        state = self.executor.state(fault.service)
        if state.cpu_cores is None:
            raise ValueError(f"saturation on {fault.service}: its container has no CPU limit to shrink")
        return self.executor.set_resources(fault.service, cpu_cores=max(0.001, state.cpu_cores * capacity))

    def _misconfigure(self, fault: Fault) -> Applied:
        wanted = "pool_size" if fault.parameter("pool_size") is not None else "hit_ratio"
        parameters = [p for p in self.catalogue.parameters_for(fault.service).values() if p.simulator == wanted]
        if not parameters:
            raise ValueError(f"misconfiguration on {fault.service}: the catalogue has no parameter that "
                             f"acts as {wanted} for it")
        parameter = parameters[0]
        # a small pool is its size; a cache with a low hit ratio is the smallest allowed memory
        value = fault.parameter("pool_size") if wanted == "pool_size" else parameter.min
        return self.executor.set_parameter(fault.service, parameter, parameter.check(max(parameter.min, value)))


def interference_pod(name: str, target: str, target_labels: dict[str, str], image: str, args: list[str],
                     duration_s: int, cpu_cores: int) -> dict:
    """A stress pod beside the target's pods, under the restricted Pod Security profile; its
    CPU limit (and request: it is scheduled for what it burns) is the stress asked for."""
    next_to = {"labelSelector": {"matchLabels": target_labels}, "topologyKey": "kubernetes.io/hostname"}
    size = {"cpu": str(cpu_cores), "memory": STRESS_MEMORY}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {**INTERFERENCE_LABELS, "bmeg.io/target": target}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,  # a stressor needs no API access
            "activeDeadlineSeconds": duration_s + 30,  # the cluster ends it even if we cannot
            "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [next_to]}},
            "securityContext": {"runAsNonRoot": True, "runAsUser": NOBODY, "runAsGroup": NOBODY,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "stress", "image": image, "args": args,
                "resources": {"requests": size, "limits": size},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],  # stress-ng's scratch files
            }],
            "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}}],
        },
    }


def netem_arguments(fault: Fault) -> str:
    """`tc qdisc ... netem` arguments of a network fault: delay ± jitter, and a rate cap."""
    parts = ["netem"]
    delay = fault.parameter("delay_ms")
    if delay:
        parts += ["delay", f"{float(delay):g}ms", f"{float(fault.parameter('jitter_ms') or 0):g}ms"]
    rate = fault.parameter("bandwidth_kbit")
    if rate:
        parts += ["rate", f"{int(rate)}kbit"]
    return " ".join(parts)


def _stress_workers(fault: Fault) -> int:
    return max(1, math.ceil(fault.parameter("factor") or 1))


def _cpu_stress(fault: Fault, duration_s: int) -> list[str]:
    return ["--cpu", str(_stress_workers(fault)), "--timeout", f"{duration_s}s"]


@contextmanager
def _sigterm_raises():
    """Within the block SIGTERM raises `CampaignInterrupted` (so `finally` cleans up);
    SIGINT already raises KeyboardInterrupt. Only the main thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum, frame):
        raise CampaignInterrupted(f"signal {signum}: cleaning up the campaign")

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def app_deployments(topology: TopologySpec, image: str = "registry.invalid/bmeg/app:1") -> list[dict]:
    """One Deployment per service of the topology: its replicas and a CPU limit of its cores."""
    deployments = []
    for name, service in topology.services.items():
        labels = {"app": name}
        deployments.append({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "replicas": service.replicas,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": {"containers": [{
                    "name": name, "image": image,
                    "resources": {"limits": {"cpu": f"{round(service.cores * 1000)}m", "memory": "1Gi"}},
                }]}},
            },
        })
    return deployments
