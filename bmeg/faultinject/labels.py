"""Ground-truth labels: which traces a fault made anomalous, and which nodes are the bottlenecks.

The rule (also written into every dataset card, see `LABEL_RULE`):
- A *visit* is one operation at one service replica in one trace. Its *local time* is what the
  service itself added: waiting for a worker, CPU (including waiting for a core and GC
  pauses) and the delay a network fault adds to the messages it sends (an inbound one: to the
  requests it receives); time waiting on its
  downstream calls is excluded, so propagated latency does not count.
- A visit is a **bottleneck** when its replica was under an injected fault at the time (when the
  visit arrived there, started or ended: one that queued during the fault and started after it
  counts) AND the fault shows: its local time exceeds that operation's normal p99 (calibrated on a
  fault-free run of the same topology and load), or, for a cache misconfiguration, the lookup
  missed where the normal cache would have hit and the normal cache misses at most 1% of that
  lookup's calls. "Shows" means the same for both: beyond what the fault-free application does
  in 99% of its visits. A faulted miss of a cache that misses more often when healthy (socialnet's
  and hotelreservation's caches miss 5-30% of lookups) has exactly the spans of a normal miss (the
  simulator draws both against one uniform number), so it does not show in its trace: only the
  cache's miss rate over many traces does (docs/issue-12.md, session 18).
- A trace is **anomalous** when it has at least one bottleneck visit. The node of a visit is
  its server span, or for a store (no server span) the caller's client span; its node
  service is the store then. Client spans of RPCs and visits to healthy services are never
  bottlenecks, however slow back-pressure made them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bmeg.faultinject.simulator import SimulationResult, simulate
from bmeg.faultinject.spec import CacheStep, TopologySpec, walk_calls

LABEL_RULE = (
    "A node (server span, or a store's client span) is a bottleneck when its service replica was "
    "under an injected fault when the visit arrived, started or ended and the fault shows: the "
    "service's own local time for "
    "that visit (worker wait + CPU + its fault's network delay, excluding downstream calls) is "
    "above the operation's p99 in a fault-free calibration run, or a misconfigured cache missed "
    "where the normal cache would have hit and the normal cache misses at most 1% of that lookup's "
    "calls (a miss beyond what the healthy cache does 99% of the time). A trace is anomalous when "
    "it has a bottleneck node. "
    "Services that only show propagated latency are never bottlenecks."
)
CALIBRATION_QUANTILE = 0.99
MIN_CALIBRATION_SAMPLES = 50


@dataclass(frozen=True)
class Thresholds:
    """Per operation key (`service:operation`), the local time (ns) above which a fault shows."""

    local_ns: dict[str, float]
    #: Per cache operation key (`service:operation`), the largest share of its lookups the
    #: normal cache misses, over the places that look it up (1 - hit_ratio); absent: no cache.
    normal_miss: dict[str, float] = field(default_factory=dict)

    def for_keys(self, keys: list[str]) -> np.ndarray:
        return np.array([self.local_ns[key] for key in keys], dtype=np.float64)

    def miss_shows(self, keys: list[str]) -> np.ndarray:
        """bool per key: a miss of this lookup is as rare in normal operation as a local time
        above the p99 (the normal cache misses at most 1 - `CALIBRATION_QUANTILE` of its calls)."""
        return np.array([self.normal_miss.get(key, 0.0) <= 1.0 - CALIBRATION_QUANTILE + 1e-12 for key in keys])


def normal_miss_rates(topology: TopologySpec) -> dict[str, float]:
    """Per cache operation key, the largest normal miss rate (1 - hit_ratio) over its lookups."""
    rates: dict[str, float] = {}
    for service in topology.services.values():
        for operation in service.operations.values():
            for _, step in walk_calls(operation.calls, ""):
                if isinstance(step, CacheStep):
                    rates[step.cache] = max(rates.get(step.cache, 0.0), 1.0 - step.hit_ratio)
    return rates


def calibrate(topology: TopologySpec, seed: int, duration_s: float = 20.0) -> Thresholds:
    """Normal local-time p99 per operation from a fault-free run at the topology's load.

    Operations visited too rarely to estimate a p99 fall back to 1.5x the p99 of their
    self-time distribution.
    """
    result = simulate(topology, [], duration_s, np.random.SeedSequence([seed, 0xCA1]))
    thresholds = {}
    for key, name in enumerate(result.op_keys):
        local = result.visit_local[result.visit_key == key]
        if len(local) >= MIN_CALIBRATION_SAMPLES:
            thresholds[name] = float(np.quantile(local, CALIBRATION_QUANTILE))
        else:
            thresholds[name] = 1.5 * topology.operation(name)[2].self_time.p99_ns()
    return Thresholds(thresholds, normal_miss_rates(topology))


@dataclass
class EpisodeLabels:
    span_bottleneck: np.ndarray  # per span
    trace_anomalous: np.ndarray  # per trace
    trace_faults: list[tuple[int, ...]]  # per trace, the faults (indices) that made it anomalous


def label_episode(result: SimulationResult, thresholds: Thresholds) -> EpisodeLabels:
    limits = thresholds.for_keys(result.op_keys)[result.visit_key]
    rare_miss = thresholds.miss_shows(result.op_keys)[result.visit_key]
    shows = (result.visit_local > limits) | (result.visit_cache_fault & rare_miss)
    bottleneck_visits = np.flatnonzero((result.visit_fault >= 0) & shows)
    spans = result.visit_span[bottleneck_visits]
    span_bottleneck = np.zeros(len(result.span_trace), dtype=bool)
    span_bottleneck[spans] = True
    traces = result.span_trace[spans]
    trace_anomalous = np.zeros(len(result.trace_start), dtype=bool)
    trace_anomalous[traces] = True
    trace_faults: list[set[int]] = [set() for _ in range(len(result.trace_start))]
    for trace, fault in zip(traces.tolist(), result.visit_fault[bottleneck_visits].tolist(), strict=True):
        trace_faults[trace].add(fault)
    return EpisodeLabels(span_bottleneck, trace_anomalous, [tuple(sorted(f)) for f in trace_faults])
