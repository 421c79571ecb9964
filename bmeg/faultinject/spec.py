"""Topology specs: the services of an application, their capacity, and what each request calls.

One YAML format, written by hand (`bmeg/faultinject/topologies/*.yaml`) or from code (a twin fitter builds a
`TopologySpec` and calls `.to_yaml()`). The format is described in `bmeg/faultinject/topologies/README.md`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from bmeg.faultinject.errors import SpecError
from bmeg.paths import shipped_file, shipped_names

#: z-score of the 99th percentile of a standard normal: turns (median, p99) into a lognormal.
Z99 = 2.3263478740408408


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Latency(_Strict):
    """A lognormal time in microseconds, given by its median and either its p99 or sigma."""

    median_us: float = Field(gt=0)
    p99_us: float | None = Field(default=None, gt=0)
    sigma: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_spread(self) -> Latency:
        if (self.p99_us is None) == (self.sigma is None):
            raise ValueError("give exactly one of p99_us or sigma")
        if self.p99_us is not None and self.p99_us < self.median_us:
            raise ValueError(f"p99_us {self.p99_us} is below median_us {self.median_us}")
        return self

    def log_params_ns(self) -> tuple[float, float]:
        """(mu, sigma) of the lognormal in nanoseconds."""
        mu = math.log(self.median_us * 1e3)
        if self.sigma is not None:
            return mu, self.sigma
        assert self.p99_us is not None  # the validator lets exactly one of them through
        return mu, math.log(self.p99_us / self.median_us) / Z99

    def p99_ns(self) -> float:
        mu, sigma = self.log_params_ns()
        return math.exp(mu + Z99 * sigma)


class CallStep(_Strict):
    """An RPC (or storage call) to `service:operation`; `client` names the caller's client span."""

    call: str
    client: str | None = None
    timeout_ms: float | None = Field(default=None, gt=0)


class CacheStep(_Strict):
    """A cache lookup; with probability 1 - hit_ratio it misses and runs `on_miss` (e.g. MongoDB)."""

    cache: str
    client: str | None = None
    hit_ratio: float = Field(ge=0, le=1)
    on_miss: list[Step] = Field(default_factory=list)


class ParallelStep(_Strict):
    """Children that start together; the step ends when the last one returns."""

    parallel: list[Step] = Field(min_length=1)


class SequenceStep(_Strict):
    """Children one after another (useful inside `parallel`)."""

    sequence: list[Step] = Field(min_length=1)


class BranchOption(_Strict):
    p: float = Field(gt=0, le=1)
    steps: list[Step] = Field(default_factory=list)


class BranchStep(_Strict):
    """One of several step lists, chosen at random with probabilities `p` (summing to 1)."""

    branch: list[BranchOption] = Field(min_length=1)

    @model_validator(mode="after")
    def _sums_to_one(self) -> BranchStep:
        total = sum(option.p for option in self.branch)
        if abs(total - 1) > 1e-6:
            raise ValueError(f"branch probabilities sum to {total}, not 1")
        return self


_STEP_KEYS = ("call", "cache", "parallel", "sequence", "branch")


def _step_kind(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, dict):
        for key in _STEP_KEYS:
            if key in value:
                return key
    return None


Step = Annotated[
    Annotated[CallStep, Tag("call")] | Annotated[CacheStep, Tag("cache")] | Annotated[ParallelStep, Tag("parallel")] | Annotated[SequenceStep, Tag("sequence")] | Annotated[BranchStep, Tag("branch")],
    Discriminator(
        _step_kind,
        custom_error_type="unknown_step",
        custom_error_message=f"a step needs one of the keys {', '.join(_STEP_KEYS)}",
    ),
]
for _model in (CacheStep, ParallelStep, SequenceStep, BranchOption, BranchStep):
    _model.model_rebuild()


class Operation(_Strict):
    """One operation (the server span's name): its own CPU work and the steps it calls."""

    self_time: Latency
    calls: list[Step] = Field(default_factory=list)
    response_bytes: int = Field(default=1024, gt=0)


class Service(_Strict):
    """A microservice (or a store, when `storage` names its db_system) and its capacity per replica."""

    replicas: int = Field(default=1, ge=1)
    cores: float = Field(default=1.0, gt=0)
    workers: int = Field(default=16, ge=1, description="worker/thread pool (connections for a store)")
    queue: int = Field(default=1024, ge=0, description="requests that may wait for a worker")
    storage: str | None = Field(default=None, description="db_system of a store: no server spans")
    operations: dict[str, Operation] = Field(min_length=1)


class Request(_Strict):
    """A request type: the operation wrk2 hits, and its share of the mix."""

    entry: str
    weight: float = Field(gt=0)


class Workload(_Strict):
    """Open-loop load like wrk2: `rate` requests per second, Poisson or evenly spaced."""

    rate: float = Field(gt=0)
    arrivals: Literal["poisson", "constant"] = "poisson"


class Network(_Strict):
    latency: Latency = Latency(median_us=40, p99_us=150)
    request_bytes: int = Field(default=512, gt=0)


