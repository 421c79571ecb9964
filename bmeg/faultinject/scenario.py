"""Fault scenarios: which services misbehave, how, and when, for one simulated episode.

A scenario file (`bmeg/faultinject/campaigns/*.yaml`, or the user's own) lists explicit faults, a FIRM-like random campaign
(a new round every `every_s`, bursts of `burst_s`, random targets and intensities), or both.
`plan_faults` turns it into concrete `Fault`s for a topology, checking every name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bmeg.faultinject.errors import SpecError
from bmeg.faultinject.spec import (
    CacheStep,
    TopologySpec,
    read_yaml,
    shipped_path,
    split_target,
    step_target,
    walk_calls,
)

Source = Literal["interference", "saturation", "network", "misconfiguration", "background"]
Kind = Literal["single", "multiple", "cascading"]
SOURCES: tuple[str, ...] = Source.__args__
KINDS: tuple[str, ...] = Kind.__args__

#: Parameters each source takes (all optional ones have a default), and their campaign ranges.
SOURCE_PARAMETERS: dict[str, dict[str, tuple[float, float]]] = {
    # slowdown of the replica's CPU work (noisy neighbour: CPU, memory bandwidth, LLC)
    "interference": {"factor": (2.0, 6.0), "replicas": (1, 1)},
    # fraction of CPU left (container limit, as a slower CPU), or replicas left (scaled in too far)
    "saturation": {"capacity": (0.1, 0.3), "replicas": (1, 1)},
    # tc netem delay ± jitter on every message the service sends; tc tbf bandwidth
    "network": {"delay_ms": (20.0, 50.0), "jitter_ms": (0.0, 5.0), "bandwidth_kbit": (1024, 1024)},
    # a worker pool of a few threads, or a cache too small (hits become misses)
    "misconfiguration": {"pool_size": (1, 2), "hit_ratio": (0.0, 0.2)},
    # stop-the-world pauses (GC): `pause_ms` long, one every `every_ms` on average
    "background": {"pause_ms": (50.0, 200.0), "every_ms": (300.0, 1000.0), "replicas": (1, 1)},
}
#: Parameters that make a CPU fault as the kernel's scheduler does (`bmeg.faultinject.cpu`), and
#: their campaign ranges (the `*-scheduler` campaigns); apart, so that what draws every parameter
#: of `SOURCE_PARAMETERS` (`bmeg evaluate rca-sim`) keeps its faults:
#: `slice_ms`: the factor is a CPU hog of (factor - 1) x the replica's weight taking slices this long;
#: `quota`: a CFS quota of `quota` x twice the service's own CPU use, throttled per 100-ms period;
#: `shared_cgroup` (testbed): 1 puts the hog in the target's cgroup, so it slows the target alone;
#: 0 beside it, where it slows every service pinned to its CPU as much.
SCHEDULER_PARAMETERS: dict[str, dict[str, tuple[float, float]]] = {
    "interference": {"slice_ms": (3.0, 3.0), "shared_cgroup": (0, 0)},
    "saturation": {"quota": (0.3, 1.0)},
}
#: Where a fault reaches the service, by source (flags): `inbound` 1 delays the requests the
#: service receives (a proxy or a mesh's sidecar in front of it, as the testbed's front proxy
#: does), 0 (the default) what it sends (tc netem on its interface: its calls and its answers). A
#: campaign may draw both (`inbound: [0, 1]`); the shipped ones do not: twins trained on both
#: forms ranked the testbed's delays no better (docs/issue-12.md, session 27).
FORM_PARAMETERS: dict[str, set[str]] = {"network": {"inbound"}}
#: Parameters that are 0 or 1.
FLAG_PARAMETERS = {"shared_cgroup", "inbound"}
#: Parameters that are counts or flags, drawn as integers.
INTEGER_PARAMETERS = {"replicas", "pool_size", *FLAG_PARAMETERS}
#: Which parameters a source needs at least one of.
NEEDS_ONE_OF = {
    "interference": ("factor",),
    "saturation": ("capacity", "replicas", "quota"),
    "network": ("delay_ms", "bandwidth_kbit"),
    "misconfiguration": ("pool_size", "hit_ratio"),
    "background": ("pause_ms",),
}
DEFAULTS = {"jitter_ms": 0.0, "every_ms": 500.0, "inbound": 0.0}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FaultSpec(_Strict):
    """One explicit fault: `service` misbehaves as `source` says from `start_s` for `duration_s`."""

    service: str
    source: Source
    start_s: float = Field(ge=0)
    duration_s: float = Field(gt=0)
    parameters: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _parameters_fit_source(self) -> FaultSpec:
        _check_parameters(self.source, set(self.parameters))
        for name, value in self.parameters.items():
            _check_value(name, value)
        return self


class Campaign(_Strict):
    """FIRM-like rounds: every `every_s` pick targets and intensities at random for `burst_s`."""

    start_s: float = Field(default=2.0, ge=0)
    every_s: float = Field(gt=0)
    burst_s: float = Field(default=10.0, gt=0)
    faults_per_round: tuple[int, int] = (1, 1)
    shift_s: float = Field(default=0.0, ge=0, description="cascading: delay between a round's faults")
    services: list[str] | None = Field(default=None, description="candidate targets (default: all with traffic)")
    sources: dict[Source, dict[str, tuple[float, float]]] = Field(min_length=1)
    targets: dict[Source, list[str]] = Field(
        default_factory=dict, description="per source, the only services it may hit (default: any candidate); "
        "with targets, each fault draws its source first, then its service")
    calls_stores_only: bool = Field(
        default=False, description="candidate targets: only the services that call a store (`store_callers`); "
        "none when no service does")
    balanced_sources: bool = Field(
        default=False, description="draw sources from a shuffled deck: every run of len(sources) consecutive faults "
        "holds each source once, so an episode's few dozen faults hold each about equally often (no targets)")

    @model_validator(mode="after")
    def _ranges_make_sense(self) -> Campaign:
        low, high = self.faults_per_round
        if not 1 <= low <= high:
            raise ValueError(f"faults_per_round {list(self.faults_per_round)} must be [min, max] with 1 <= min <= max")
        for source, ranges in self.sources.items():
            unknown = set(ranges) - parameter_names(source)
            if unknown:
                raise ValueError(f"sources.{source}: unknown parameters {sorted(unknown)}; known: {sorted(parameter_names(source))}")
            for name, (lo, hi) in ranges.items():
                if lo > hi:
                    raise ValueError(f"sources.{source}.{name}: range [{lo}, {hi}] has min above max")
                _check_value(name, lo)
                _check_value(name, hi)
        stray = set(self.targets) - set(self.sources)
        if stray:
            raise ValueError(f"targets: {sorted(stray)} are not among the campaign's sources {sorted(self.sources)}")
        if self.balanced_sources and self.targets:
            raise ValueError("balanced_sources deals every source to any service: a campaign with targets cannot use it")
        span = self.burst_s + (high - 1) * self.shift_s
        if span > self.every_s:
            raise ValueError(f"rounds overlap: a round lasts {span} s (burst_s + shifts) but every_s is {self.every_s}")
        return self


class Scenario(_Strict):
    name: str
    kind: Kind
    duration_s: float = Field(gt=0, description="length of one simulated episode")
    warmup_s: float = Field(default=1.0, ge=0, description="traces starting earlier are dropped")
    faults: list[FaultSpec] = Field(default_factory=list)
    campaign: Campaign | None = None

    @model_validator(mode="after")
    def _kind_fits(self) -> Scenario:
        if not self.faults and self.campaign is None:
            raise ValueError("a scenario needs `faults`, a `campaign`, or both")
        if self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s {self.warmup_s} leaves nothing of duration_s {self.duration_s}")
        if self.campaign and self.kind == "single" and self.campaign.faults_per_round != (1, 1):
            raise ValueError("a single-fault campaign has faults_per_round [1, 1]")
        if self.campaign and self.kind != "single" and self.campaign.faults_per_round[1] < 2:
            raise ValueError(f"a {self.kind} campaign needs faults_per_round with max >= 2")
        return self


#: Scheduler parameters only the testbed reads (the simulator runs no cgroups).
TESTBED_ONLY_PARAMETERS = {"shared_cgroup"}


def kernel_form_parameters(source: str, parameters: dict[str, float], rng: np.random.Generator) -> dict[str, float]:
    """A CPU fault's parameters (`source` in `SCHEDULER_PARAMETERS`) as the kernel's scheduler
    makes the fault: a CFS quota in place of a smaller core, a hog's time slices beside the
    slowdown factor, drawn from their campaign ranges."""
    drawn = {name: float(rng.uniform(lo, hi)) for name, (lo, hi) in SCHEDULER_PARAMETERS[source].items()
             if name not in TESTBED_ONLY_PARAMETERS}
    return {**{k: v for k, v in parameters.items() if k != "capacity"}, **drawn}


def parameter_names(source: str) -> set[str]:
    """Every parameter a source takes."""
    return set(SOURCE_PARAMETERS[source]) | set(SCHEDULER_PARAMETERS.get(source, {})) | FORM_PARAMETERS.get(source, set())


def _check_parameters(source: str, names: set[str]) -> None:
    unknown = names - parameter_names(source)
    if unknown:
        raise ValueError(f"{source} takes parameters {sorted(parameter_names(source))}, not {sorted(unknown)}")
    if not names & set(NEEDS_ONE_OF[source]):
        raise ValueError(f"{source} needs one of the parameters {list(NEEDS_ONE_OF[source])}")


def _check_value(name: str, value: float) -> None:
    if name == "factor" and value < 1:
        raise ValueError(f"factor {value} must be >= 1 (a slowdown)")
    if name in ("capacity", "hit_ratio") and not 0 <= value <= 1:
        raise ValueError(f"{name} {value} must lie in [0, 1]")
    if name != "hit_ratio" and value < 0:
        raise ValueError(f"{name} {value} must not be negative")
    if name in FLAG_PARAMETERS and value not in (0, 1):
        raise ValueError(f"{name} {value} must be 0 or 1")
    if name in INTEGER_PARAMETERS - FLAG_PARAMETERS and value < 1:
        raise ValueError(f"{name} {value} must be at least 1")


@dataclass(frozen=True)
class Fault:
    """A concrete fault in one episode; times in seconds from the episode's start."""

    service: str
    source: str
    kind: str
    start_s: float
    end_s: float
    parameters: dict[str, float] = field(default_factory=dict)

    def parameter(self, name: str) -> float | None:
        return self.parameters.get(name, DEFAULTS.get(name))


