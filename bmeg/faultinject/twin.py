"""Digital twins: a `TopologySpec` fitted from fault-free traces, and how well it reproduces them.

What the twin models is the RPC structure of the traces, their RPC view
(`bmeg.graphs.rpc.rpc_view`: server and client spans kept, internal spans folded into their
parents), for the fitter and for anything compared with it. A server span is one operation of its
service (`service:operation`).

Fitted per operation: the patterns of calls it makes (children ordered by start; a child that
starts before the earlier ones have ended runs in parallel with them), as a branch over the
most frequent patterns with their observed shares, which also gives how often each child call
appears; its self time as a lognormal (median, and sigma from the p95). Per service: replicas
= distinct instances. The network delay is half the gap between a client span and its server
span. The load: root arrivals per second, and the mix of root operations. A twin's CPU waits
land where a real process stamps time (`cpu_waits: at-wakeup`, `bmeg.faultinject.simulator`).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.faultinject.simulator import simulate
from bmeg.faultinject.spec import (
    BranchOption,
    BranchStep,
    CallStep,
    Latency,
    Network,
    Operation,
    ParallelStep,
    Request,
    Service,
    Step,
    TopologySpec,
    Workload,
)
from bmeg.faultinject.tables import spans_of
from bmeg.graphs import SpanForest
from bmeg.graphs.features import self_time_ns
from bmeg.graphs.rpc import called_spans, rpc_view, span_roles
from bmeg.traces.errors import TraceInputError

#: Quantile that sets a self time's sigma (with the median): the tail the percentiles are judged on.
SELF_TIME_QUANTILE = 0.95
#: Quantile that sets the network's sigma. Real client-server gaps have a long tail that is
#: mostly queueing at particular callees; one network distribution for every message cannot
#: carry it without inflating every call, so the twin fits the body of the gaps.
NETWORK_QUANTILE = 0.75
#: Call patterns kept per operation: the most frequent ones covering this share of its calls...
PATTERN_COVERAGE = 0.95
#: ...but at most this many (the rest are rare variants; the kept shares are renormalised).
MAX_PATTERNS = 40
#: Shortest self time a lognormal is fitted to (µs): instrumentation rounds small times to 0.
MIN_TIME_US = 1.0
#: Target CPU utilisation of a fitted replica: the measured self times already hold the real
#: queueing, so the twin gives each replica enough cores not to add much of its own.
TARGET_UTILISATION = 0.3


# ---- fitting ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Call:
    """One call an operation made: callee target, client span name, and when it ran."""

    target: str
    client: str | None
    start: int
    end: int


def fit_twin(spans: pa.Table, name: str = "twin", description: str | None = None) -> TopologySpec:
    """A topology spec fitted from fault-free traces (a span table in SPAN_SCHEMA)."""
    forest = rpc_view(spans)
    if forest.num_traces == 0:
        raise TraceInputError("no traces to fit a twin from (the span table is empty or every trace was dropped)")
    is_server, is_client = span_roles(forest)
    table = forest.spans
    service = table["service"].to_numpy(zero_copy_only=False)
    operation = table["operation"].to_numpy(zero_copy_only=False)
    store = _store_of(table)
    target = np.array([f"{s}:{o}" for s, o in zip(service, operation)], dtype=object)
    callee = np.array([t if s is None else f"{s}:{o}" for t, s, o in zip(target, store.to_pylist(), operation)],
                      dtype=object)
    self_us = self_time_ns(forest) / 1e3

    calls_of = _calls_by_server(forest, is_server, is_client, callee, operation)
    patterns: dict[str, Counter] = defaultdict(Counter)
    for row in np.flatnonzero(is_server):
        patterns[target[row]][_pattern(calls_of.get(row, []))] += 1
    store_rows = np.flatnonzero(is_client & np.asarray(pc.is_valid(store)))
    timed = {**_group_rows(target, np.flatnonzero(is_server)), **_group_rows(callee, store_rows)}
    rate, mix = _workload(forest, target)
    seconds_of_work = {key: len(rows) * float(np.mean(self_us[rows])) / 1e6 for key, rows in timed.items()}

    services: dict[str, dict] = defaultdict(lambda: {"operations": {}, "busy_s": 0.0})
    for key, rows in timed.items():
        svc, _, op = key.partition(":")
        calls = _steps(patterns[key]) if key in patterns else []
        services[svc]["operations"][op] = Operation(self_time=_lognormal(self_us[rows]), calls=calls)
        services[svc]["busy_s"] += seconds_of_work[key]
    duration_s = _observed_seconds(forest)
    instances = _instances(table)
    # a service that serves requests itself is not a store, although its callers' client
    # spans name it in peer.service (otelhttp does, as the testbed's services show)
    serving = set(service[is_server].tolist())
    fitted = {}
    for svc, parts in services.items():
        replicas = max(1, instances.get(svc, 1))
        load = parts["busy_s"] / duration_s / replicas  # busy cores per replica
        fitted[svc] = Service(
            replicas=replicas, cores=float(max(1, math.ceil(load / TARGET_UTILISATION))), workers=64,
            storage=None if svc in serving else _db_system(table, svc), operations=parts["operations"],
        )
    return TopologySpec(
        name=name,
        description=description or f"twin fitted from {forest.num_traces} traces ({forest.num_spans} RPC spans)",
        # a real process stamps its spans when it runs: a CPU backlog shows in the wait before its
        # server spans and in its store calls, not in its self time (docs/issue-12.md, session 26)
        cpu_waits="at-wakeup",
        workload=Workload(rate=rate, arrivals="poisson"),
        network=_network(forest, is_client),
        requests={entry: Request(entry=entry, weight=weight) for entry, weight in mix.items()},
        services=fitted,
    )


def _store_of(table: pa.Table) -> pa.ChunkedArray:
    """The store a childless client span calls: its peer_service, else its db_system; null when neither."""
    return pc.coalesce(table["peer_service"], table["db_system"])


def _db_system(table: pa.Table, service: str) -> str | None:
    peer = table["peer_service"].to_numpy(zero_copy_only=False)
    db = table["db_system"].to_numpy(zero_copy_only=False)
    named = [d for p, d in zip(peer, db) if (p == service or (pd.isna(p) and d == service))]
    if not named:
        return None
    return next((d for d in named if isinstance(d, str)), service)


def _calls_by_server(forest, is_server, is_client, callee, operation) -> dict[int, list[_Call]]:
    """For each server span, the calls it made: its client children and its direct server children."""
    calls: dict[int, list[_Call]] = defaultdict(list)
    parent, start, end = forest.parent, forest.start_ns, forest.end_ns
    server_child: dict[int, int] = {}
    for row in np.flatnonzero(is_server & (parent >= 0)):
        server_child[int(parent[row])] = int(row)
    for row in np.flatnonzero(parent >= 0):
        owner = int(parent[row])
        if not is_server[owner]:
            continue
        if is_client[row]:
            child = server_child.get(int(row))
            target = callee[child] if child is not None else callee[row]
            calls[owner].append(_Call(target, operation[row], int(start[row]), int(end[row])))
        elif is_server[row]:
            calls[owner].append(_Call(callee[row], None, int(start[row]), int(end[row])))
    return calls


def _pattern(calls: list[_Call]) -> tuple:
    """Calls in start order, grouped into stages: a call that starts before the stage ends joins it."""
    stages: list[list[_Call]] = []
    stage_end = None
    for call in sorted(calls, key=lambda c: (c.start, c.end)):
        if stages and call.start < stage_end:
            stages[-1].append(call)
            stage_end = max(stage_end, call.end)
        else:
            stages.append([call])
            stage_end = call.end
    return tuple(tuple(sorted((c.target, c.client or "") for c in stage)) for stage in stages)


def _steps(patterns: Counter) -> list[Step]:
    """The most frequent patterns as steps: one pattern as is, several as a branch."""
    total = sum(patterns.values())
    kept, covered = [], 0
    for pattern, count in patterns.most_common(MAX_PATTERNS):
        kept.append((pattern, count))
        covered += count
        if covered >= PATTERN_COVERAGE * total:
            break
    if len(kept) == 1:
        return _pattern_steps(kept[0][0])
    shares = np.array([count for _, count in kept], dtype=float)
    shares /= shares.sum()
    shares[-1] = 1.0 - shares[:-1].sum()  # exact sum for the spec's check
    return [BranchStep(branch=[BranchOption(p=float(p), steps=_pattern_steps(pattern))
                               for (pattern, _), p in zip(kept, shares)])]


def _pattern_steps(pattern: tuple) -> list[Step]:
    steps: list[Step] = []
    for stage in pattern:
        calls = [CallStep(call=target, client=client or None) for target, client in stage]
        steps.append(calls[0] if len(calls) == 1 else ParallelStep(parallel=calls))
    return steps


def _group_rows(keys: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    frame = pd.Series(rows, index=keys[rows])
    return {key: group.to_numpy() for key, group in frame.groupby(level=0)}


def _lognormal(values_us: np.ndarray, quantile: float = SELF_TIME_QUANTILE) -> Latency:
    """A lognormal with the values' median and their `quantile`."""
    values = np.maximum(values_us, MIN_TIME_US)
    median, upper = np.quantile(values, [0.5, quantile])
    z = NormalDist().inv_cdf(quantile)
    return Latency(median_us=float(median), sigma=float(max(math.log(upper / median), 0.0) / z))


