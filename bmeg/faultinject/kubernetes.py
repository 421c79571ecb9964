"""The real-cluster backend of fault injection: a campaign of faults on Kubernetes.

- interference: a stress pod (stress-ng-like image, configurable) scheduled next to the
  target's pods by a required pod affinity to them, labelled `bmeg.io/role=interference`;
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
SUPPORTED_SOURCES = ("interference", "saturation", "misconfiguration")


class CampaignInterrupted(RuntimeError):
    """The campaign got SIGTERM; it cleaned up before this propagated."""


@dataclass
class Injected:
    """What one fault did, so it can be undone: changes to roll back and pods to delete
    (emptied once undone; `log` keeps what was done)."""

    fault: Fault
    changes: list[Applied] = field(default_factory=list)
    pods: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)


@dataclass
class KubernetesCampaign:
    api: client.ApiClient
    namespace: str
    catalogue: Catalogue
    stress_image: str = DEFAULT_STRESS_IMAGE
    stress_args: Callable[[Fault], list[str]] | None = None  # default: CPU stressors by the fault's factor
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

    def _interference_pod(self, fault: Fault) -> str:
        deployment = self.apps.read_namespaced_deployment(fault.service, self.namespace)
        next_to = {"labelSelector": {"matchLabels": deployment.spec.selector.match_labels},
                   "topologyKey": "kubernetes.io/hostname"}
        name = f"bmeg-interference-{fault.service}-{uuid.uuid4().hex[:6]}"[:63]
        duration = max(1, math.ceil(fault.end_s - fault.start_s))
        args = self.stress_args(fault) if self.stress_args else _cpu_stress(fault, duration)
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {**INTERFERENCE_LABELS, "bmeg.io/target": fault.service}},
            "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,  # a stressor needs no API access
                "activeDeadlineSeconds": duration + 30,  # the cluster ends it even if we cannot
                "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [next_to]}},
                "containers": [{"name": "stress", "image": self.stress_image, "args": args}],
            },
        }
        self.core.create_namespaced_pod(self.namespace, pod)
        return name

    def _saturate(self, fault: Fault) -> Applied:
        capacity, replicas = fault.parameter("capacity"), fault.parameter("replicas")
        if replicas is not None:
            return self.executor.scale(fault.service, int(replicas))
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


def _cpu_stress(fault: Fault, duration_s: int) -> list[str]:
    workers = max(1, math.ceil(fault.parameter("factor") or 1))
    return ["--cpu", str(workers), "--timeout", f"{duration_s}s"]


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