def parse_scenario(data, source: str = "scenario") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        raise SpecError.from_validation(error, source) from None


def scenario_path(name_or_path: str | Path) -> Path:
    """A file path as given, or the shipped scenario `bmeg/faultinject/campaigns/<name>.yaml`."""
    return shipped_path(name_or_path, "campaigns", "scenario")


def load_scenario(name_or_path: str | Path) -> Scenario:
    path = scenario_path(name_or_path)
    return parse_scenario(read_yaml(path), str(path))


def store_callers(topology: TopologySpec) -> set[str]:
    """Services that call a store (a call or a cache lookup) in some operation: where a starved
    service's time shows in real traces, in its store calls (docs/issue-12.md, session 34)."""
    stores = {name for name, service in topology.services.items() if service.storage}
    return {name for name, service in topology.services.items()
            for operation in service.operations.values()
            for _, step in walk_calls(operation.calls, "")
            if split_target(step_target(step))[0] in stores}


def cache_services(topology: TopologySpec) -> set[str]:
    """Services that some cache step looks up (where a `hit_ratio` misconfiguration applies)."""
    found = set()
    for service in topology.services.values():
        for operation in service.operations.values():
            for _, step in walk_calls(operation.calls, ""):
                if isinstance(step, CacheStep):
                    found.add(split_target(step.cache)[0])
    return found