def _workload(forest: SpanForest, target: np.ndarray) -> tuple[float, dict[str, float]]:
    roots = forest.root
    seconds = _observed_seconds(forest)
    mix = pd.Series(target[roots]).value_counts(normalize=True)
    return len(roots) / seconds, {str(k): float(v) for k, v in mix.items()}


def _observed_seconds(forest: SpanForest) -> float:
    """How long the traces' roots arrived over (one mean gap added, so one trace is one gap)."""
    starts = np.sort(forest.start_ns[forest.root])
    spread = (starts[-1] - starts[0]) / 1e9
    return max(spread * len(starts) / max(len(starts) - 1, 1), 1e-3)


def _instances(table: pa.Table) -> dict[str, int]:
    frame = table.select(["service", "instance"]).to_pandas().dropna()
    return frame.groupby("service")["instance"].nunique().to_dict()


def _network(forest: SpanForest, is_client: np.ndarray) -> Network:
    """One-way delay: half of what a client span adds around its server span."""
    called = called_spans(forest, is_client)
    if len(called) == 0:
        return Network()
    gap_us = (forest.duration_ns[forest.parent[called]] - forest.duration_ns[called]) / 2e3
    return Network(latency=_lognormal(gap_us, NETWORK_QUANTILE))


# ---- simulating and comparing ----------------------------------------------------------------
def simulated_spans(spec: TopologySpec, seconds: float, seed: int = 0, epoch_ns: int = 0) -> pa.Table:
    """Fault-free spans of `seconds` of the spec's load."""
    return spans_of(simulate(spec, [], seconds, seed), epoch_ns, seed)


