"""The simulated application as something a controller can act on: `SimulatedApp`.

It runs the embedded simulator window by window (each window a fresh episode with a short
warm-up, so queues fill before measuring) under the scenario's faults, and implements the
`Executor` protocol: scaling, resources and parameters change the topology of later windows.
A controller's change overrides what a fault set, as on a cluster (raising a shrunk CPU limit
ends that saturation, restoring a pool size ends that misconfiguration, moving pods away
from a noisy neighbour ends that interference); scaling out leaves a fault on the replicas it
touches. Rollback restores the settings and the faults the change had overridden.

Telemetry per window, as a cluster's metrics would give it: replicas, CPU limit, utilization
(the CPU the window's requests asked for over the CPU the limit allows; a neighbour's stolen
cycles are not charged to the container, so interference does not raise it), per-replica p95
and the current values of catalogued parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from bmeg.faultinject import Fault, Thresholds, TopologySpec, episode_tables, label_episode, simulate
from bmeg.graphs import assemble, node_services
from bmeg.graphs.features import self_time_ns
from bmeg.cluster.catalogue import Catalogue, Parameter
from bmeg.cluster.executor import ActionError, Applied, ServiceState
from bmeg.mitigation.planner import ServiceTelemetry
from bmeg.mitigation.safety import Latencies

WARMUP_S = 1.0
PROBE_REPLICAS = 3  # probe windows per candidate value
PROBE_S = 1.0  # seconds measured per probe window


@dataclass
class Window:
    start_s: float
    end_s: float
    spans: pa.Table
    trace_latency_ms: np.ndarray
    anomalous_truth: np.ndarray  # per trace: the simulator's ground-truth label
    latencies: Latencies
    telemetry: dict[str, ServiceTelemetry]
    service_latency: pd.DataFrame  # per (trace, service): exclusive time in µs
    #: traces begun in the window that have not finished (`bmeg.mitigation.inflight.open_traces`,
    #: with their lower-bound `latency_ms`), where spans arrive live; None on the simulator
    open_traces: pd.DataFrame | None = None

    @property
    def p95_ms(self) -> float:
        return float(np.quantile(self.trace_latency_ms, 0.95)) if len(self.trace_latency_ms) else float("nan")


def span_frame(spans: pa.Table) -> pd.DataFrame:
    """Exclusive time per span, by service and replica. The gap between a client span and
    its server span (queueing at the callee, and the network) counts as the callee's: a
    pool too small makes its callers wait, and the wait is the callee's fault."""
    forest = assemble(spans, on_bad_trace="drop")
    service = node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False).copy()
    instance = forest.spans["instance"].to_numpy(zero_copy_only=False).copy()
    kind = forest.spans["kind"].to_numpy(zero_copy_only=False)
    parent = forest.parent
    served = np.flatnonzero((parent >= 0) & (kind == "server"))
    served = served[kind[parent[served]] == "client"]
    service[parent[served]] = service[served]
    instance[parent[served]] = instance[served]
    return pd.DataFrame({"trace": forest.trace_index, "service": service, "instance": instance,
                         "us": self_time_ns(forest) / 1e3})


def per_trace_service(per_span: pd.DataFrame) -> pd.DataFrame:
    """Per (trace, service): the service's exclusive time in the trace (µs)."""
    return per_span.groupby(["trace", "service"], sort=False)["us"].sum().rename("us").reset_index()


def window_latencies(trace_latency_ms: np.ndarray, service_latency: pd.DataFrame) -> Latencies:
    """The application's p95 and each service's p95 exclusive time (ms) over a window."""
    p95 = service_latency.groupby("service")["us"].quantile(0.95) / 1e3
    return Latencies(float(np.quantile(trace_latency_ms, 0.95)) if len(trace_latency_ms) else 0.0, p95.to_dict())


@dataclass
class Setting:
    replicas: int
    cores: float
    workers: int
    hit_ratio: float | None = None  # a cache's configured hit ratio: None = the topology's