def check_against(scenario: Scenario, topology: TopologySpec, source: str = "scenario") -> None:
    """Every service the scenario names exists in the topology, and fits its fault."""
    problems = []
    caches = cache_services(topology)
    known = ", ".join(sorted(topology.services))
    for index, fault in enumerate(scenario.faults):
        where = f"faults[{index}].service"
        if fault.service not in topology.services:
            problems.append(f"{where}: unknown service {fault.service!r} in topology {topology.name!r} (known: {known})")
        elif "hit_ratio" in fault.parameters and fault.service not in caches:
            problems.append(f"{where}: {fault.service!r} is no cache, so hit_ratio cannot apply (caches: {sorted(caches)})")
    named = [(f"campaign.services[{index}]", service) for index, service in enumerate(scenario.campaign.services or [])] \
        if scenario.campaign else []
    for source, services in (scenario.campaign.targets if scenario.campaign else {}).items():
        named += [(f"campaign.targets.{source}[{index}]", service) for index, service in enumerate(services)]
    for where, service in named:
        if service not in topology.services:
            problems.append(f"{where}: unknown service {service!r} in topology {topology.name!r} (known: {known})")
    problems.extend(_overlaps(scenario.faults))
    if problems:
        raise SpecError(f"{source} does not fit topology {topology.name!r}:\n  " + "\n  ".join(problems))