@dataclass
class Fidelity:
    """How closely traces simulated from a twin match the real ones (RPC view of both)."""

    operations: pd.DataFrame  # per operation: count and p50/p95/p99 real and simulated, relative errors
    p50_error: float  # median over operations of |sim - real| / real
    p95_error: float
    p99_error: float
    same_shape: float  # share of traces whose shape the other side has too: 1 - total variation
    span_count: dict[str, float]  # mean and p95 spans per trace, real and simulated
    depth: dict[str, float]  # mean and max depth, real and simulated

    def summary(self) -> dict:
        return {
            "operations_compared": int(len(self.operations)),
            "median_rel_error_p50": self.p50_error, "median_rel_error_p95": self.p95_error,
            "median_rel_error_p99": self.p99_error, "same_shape_share": self.same_shape,
            **{f"spans_{k}": v for k, v in self.span_count.items()}, **{f"depth_{k}": v for k, v in self.depth.items()},
        }


def twin_fidelity(real: pa.Table, spec: TopologySpec, seconds: float = 60.0, seed: int = 0,
                  min_spans: int = 20) -> Fidelity:
    """Simulate `seconds` of the twin and compare latency percentiles and shapes with `real`.

    Operations seen fewer than `min_spans` times in the real traces are not compared.
    """
    real_forest, sim_forest = rpc_view(real), rpc_view(simulated_spans(spec, seconds, seed))
    quantiles = [0.5, 0.95, 0.99]
    real_q, sim_q = _percentiles(real_forest, quantiles), _percentiles(sim_forest, quantiles)
    joined = real_q.add_suffix("_real").join(sim_q.add_suffix("_sim"), how="inner")
    joined = joined[joined["count_real"] >= min_spans]
    for q in ("p50", "p95", "p99"):
        joined[f"{q}_error"] = (joined[f"{q}_sim"] - joined[f"{q}_real"]).abs() / joined[f"{q}_real"]
    real_shapes, sim_shapes = _shape_shares(real_forest), _shape_shares(sim_forest)
    overlap = sum(min(share, sim_shapes.get(shape, 0.0)) for shape, share in real_shapes.items())
    return Fidelity(
        operations=joined,
        p50_error=float(joined["p50_error"].median()), p95_error=float(joined["p95_error"].median()),
        p99_error=float(joined["p99_error"].median()), same_shape=float(overlap),
        span_count=_describe(np.diff(real_forest.trace_offsets), np.diff(sim_forest.trace_offsets), "p95"),
        depth=_describe(_trace_depths(real_forest), _trace_depths(sim_forest), "max"),
    )


