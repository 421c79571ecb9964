"""A randomised family of synthetic applications: seeded `TopologySpec`s of random shape.

A model trained on one application learns that application (its large orchestrators, its
usual paths); trained on many random ones it can only learn what a fault does to a trace.
`random_topology(seed, params)` draws one application in the project's one topology format
(`bmeg.faultinject.spec`), so the simulator, the fault campaigns and the code faults run on it
unchanged:

- **Services** (`params.services`, drawn uniformly) of which a share (`params.store_share`)
  are stores (MongoDB, Redis, memcached, MySQL: no server spans, called by client spans) and
  the rest application services placed on `depth` levels (level 0: the entry services, whose
  operations are the request types; the mix weights drawn at random). Every level holds at
  least one service, so the deepest call chain is `depth` services long.
- **Operations**: each application service has `params.operations` of them; every operation
  below level 0 is called by at least one operation one level up (so every operation is
  reached and the depth is met), and each operation calls `params.fan_out` targets in all,
  the extra ones drawn from any deeper level (skip-level calls, shared callees).
- **Stores**: every store operation is called by some application operation; a share
  (`params.cache_share`) of store calls go through a cache (a `cache` step whose miss calls a
  database), the rest are plain calls.
- **Calls**: an operation's calls are cut into stages; a stage holds one call or several
  started together (`parallel`, each call joining the previous one's stage with probability
  `params.parallel_share`). A share of operations (`params.branch_share`) vary their calls
  between requests: a `branch` of the full call list and a random part of it.
- **Capacity**: self times are lognormal, medians drawn log-uniformly over
  `params.self_time_us`; each service gets `params.replicas` replicas and the cores that keep
  each replica's utilisation near a drawn target (`params.utilisation`) at the drawn request
  rate, from the expected visits per request (branch and cache-miss shares included), so a
  fault-free application is not saturated and a fault has headroom to eat.

The spec format has no asynchronous (fire-and-forget) call, so the family has none either:
calls are synchronous, sequential or parallel. Names carry the spec's name as a prefix, so
the services of different family members never share a name (a dataset of several members
keeps their per-operation baselines apart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bmeg.faultinject.spec import (
    BranchOption,
    BranchStep,
    CacheStep,
    CallStep,
    Latency,
    Operation,
    ParallelStep,
    Request,
    Service,
    Step,
    TopologySpec,
    Workload,
    split_target,
    walk_calls,
)

STORE_SYSTEMS = ("mongodb", "redis", "mysql")
CACHE_SYSTEM = "memcached"


@dataclass(frozen=True)
class FamilyParams:
    """The ranges a family member is drawn from (inclusive integer ranges, float ranges)."""

    services: tuple[int, int] = (5, 25)
    depth: tuple[int, int] = (2, 6)
    fan_out: tuple[int, int] = (1, 3)
    operations: tuple[int, int] = (1, 2)
    replicas: tuple[int, int] = (1, 3)
    store_share: float = 0.25
    cache_share: float = 0.4
    parallel_share: float = 0.4
    branch_share: float = 0.3
    self_time_us: tuple[float, float] = (30.0, 3000.0)
    sigma: tuple[float, float] = (0.2, 0.8)
    rate: tuple[float, float] = (100.0, 500.0)
    utilisation: tuple[float, float] = (0.15, 0.45)

    def __post_init__(self) -> None:
        for name in ("services", "depth", "fan_out", "operations", "replicas", "self_time_us", "sigma", "rate",
                     "utilisation"):
            low, high = getattr(self, name)
            if low > high:
                raise ValueError(f"{name}: the range ({low}, {high}) is empty")
        if self.services[0] < 2:
            raise ValueError(f"services: an application needs at least 2 services, not {self.services[0]}")
        if min(self.depth[0], self.fan_out[0], self.operations[0], self.replicas[0]) < 1:
            raise ValueError("depth, fan_out, operations and replicas must be at least 1")
        for name in ("store_share", "cache_share", "parallel_share", "branch_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], not {getattr(self, name)}")
        if self.self_time_us[0] <= 0 or self.sigma[0] < 0 or self.rate[0] <= 0:
            raise ValueError("self_time_us and rate must be positive, sigma not negative")
        if not (0 < self.utilisation[0] and self.utilisation[1] < 1):
            raise ValueError(f"utilisation must lie in (0, 1), not {self.utilisation}")


def random_topology(seed: int, params: FamilyParams = FamilyParams(), name: str | None = None) -> TopologySpec:
    """One family member, the same for the same seed and params."""
    rng = np.random.default_rng(seed)
    name = name or f"family{seed}"
    total = int(rng.integers(params.services[0], params.services[1] + 1))
    stores = min(int(round(total * params.store_share)), total - 2)
    apps = total - stores
    depth = min(int(rng.integers(params.depth[0], params.depth[1] + 1)), apps)
    levels = _levels(apps, depth, rng)
    targets: list[list[str]] = [[] for _ in range(depth)]  # operation targets per level
    for index, level in enumerate(levels):
        service = f"{name}-svc{index}"
        for number in range(int(rng.integers(params.operations[0], params.operations[1] + 1))):
            targets[level].append(f"{service}:op{number}")
    store_targets = [f"{name}-store{index}:{op}" for index in range(stores)
                     for op in _store_operations(rng)]
    callees = _callees(targets, params, rng)
    steps = _attach_stores(callees, store_targets, params, rng)
    operations = {target: _operation(steps[target], params, rng) for level in targets for target in level}
    store_ops = {target: Operation(self_time=_latency(params, rng)) for target in store_targets}
    requests = {f"request{number}": Request(entry=target, weight=float(rng.uniform(0.2, 1.0)))
                for number, target in enumerate(targets[0])}
    rate = float(math.exp(rng.uniform(*np.log(params.rate))))
    spec = TopologySpec(
        name=name, description=f"random family member (seed {seed}): {apps} services on {depth} levels, {stores} stores",
        workload=Workload(rate=rate), requests=requests,
        services=_services({**operations, **store_ops}, _storage_systems(store_targets, steps, rng), params, rng),
    )
    return _with_capacity(spec, params, rng)


def _levels(apps: int, depth: int, rng: np.random.Generator) -> list[int]:
    """A level per application service: every level used, level 0 holding one or two entries."""
    entries = 1 if apps - depth < 2 else int(rng.integers(1, 3))
    levels = list(range(depth)) + [0] * (entries - 1)
    levels += rng.integers(1, depth, size=apps - len(levels)).tolist() if depth > 1 else [0] * (apps - len(levels))
    return sorted(levels)


def _store_operations(rng: np.random.Generator) -> list[str]:
    return ["get"] if rng.random() < 0.5 else ["get", "set"]


def _callees(targets: list[list[str]], params: FamilyParams, rng: np.random.Generator) -> dict[str, list[str]]:
    """Each operation's callees: every operation below level 0 gets a caller one level up, then
    each caller is topped up to its drawn fan-out from any deeper level."""
    callees: dict[str, list[str]] = {target: [] for level in targets for target in level}
    for level in range(1, len(targets)):
        for target in targets[level]:
            caller = targets[level - 1][int(rng.integers(len(targets[level - 1])))]
            callees[caller].append(target)
    for level, ops in enumerate(targets):
        deeper = [target for lower in targets[level + 1:] for target in lower]
        for target in ops:
            want = int(rng.integers(params.fan_out[0], params.fan_out[1] + 1))
            spare = [callee for callee in deeper if callee not in callees[target]
                     and split_target(callee)[0] not in {split_target(c)[0] for c in callees[target]}]
            extra = max(0, min(want - len(callees[target]), len(spare)))
            callees[target] += [spare[i] for i in rng.choice(len(spare), size=extra, replace=False)] if extra else []
    return callees


def _attach_stores(callees: dict[str, list[str]], store_targets: list[str], params: FamilyParams,
                   rng: np.random.Generator) -> dict[str, list[Step]]:
    """The operations' call lists as steps, each store operation called by a random caller
    (through a cache, a memcached `get`, for a `cache_share` of them)."""
    steps: dict[str, list[Step]] = {target: [CallStep(call=callee) for callee in called]
                                    for target, called in callees.items()}
    callers = list(callees)
    for target in store_targets:
        caller = callers[int(rng.integers(len(callers)))]
        if rng.random() < params.cache_share:
            cache = f"{split_target(target)[0]}-cache:get"
            steps[caller].append(CacheStep(cache=cache, hit_ratio=float(rng.uniform(0.5, 0.98)),
                                           on_miss=[CallStep(call=target)]))
        else:
            steps[caller].append(CallStep(call=target))
    for target in steps:
        order = rng.permutation(len(steps[target]))
        steps[target] = [steps[target][i] for i in order]
    return steps


def _operation(calls: list[Step], params: FamilyParams, rng: np.random.Generator) -> Operation:
    staged = _stages(calls, params.parallel_share, rng)
    if len(calls) > 1 and rng.random() < params.branch_share:
        keep = np.sort(rng.choice(len(calls), size=int(rng.integers(1, len(calls))), replace=False))
        part = _stages([calls[i] for i in keep], params.parallel_share, rng)
        p = float(rng.uniform(0.3, 0.9))
        staged = [BranchStep(branch=[BranchOption(p=p, steps=staged), BranchOption(p=1.0 - p, steps=part)])]
    return Operation(self_time=_latency(params, rng), calls=staged,
                     response_bytes=int(math.exp(rng.uniform(math.log(128), math.log(16384)))))


def _stages(calls: list[Step], parallel_share: float, rng: np.random.Generator) -> list[Step]:
    """Calls cut into stages: each joins the previous call's stage with `parallel_share`."""
    stages: list[list[Step]] = []
    for call in calls:
        if stages and rng.random() < parallel_share:
            stages[-1].append(call)
        else:
            stages.append([call])
    return [stage[0] if len(stage) == 1 else ParallelStep(parallel=stage) for stage in stages]