def _overlaps(faults: list[FaultSpec]):
    for i, first in enumerate(faults):
        for j in range(i + 1, len(faults)):
            second = faults[j]
            if first.service == second.service and (
                first.start_s < second.start_s + second.duration_s and second.start_s < first.start_s + first.duration_s
            ):
                yield f"faults[{i}] and faults[{j}] overlap in time on {first.service!r}"


def scenario_sources(scenario: Scenario) -> list[str]:
    """The fault sources the scenario can draw: its explicit faults' and its campaign's, sorted."""
    campaign = set(scenario.campaign.sources) if scenario.campaign else set()
    return sorted(campaign | {fault.source for fault in scenario.faults})


def only_source(scenario: Scenario, source: str) -> Scenario:
    """The scenario with every fault of another source left out: its explicit faults of `source`
    and a campaign that draws `source` only (same rounds, targets and ranges). A campaign
    without `source` is dropped; a scenario left with no fault is refused."""
    if source not in scenario_sources(scenario):
        raise ValueError(f"scenario {scenario.name!r} draws no {source!r} faults (it draws {scenario_sources(scenario)})")
    campaign = scenario.campaign
    if campaign is not None:
        campaign = None if source not in campaign.sources else campaign.model_copy(update={
            "sources": {source: campaign.sources[source]},
            "targets": {name: services for name, services in campaign.targets.items() if name == source}})
    return parse_scenario({**scenario.model_dump(mode="json"), "name": f"{scenario.name}-only-{source}",
                           "faults": [fault.model_dump(mode="json") for fault in scenario.faults if fault.source == source],
                           "campaign": None if campaign is None else campaign.model_dump(mode="json")},
                          f"{scenario.name} restricted to {source}")


def plan_faults(scenario: Scenario, topology: TopologySpec, rng: np.random.Generator) -> list[Fault]:
    """The explicit faults plus one random draw of the campaign, sorted by start."""
    check_against(scenario, topology)
    faults = [
        Fault(f.service, f.source, scenario.kind, f.start_s, min(f.start_s + f.duration_s, scenario.duration_s), dict(f.parameters))
        for f in scenario.faults
        if f.start_s < scenario.duration_s
    ]
    if scenario.campaign:
        faults.extend(_campaign_faults(scenario, topology, rng))
    return sorted(faults, key=lambda f: (f.start_s, f.service))