class TopologySpec(_Strict):
    name: str
    description: str = ""
    workload: Workload
    network: Network = Network()
    cpu_waits: Literal["at-wakeup"] | None = Field(
        default=None, description="at-wakeup: a replica's wait for a core delays what its process stamps when it "
        "runs: a server span's start (its handler's first burst) and a client span's end (the answer read), and a "
        "burst no longer than a CPU hog's slice runs to its end once started (as the testbed's CPU faults show; "
        "`bmeg.faultinject.simulator`; what `fit_twin` sets); unset (the default): the wait lands inside the span")
    requests: dict[str, Request] = Field(min_length=1)
    services: dict[str, Service] = Field(min_length=1)

    @model_validator(mode="after")
    def _references_resolve(self) -> TopologySpec:
        problems = list(_reference_problems(self))
        if not problems:
            problems = list(_cycle_problems(self))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def operation(self, target: str) -> tuple[str, str, Operation]:
        service, operation = split_target(target)
        return service, operation, self.services[service].operations[operation]

    def code_services(self) -> list[str]:
        """The services that run the application's code, sorted: every service but the stores."""
        return sorted(name for name, service in self.services.items() if service.storage is None)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


def split_target(target: str) -> tuple[str, str]:
    service, _, operation = target.partition(":")
    return service, operation


def walk_calls(steps: list[Step], path: str):
    """Yield (path, step) for every call and cache step in a step list, depth first."""
    for index, step in enumerate(steps):
        here = f"{path}[{index}]"
        if isinstance(step, CallStep):
            yield here, step
        elif isinstance(step, CacheStep):
            yield here, step
            yield from walk_calls(step.on_miss, f"{here}.on_miss")
        elif isinstance(step, ParallelStep):
            yield from walk_calls(step.parallel, f"{here}.parallel")
        elif isinstance(step, SequenceStep):
            yield from walk_calls(step.sequence, f"{here}.sequence")
        else:
            for number, option in enumerate(step.branch):
                yield from walk_calls(option.steps, f"{here}.branch[{number}].steps")


def step_target(step: CallStep | CacheStep) -> str:
    return step.call if isinstance(step, CallStep) else step.cache


def _target_problem(spec: TopologySpec, target: str, path: str) -> str | None:
    service, operation = split_target(target)
    if service not in spec.services:
        return f"{path}: unknown service {service!r} (known: {', '.join(sorted(spec.services))})"
    if operation not in spec.services[service].operations:
        known = ", ".join(sorted(spec.services[service].operations))
        return f"{path}: service {service!r} has no operation {operation!r} (known: {known})"
    return None


def _reference_problems(spec: TopologySpec):
    for name, request in spec.requests.items():
        problem = _target_problem(spec, request.entry, f"requests.{name}.entry")
        if problem:
            yield problem
        elif spec.services[split_target(request.entry)[0]].storage:
            yield f"requests.{name}.entry: a store cannot be an entry point"
    for service_name, service in spec.services.items():
        for op_name, operation in service.operations.items():
            where = f"services.{service_name}.operations.{op_name}.calls"
            if service.storage and operation.calls:
                yield f"{where}: a store ({service.storage}) makes no calls"
            for path, step in walk_calls(operation.calls, where):
                problem = _target_problem(spec, step_target(step), path)
                if problem:
                    yield problem


def _cycle_problems(spec: TopologySpec):
    """A trace is a DAG: no operation may (transitively) call itself."""
    done: set[str] = set()

    def visit(target: str, stack: list[str]):
        if target in stack:
            yield "call cycle: " + " -> ".join(stack[stack.index(target) :] + [target])
            return
        if target in done:
            return
        _, _, operation = spec.operation(target)
        for _, step in walk_calls(operation.calls, ""):
            yield from visit(step_target(step), stack + [target])
        done.add(target)

    for request in spec.requests.values():
        yield from visit(request.entry, [])


def parse_topology(data: Any, source: str = "topology spec") -> TopologySpec:
    try:
        return TopologySpec.model_validate(data)
    except ValidationError as error:
        raise SpecError.from_validation(error, source, _STEP_KEYS) from None


def read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise SpecError(f"{path} is not valid YAML: {error}") from None


def shipped_path(name_or_path: str | Path, folder: str, what: str) -> Path:
    """A file path as given, or the `<folder>/<name>.yaml` shipped in `bmeg.faultinject`."""
    path = shipped_file(name_or_path, "bmeg.faultinject", folder)
    if path is None:
        known = shipped_names("bmeg.faultinject", folder)
        raise SpecError(f"no {what} {str(name_or_path)!r}: not a file, and not one of {known}")
    return path


def topology_path(name_or_path: str | Path) -> Path:
    """A file path as given, or the shipped spec `bmeg/faultinject/topologies/<name>.yaml`."""
    return shipped_path(name_or_path, "topologies", "topology")


def load_topology(name_or_path: str | Path) -> TopologySpec:
    path = topology_path(name_or_path)
    return parse_topology(read_yaml(path), str(path))