def _latency(params: FamilyParams, rng: np.random.Generator) -> Latency:
    median = math.exp(rng.uniform(*np.log(params.self_time_us)))
    return Latency(median_us=median, sigma=float(rng.uniform(*params.sigma)))


def _storage_systems(store_targets: list[str], steps: dict[str, list[Step]], rng: np.random.Generator) -> dict[str, str]:
    """The db_system of every store service, caches included (those named by a cache step)."""
    systems = {split_target(target)[0]: STORE_SYSTEMS[int(rng.integers(len(STORE_SYSTEMS)))] for target in store_targets}
    for called in steps.values():
        for _, step in walk_calls(called, ""):
            if isinstance(step, CacheStep):
                systems[split_target(step.cache)[0]] = CACHE_SYSTEM
    return systems


def _services(operations: dict[str, Operation], storage: dict[str, str], params: FamilyParams,
              rng: np.random.Generator) -> dict[str, Service]:
    grouped: dict[str, dict[str, Operation]] = {}
    for target, operation in operations.items():
        service, op = split_target(target)
        grouped.setdefault(service, {})[op] = operation
    for service, system in storage.items():
        if system == CACHE_SYSTEM:
            grouped.setdefault(service, {"get": Operation(self_time=_latency(params, rng))})
    return {service: Service(replicas=int(rng.integers(params.replicas[0], params.replicas[1] + 1)),
                             workers=int(rng.choice([16, 32, 64, 128])), storage=storage.get(service), operations=ops)
            for service, ops in grouped.items()}