def _percentiles(forest: SpanForest, quantiles: list[float]) -> pd.DataFrame:
    table = forest.spans
    frame = pd.DataFrame({
        "service": table["service"].to_numpy(zero_copy_only=False),
        "operation": table["operation"].to_numpy(zero_copy_only=False),
        "us": forest.duration_ns / 1e3,
    })
    grouped = frame.groupby(["service", "operation"])["us"]
    result = grouped.quantile(quantiles).unstack()
    result.columns = [f"p{round(q * 100)}" for q in quantiles]
    result["count"] = grouped.size()
    return result


def _shape_shares(forest: SpanForest) -> dict[str, float]:
    """Share of traces per canonical shape: service:operation of each span, children sorted."""
    table = forest.spans
    labels = [f"{s}:{o}" for s, o in zip(table["service"].to_pylist(), table["operation"].to_pylist())]
    children: dict[int, list[int]] = defaultdict(list)
    for row in np.flatnonzero(forest.parent >= 0).tolist():
        children[int(forest.parent[row])].append(row)
    shape: dict[int, str] = {}
    for row in np.argsort(-forest.depth, kind="stable").tolist():  # deepest first
        inner = ",".join(sorted(shape[c] for c in children.get(row, [])))
        shape[row] = f"{labels[row]}({inner})"
    counts = Counter(shape[int(root)] for root in forest.root)
    total = sum(counts.values())
    return {key: count / total for key, count in counts.items()}


def _trace_depths(forest: SpanForest) -> np.ndarray:
    depths = np.zeros(forest.num_traces, dtype=np.int64)
    np.maximum.at(depths, forest.trace_index, forest.depth)
    return depths


def _describe(real: np.ndarray, sim: np.ndarray, spread: str) -> dict[str, float]:
    pick = (lambda a: float(np.quantile(a, 0.95))) if spread == "p95" else (lambda a: float(np.max(a)))
    return {"mean_real": float(np.mean(real)), "mean_sim": float(np.mean(sim)),
            f"{spread}_real": pick(real), f"{spread}_sim": pick(sim)}
