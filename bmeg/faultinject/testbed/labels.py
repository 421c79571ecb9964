"""Ground-truth labels for real testbed traces: which nodes an injected fault made bottlenecks.

The simulator's rule (`bmeg.faultinject.labels`), measured instead of simulated:
- A node is a server span, or a store's client span (its node service is the store). Its
  *local time* is its exclusive time, plus, for a server span called through a client span,
  that client span's exclusive time: the gap between a call and its server span (network,
  the proxy's delay, waiting for a worker before the server span starts) is the callee's,
  as in the closed loop's `bmeg.mitigation.simulated.span_frame`.
- A node is **exposed** when its service ran it while a fault was applied on that service (its
  span starts between the fault's applied and undone times). For a store's client span the
  service is its caller: a connection pool of 1 or a cache too small slows the store calls
  the misconfigured service makes.
- An exposed node is a **bottleneck** when the fault shows: its local time or its inclusive
  duration is above that (service, operation)'s p99 in the campaign's fault-free calibration
  period, its status is an error (code faults), or its inclusive duration is below the p1
  (an operation that returned early). Operations never seen in calibration: exposed is enough.
- A trace is **anomalous** when it has a bottleneck node; traces through a faulty service
  that the fault did not visibly touch stay normal (the card counts them as `exposed_traces`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from bmeg.graphs import assemble, node_services
from bmeg.graphs.assemble import SpanForest
from bmeg.graphs.features import self_time_ns

LABEL_RULE = (
    "Real testbed traces. A node (server span, or a store's client span) is a bottleneck when its "
    "service (a store span's caller) was under an injected fault when the span started, and the "
    "fault shows: the node's local time (exclusive time plus the exclusive time of the client span "
    "that called it) or its inclusive duration is above the operation's p99 in the campaign's "
    "fault-free calibration period, its status is an error, or its duration is below the p1 "
    "(returned early). A trace is anomalous when it has a bottleneck node."
)
HIGH = 0.99  # and its mirror, 1 - HIGH, below
MIN_SAMPLES = 30


@dataclass(frozen=True)
class AppliedFault:
    """A fault as it really ran: applied and undone at these wall-clock times (ns)."""

    index: int
    service: str
    source: str
    kind: str
    start_ns: int
    end_ns: int
    parameters: dict


@dataclass
class NodeFrame:
    """Per span of a forest: node service, caller service, key, local and inclusive time."""

    forest: SpanForest
    node_service: np.ndarray
    caller_service: np.ndarray
    key: np.ndarray
    local_ns: np.ndarray
    inclusive_ns: np.ndarray
    is_node: np.ndarray
    error: np.ndarray
    start_ns: np.ndarray


def node_frame(spans: pa.Table) -> NodeFrame:
    forest = assemble(spans, on_bad_trace="drop")
    table = forest.spans
    node_service = node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False).astype(object)
    caller = table["service"].to_numpy(zero_copy_only=False).astype(object)
    kind = table["kind"].to_numpy(zero_copy_only=False)
    operation = table["operation"].to_numpy(zero_copy_only=False).astype(object)
    own = self_time_ns(forest).astype(np.float64)
    parent = forest.parent
    local = own.copy()
    called = np.flatnonzero((parent >= 0) & (kind == "server"))
    called = called[kind[parent[called]] == "client"]
    local[called] += own[parent[called]]
    is_store = node_service != caller
    is_node = (kind == "server") | (parent < 0) | ((kind == "client") & is_store)
    key = node_service + np.full(len(node_service), ":", dtype=object) + operation
    return NodeFrame(forest, node_service, caller, key, local,
                     table["duration_ns"].to_numpy().astype(np.float64), is_node,
                     table["status"].to_numpy(zero_copy_only=False) == "error", table["start_ns"].to_numpy())


@dataclass(frozen=True)
class Calibration:
    """Per node key: p99 local, p99 and p1 inclusive time (ns) in the fault-free period."""

    local_high: dict[str, float]
    inclusive_high: dict[str, float]
    inclusive_low: dict[str, float]


def calibrate(frame: NodeFrame, mask: np.ndarray, high: float = HIGH) -> Calibration:
    """Per node key of the spans in `mask` (the fault-free period): the `high` quantile of local
    and inclusive time, and the `1 - high` quantile of inclusive time (the label rule's bounds)."""
    high_local, high_incl, low_incl = {}, {}, {}
    keys = frame.key[mask & frame.is_node]
    local = frame.local_ns[mask & frame.is_node]
    inclusive = frame.inclusive_ns[mask & frame.is_node]
    for key in np.unique(keys.astype(str)):
        chosen = keys == key
        if chosen.sum() >= MIN_SAMPLES:
            high_local[key] = float(np.quantile(local[chosen], high))
            high_incl[key] = float(np.quantile(inclusive[chosen], high))
            low_incl[key] = float(np.quantile(inclusive[chosen], 1.0 - high))
    return Calibration(high_local, high_incl, low_incl)


@dataclass
class Labels:
    span_bottleneck: np.ndarray
    span_exposed: np.ndarray
    span_fault: np.ndarray  # index into the faults of the fault a node was exposed to, -1 if none
    trace_anomalous: np.ndarray
    trace_exposed: np.ndarray
    trace_faults: list[tuple[int, ...]]


def shows(frame: NodeFrame, calibration: Calibration) -> np.ndarray:
    """Per span: whether a fault would show in it (the rule's test, apart from exposure): its local
    or inclusive time past the calibration's upper bounds, its inclusive time below the lower one,
    an error, or a key the calibration has too few spans of."""
    keys = frame.key.astype(str)
    known = np.array([k in calibration.local_high for k in keys])
    local_high = np.array([calibration.local_high.get(k, np.inf) for k in keys])
    incl_high = np.array([calibration.inclusive_high.get(k, np.inf) for k in keys])
    incl_low = np.array([calibration.inclusive_low.get(k, -np.inf) for k in keys])
    return (frame.local_ns > local_high) | (frame.inclusive_ns > incl_high) | frame.error \
        | (frame.inclusive_ns < incl_low) | ~known


def label(frame: NodeFrame, faults: list[AppliedFault], calibration: Calibration,
          aftermath_s: dict[str, float] | None = None) -> Labels:
    """The rule above; with `aftermath_s`, a node is exposed to a fault also that many seconds
    after its end, per fault source (a backlog drains after an interference hog is gone)."""
    n = len(frame.key)
    fault_of = np.full(n, -1, dtype=np.int64)
    for position, fault in enumerate(faults):
        end_ns = fault.end_ns + int((aftermath_s or {}).get(fault.source, 0.0) * 1e9)
        hit = (frame.caller_service == fault.service) & (frame.start_ns >= fault.start_ns) & (frame.start_ns < end_ns)
        fault_of[hit & frame.is_node & (fault_of < 0)] = position
    exposed = fault_of >= 0
    bottleneck = exposed & shows(frame, calibration)
    trace_index = frame.forest.trace_index
    traces = frame.forest.num_traces
    anomalous = np.zeros(traces, dtype=bool)
    anomalous[trace_index[bottleneck]] = True
    trace_exposed = np.zeros(traces, dtype=bool)
    trace_exposed[trace_index[exposed]] = True
    per_trace: list[set[int]] = [set() for _ in range(traces)]
    for trace, fault in zip(trace_index[bottleneck].tolist(), fault_of[bottleneck].tolist(), strict=True):
        per_trace[trace].add(fault)
    return Labels(bottleneck, exposed, fault_of, anomalous, trace_exposed, [tuple(sorted(f)) for f in per_trace])