def expected_visits(spec: TopologySpec) -> dict[str, float]:
    """Expected executions of each `service:operation` per request of the spec's mix."""
    visits: dict[str, float] = {}
    total = sum(request.weight for request in spec.requests.values())

    def visit(target: str, times: float) -> None:
        visits[target] = visits.get(target, 0.0) + times
        _, _, operation = spec.operation(target)
        walk(operation.calls, times)

    def walk(steps: list[Step], times: float) -> None:
        for step in steps:
            if isinstance(step, CallStep):
                visit(step.call, times)
            elif isinstance(step, CacheStep):
                visit(step.cache, times)
                walk(step.on_miss, times * (1.0 - step.hit_ratio))
            elif isinstance(step, ParallelStep):
                walk(step.parallel, times)
            elif isinstance(step, BranchStep):
                for option in step.branch:
                    walk(option.steps, times * option.p)
            else:
                walk(step.sequence, times)

    for request in spec.requests.values():
        visit(request.entry, request.weight / total)
    return visits


def _with_capacity(spec: TopologySpec, params: FamilyParams, rng: np.random.Generator) -> TopologySpec:
    """Cores per replica that keep each service near a drawn utilisation at the spec's rate."""
    busy: dict[str, float] = {}
    for target, times in expected_visits(spec).items():
        service, _, operation = spec.operation(target)
        mu, sigma = operation.self_time.log_params_ns()
        busy[service] = busy.get(service, 0.0) + times * math.exp(mu + sigma**2 / 2) / 1e9 * spec.workload.rate
    services = {}
    for name, member in spec.services.items():
        utilisation = float(rng.uniform(*params.utilisation))
        cores = max(1.0, math.ceil(busy.get(name, 0.0) / member.replicas / utilisation * 4) / 4)
        services[name] = member.model_copy(update={"cores": cores})
    return spec.model_copy(update={"services": services})