@dataclass
class SimulatedApp:
    topology: TopologySpec
    faults: list[Fault]
    catalogue: Catalogue
    thresholds: Thresholds
    seed: int = 0
    settings: dict[str, Setting] = field(default_factory=dict)
    overridden: dict[int, float] = field(default_factory=dict)  # fault index -> time the controller ended it
    now: float = 0.0
    _undo: dict[int, list[int]] = field(default_factory=dict)  # id(Applied) -> faults it overrode

    def __post_init__(self) -> None:
        for name, spec in self.topology.services.items():
            self.settings.setdefault(name, Setting(spec.replicas, spec.cores, spec.workers))

    # ---- running ------------------------------------------------------------------------
    def run_window(self, start_s: float, end_s: float) -> Window:
        """Simulate [start_s, end_s) under the current settings and the faults active then;
        afterwards the app's clock stands at end_s, when the controller acts."""
        length = end_s - start_s
        faults = self._window_faults(start_s, end_s)
        seed = np.random.SeedSequence([self.seed, int(start_s * 1000)])
        result = simulate(self._topology(), faults, WARMUP_S + length, seed)
        labels = label_episode(result, self.thresholds)
        keep = np.flatnonzero(result.trace_start >= WARMUP_S * 1e9)
        tables = episode_tables(result, labels, keep, episode=0, epoch_ns=int((start_s - WARMUP_S) * 1e9),
                                rng=np.random.default_rng(seed.spawn(1)[0]))
        latency_ms = (result.trace_end[keep] - result.trace_start[keep]) / 1e6
        per_span = span_frame(tables.spans)
        service_latency = per_trace_service(per_span)
        latencies = window_latencies(latency_ms, service_latency)
        self.now = end_s
        return Window(start_s, end_s, tables.spans, latency_ms, labels.trace_anomalous[keep], latencies,
                      self._telemetry(result, keep, per_span, length, faults), service_latency)

    def _topology(self) -> TopologySpec:
        topology = self.topology.model_copy(deep=True)
        for name, setting in self.settings.items():
            service = topology.services[name]
            service.replicas, service.cores, service.workers = setting.replicas, setting.cores, setting.workers
        return topology

    def _window_faults(self, start_s: float, end_s: float) -> list[Fault]:
        """Faults in window time (the warm-up first); those the controller overrode are gone."""
        shifted = []
        for index, fault in enumerate(self.faults):
            if index in self.overridden:
                continue
            begin = max(fault.start_s - start_s + WARMUP_S, 0.0)
            end = min(fault.end_s, end_s) - start_s + WARMUP_S
            if end > begin:
                shifted.append(Fault(fault.service, fault.source, fault.kind, begin, end, dict(fault.parameters)))
        return shifted

    def _telemetry(self, result, keep: np.ndarray, per_span: pd.DataFrame, length_s: float,
                   faults: list[Fault]) -> dict[str, ServiceTelemetry]:
        active = [f for f in faults if f.start_s < WARMUP_S + length_s]
        demand = self._cpu_demand_s(result, keep)
        per_replica_p95 = per_span.groupby(["service", "instance"])["us"].quantile(0.95) / 1e3
        telemetry = {}
        for name, setting in self.settings.items():
            cores = self._effective_cores(name, setting, active)
            utilization = min(1.0, demand.get(name, 0.0) / (length_s * cores * setting.replicas))
            p95 = per_replica_p95.loc[name].tolist() if name in per_replica_p95.index.get_level_values(0) else None
            telemetry[name] = ServiceTelemetry(replicas=setting.replicas, cpu_utilization=utilization,
                                               cpu_limit_cores=cores, parameters=self._parameters(name, setting, active),
                                               replica_p95_ms=p95)
        return telemetry

    def _cpu_demand_s(self, result, keep: np.ndarray) -> dict[str, float]:
        """CPU seconds each service was asked for by the window's traces: visits times the
        operation's mean work. A neighbour's stolen cycles are not charged to the container."""
        kept = np.zeros(len(result.trace_start), dtype=bool)
        kept[keep] = True
        visits = result.visit_key[kept[result.span_trace[result.visit_span]]]
        counts = np.bincount(visits, minlength=len(result.op_keys))
        demand: dict[str, float] = {}
        for key, count in zip(result.op_keys, counts.tolist()):
            service, _, operation = self.topology.operation(key)
            mu, sigma = operation.self_time.log_params_ns()
            demand[service] = demand.get(service, 0.0) + count * float(np.exp(mu + sigma**2 / 2)) / 1e9
        return demand

    def _effective_cores(self, service: str, setting: Setting, active: list[Fault]) -> float:
        for fault in active:
            if fault.service == service and fault.source == "saturation" and fault.parameter("capacity") is not None:
                return setting.cores * fault.parameter("capacity")
        return setting.cores

    def _parameters(self, service: str, setting: Setting, active: list[Fault]) -> dict[str, float | str]:
        values: dict[str, float | str] = {}
        for parameter in self.catalogue.parameters_for(service).values():
            if parameter.simulator == "pool_size":
                pool = next((f.parameter("pool_size") for f in active if f.service == service
                             and f.source == "misconfiguration" and f.parameter("pool_size") is not None), None)
                values[parameter.name] = float(pool if pool is not None else setting.workers)
            elif parameter.simulator == "hit_ratio":
                small = any(f.service == service and f.source == "misconfiguration" and f.parameter("hit_ratio") is not None
                            for f in active)
                values[parameter.name] = float(parameter.min if small else parameter.default)
        return values

    # ---- the Executor protocol ----------------------------------------------------------
    def state(self, service: str) -> ServiceState:
        setting = self._setting(service)
        return ServiceState(service, setting.replicas, setting.cores, None,
                            self._parameters(service, setting, self._active_now()))

    def probe(self, service: str, parameter: Parameter, value: float, replicas: int = PROBE_REPLICAS,
              length_s: float = PROBE_S) -> list[float]:
        """The application's p95 (ms) in `replicas` short windows from now (seeds apart, standing
        for the replicas TUNA measures on) with the parameter at `value`; nothing is changed."""
        if parameter.simulator != "pool_size":
            raise ActionError(f"the simulator cannot probe {service}'s {parameter.name}")
        self._setting(service)  # a clear error for an unknown service
        topology = self._topology()
        topology.services[service].workers = int(parameter.check(value))
        faults = [f for f in self._window_faults(self.now, self.now + length_s)
                  if not (f.service == service and f.source == "misconfiguration" and f.parameter("pool_size") is not None)]
        p95 = []
        for replica in range(replicas):
            seed = np.random.SeedSequence([self.seed, int(self.now * 1000), int(value), replica])
            result = simulate(topology, faults, WARMUP_S + length_s, seed)
            keep = result.trace_start >= WARMUP_S * 1e9
            p95.append(float(np.quantile((result.trace_end[keep] - result.trace_start[keep]) / 1e6, 0.95)))
        return p95

    def scale(self, service: str, replicas: int) -> Applied:
        setting = self._setting(service)
        applied = Applied(service, "scale", {"replicas": setting.replicas}, {"replicas": int(replicas)})
        setting.replicas = int(replicas)
        return self._override(applied, "saturation", "replicas")

    def set_resources(self, service: str, *, cpu_cores: float | None = None, memory_mb: float | None = None) -> Applied:
        if cpu_cores is None:
            raise ActionError("the simulator models CPU only; memory limits do not apply")
        setting = self._setting(service)
        applied = Applied(service, "resources", {"cpu_cores": setting.cores}, {"cpu_cores": float(cpu_cores)})
        setting.cores = float(cpu_cores)
        return self._override(applied, "saturation", "capacity")

    def set_parameter(self, service: str, parameter: Parameter, value: float | str) -> Applied:
        value = parameter.check(value)
        setting = self._setting(service)
        if parameter.simulator == "pool_size":
            effective = self._parameters(service, setting, self._active_now())[parameter.name]  # what a fault set, if any
            applied = Applied(service, "parameter", {parameter.name: effective}, {parameter.name: value}, parameter)
            setting.workers = int(value)
            return self._override(applied, "misconfiguration", "pool_size")
        if parameter.simulator == "hit_ratio":
            applied = Applied(service, "parameter", {parameter.name: None}, {parameter.name: value}, parameter)
            return self._override(applied, "misconfiguration", "hit_ratio")
        raise ActionError(f"the simulator does not model {service}'s {parameter.name}")

    def migrate(self, service: str) -> Applied:
        return self._override(Applied(service, "migrate", {"migrated": False}, {"migrated": True}), "interference", None)

    def rollback(self, applied: Applied) -> Applied:
        setting = self._setting(applied.service)
        if applied.action == "scale":
            setting.replicas = int(applied.previous["replicas"])
        elif applied.action == "resources":
            setting.cores = float(applied.previous["cpu_cores"])
        undone = self._undo.pop(id(applied), [])
        if applied.action == "parameter" and applied.parameter.simulator == "pool_size":
            # the configured pool comes back; a fault it had overridden sets its own again
            setting.workers = self.topology.services[applied.service].workers if undone else int(applied.previous[applied.parameter.name])
        for index in undone:
            self.overridden.pop(index, None)
        return Applied(applied.service, applied.action, dict(applied.new), dict(applied.previous), applied.parameter)

    def _active_now(self) -> list[Fault]:
        return [f for i, f in enumerate(self.faults) if f.start_s <= self.now < f.end_s and i not in self.overridden]

    def _setting(self, service: str) -> Setting:
        if service not in self.settings:
            raise ActionError(f"no service {service!r} in the simulated {self.topology.name}")
        return self.settings[service]

    def _override(self, applied: Applied, source: str, parameter: str | None) -> Applied:
        """End the faults active now on the service that this change undoes."""
        ended = [i for i, f in enumerate(self.faults)
                 if f.service == applied.service and f.source == source and i not in self.overridden
                 and f.start_s <= self.now < f.end_s and (parameter is None or f.parameter(parameter) is not None)]
        for index in ended:
            self.overridden[index] = self.now
        self._undo[id(applied)] = ended
        return applied