def _campaign_faults(scenario: Scenario, topology: TopologySpec, rng: np.random.Generator):
    campaign = scenario.campaign
    chains = service_chains(topology)
    # by default only services the request mix reaches: a fault elsewhere touches no trace
    reached = campaign.services or sorted({service for chain in chains for service in chain})
    if campaign.calls_stores_only:
        reached = sorted(set(reached) & store_callers(topology))
    candidates = [service for service in reached if _sources_for(campaign, service)]
    caches = cache_services(topology) & set(candidates)
    deck = _source_deck(sorted(campaign.sources), rng) if campaign.balanced_sources else None
    for round_start in np.arange(campaign.start_s, scenario.duration_s, campaign.every_s):
        low, high = campaign.faults_per_round
        count = int(rng.integers(low, high + 1))
        if scenario.kind == "cascading":
            targets = [(service, None) for service in _cascade(chains, candidates, count, rng)]
        elif campaign.targets:
            targets = _sources_then_services(campaign, candidates, count, rng)
        else:
            targets = [(service, None) for service in rng.choice(candidates, size=min(count, len(candidates)), replace=False)]
        for order, (service, source) in enumerate(targets):
            source = source or (next(deck) if deck is not None else str(rng.choice(_sources_for(campaign, service))))
            parameters = _draw_parameters(source, campaign.sources[source], service in caches, rng)
            start = float(round_start) + order * campaign.shift_s
            if start < scenario.duration_s:
                end = min(start + campaign.burst_s, scenario.duration_s)
                yield Fault(str(service), source, scenario.kind, start, end, parameters)


def _source_deck(sources: list[str], rng: np.random.Generator) -> Iterator[str]:
    """Sources dealt from a deck shuffled anew whenever it runs out (`balanced_sources`)."""
    while True:
        yield from (str(source) for source in rng.permutation(sources))


def _sources_then_services(campaign: Campaign, candidates: list[str], count: int, rng) -> list[tuple[str, str]]:
    """`count` faults on distinct services, each drawing its source first, then a service that
    source may hit: a source with a short `targets` list is drawn as often as any other."""
    drawn: list[tuple[str, str]] = []
    for _ in range(count):
        used = {service for service, _ in drawn}
        source = str(rng.choice(sorted(campaign.sources)))
        allowed = [s for s in candidates if s not in used and (source not in campaign.targets or s in campaign.targets[source])]
        if allowed:
            drawn.append((str(rng.choice(allowed)), source))
    return drawn


def _sources_for(campaign: Campaign, service: str) -> list[str]:
    """The campaign's sources that may hit the service (its `targets` allow it)."""
    return sorted(source for source in campaign.sources
                  if source not in campaign.targets or service in campaign.targets[source])


def _draw_parameters(source: str, ranges: dict[str, tuple[float, float]], is_cache: bool, rng) -> dict[str, float]:
    ranges = dict(ranges) or {name: SOURCE_PARAMETERS[source][name] for name in NEEDS_ONE_OF[source][:1]}
    if source == "misconfiguration":
        # a small cache only makes sense for a cache; elsewhere misconfigure the pool
        keep = "hit_ratio" if is_cache and "hit_ratio" in ranges else "pool_size"
        ranges = {keep: ranges.get(keep, SOURCE_PARAMETERS[source][keep])}
    drawn = {}
    for name, (lo, hi) in ranges.items():
        drawn[name] = float(rng.integers(int(lo), int(hi) + 1)) if name in INTEGER_PARAMETERS else float(rng.uniform(lo, hi))
    return drawn


def service_chains(topology: TopologySpec) -> list[list[str]]:
    """Root-to-leaf service paths of every request type (consecutive duplicates removed)."""
    chains: list[list[str]] = []

    def walk(target: str, path: list[str]) -> None:
        service, _, operation = topology.operation(target)
        path = path if path and path[-1] == service else path + [service]
        children = [step_target(step) for _, step in walk_calls(operation.calls, "")]
        if not children:
            chains.append(path)
        for child in children:
            walk(child, path)

    for request in topology.requests.values():
        walk(request.entry, [])
    return chains


def _cascade(chains: list[list[str]], candidates: list[str], count: int, rng) -> list[str]:
    """`count` services along one call path, deepest first: the bottleneck moves upstream."""
    allowed = set(candidates)
    usable = [[s for s in chain if s in allowed] for chain in chains]
    usable = [chain for chain in usable if chain]
    chain = usable[int(rng.integers(len(usable)))]
    count = min(count, len(chain))
    first = int(rng.integers(len(chain) - count + 1))
    return list(reversed(chain[first : first + count]))
