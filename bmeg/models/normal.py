"""What a window of traces is compared with: statistics of a fault-free period.

`NormalStats.from_forest` summarises a fault-free period (in the RPC view, see
`bmeg.graphs.rpc.rpc_view`); the window ranker (`bmeg.models.window`) and the evaluation
harness's rankers (`bmeg.evaluation.rankers`) compare a window with it. A ranking is a
`Ranking`, `[(service, score), ...]`, most suspicious first.

Shared definitions: a span is *anomalous* when its duration is above the normal period's p95
of its (service, operation); a trace is anomalous when its root is. A span's *exclusive* time
is its duration not covered by its children; a client span's exclusive time (network and the
callee's queues) counts for the service it called.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import pandas as pd
import pyarrow.compute as pc
from scipy.special import erf
from scipy.stats import binom

from bmeg.graphs import SpanForest, operation_keys
from bmeg.graphs.features import self_time_ns
from bmeg.graphs.rpc import called_spans, span_roles

Ranking = list[tuple[str, float]]
#: The quantile of the normal period above which a span is anomalous.
ANOMALY_QUANTILE = 0.95
#: Exclusive times below this (ns) count as this: keeps ratios of tiny times sane.
MIN_EXCLUSIVE_NS = 10_000
#: `structure_noise` cuts the normal period into this many slices by time ...
NOISE_SLICES = 10
#: ... of at least this many traces each ...
NOISE_MIN_TRACES = 50
#: A service that fewer than this many of a slice's traces visit has its noise from sampling (`sampled_noise`).
NOISE_MIN_VISITS = 10
#: A caller's part of its calls' common gap shift is at most this times its own evidence (`_caller_cap`).
CALLER_OWN_FACTOR = 3.0


def exclusive_time(forest: SpanForest) -> tuple[np.ndarray, np.ndarray]:
    """(service it counts for, exclusive ns) per span; a client span's time goes to its callee."""
    service = forest.spans["service"].to_numpy(zero_copy_only=False).copy()
    called = called_spans(forest, span_roles(forest)[1])
    service[forest.parent[called]] = service[called]
    return service, self_time_ns(forest).astype(np.float64)


@dataclass
class NormalStats:
    """What the rankers compare a window with, from a fault-free period."""

    forest: SpanForest  # the normal traces themselves (RPC view)
    p95_ns: pd.Series  # by span key: duration quantile above which a span is anomalous
    exclusive_ns: pd.Series  # by (counted service, span key): median exclusive ns
    server_ns: pd.Series  # by span key of a non-client span: median self ns
    gap_ns: pd.Series  # by client span key: median ns a call spent outside both processes
    wait_ns: pd.Series  # by client span key: median ns from a call's start to its callee's server span start
    children: pd.Series  # by span key: mean number of children
    errors: pd.Series  # by span key: share of spans where an error begins
    structure_noise: pd.Series  # by service: the largest structure shift of a slice of the normal period
    error_noise: pd.Series  # by service: the largest rise of its error origins in such a slice (`structure_parts`)
    key_counts: pd.DataFrame  # by span key: spans, error origins, fewest children, odd spans (`structure_tests`)

    @classmethod
    def from_forest(cls, forest: SpanForest) -> NormalStats:
        keys = operation_keys(forest)
        durations = pd.Series(forest.duration_ns, index=keys)
        counted, exclusive = exclusive_time(forest)
        frame = pd.DataFrame({"service": counted, "key": keys, "ns": np.maximum(exclusive, MIN_EXCLUSIVE_NS)})
        own = _own_times(forest)
        structure = _structure_frame(forest)
        children = structure.groupby("key")["children"].mean()
        errors = structure.groupby("key")["errors"].mean()
        noise, error_noise = structure_noise(forest, structure, children, errors)
        return cls(
            forest=forest,
            p95_ns=durations.groupby(level=0).quantile(ANOMALY_QUANTILE),
            exclusive_ns=frame.groupby(["service", "key"])["ns"].median(),
            server_ns=own[~own["client"]].groupby("key")["ns"].median(),
            gap_ns=own[own["client"]].groupby("key")["ns"].median(),
            wait_ns=own[own["client"]].groupby("key")["wait"].median(),
            children=children,
            errors=errors,
            structure_noise=noise,
            error_noise=error_noise,
            key_counts=_normal_key_counts(structure),
        )

    def with_noise_of(self, longer: NormalStats) -> NormalStats:
        """These statistics with each service's structure noise (and its errors part) at least
        `longer`'s: for a short recent period (`bmeg.models.window.latest_before`) compared with
        a window where a longer fault-free period is at hand.

        A few seconds of traffic cannot show how far a service's calls move over minutes: on the
        testbed post-storage-service's reads made 0.42 calls per span in the fixed normal period,
        1.23 in the 300 traces before a fault and 0.81 in its window (a cache whose hit rate
        swings). The 300 traces measured its noise 0.026, the fixed period 0.172; the gate
        `structure_changed` fired on it at 0.169 and put it before the CPU fault on user-service
        in every seed (docs/issue-12.md, session 38)."""
        def larger(own: pd.Series, other: pd.Series) -> pd.Series:
            return pd.concat([own, other], axis=1).max(axis=1)

        return replace(self, structure_noise=larger(self.structure_noise, longer.structure_noise),
                       error_noise=larger(self.error_noise, longer.error_noise))

    def anomalous_spans(self, forest: SpanForest) -> np.ndarray:
        limit = self.p95_ns.reindex(operation_keys(forest)).to_numpy()
        return forest.duration_ns > np.nan_to_num(limit, nan=np.inf)

    def anomalous_traces(self, forest: SpanForest) -> np.ndarray:
        return self.anomalous_spans(forest)[forest.root]

    def exclusive_increase(self, forest: SpanForest) -> pd.Series:
        """Per counted service: mean log2 of exclusive time over its normal median (0: unchanged)."""
        counted, exclusive = exclusive_time(forest)
        index = pd.MultiIndex.from_arrays([counted, operation_keys(forest)])
        normal = self.exclusive_ns.reindex(index).to_numpy()
        known = ~np.isnan(normal)
        ratio = np.log2(np.maximum(exclusive[known], MIN_EXCLUSIVE_NS) / normal[known])
        return pd.Series(ratio).groupby(counted[known]).mean()

    def service_shift(self, forest: SpanForest, caller_part: Literal["smallest", "median"] = "smallest") -> pd.Series:
        """Per service, the largest of its parts (`service_shift_parts`): how far (log2) its own
        time moved, with call gaps split between the ends."""
        return self.service_shift_parts(forest, caller_part).max(axis=1)

    def service_shift_parts(self, forest: SpanForest,
                            caller_part: Literal["smallest", "median"] = "smallest") -> pd.DataFrame:
        """Per service, how far (log2) its own time moved, with call gaps split between the ends.

        A call's gap (network and queues) grows when the callee is slow to take or answer it,
        and also when the *caller* is slow to send and receive: then every callee of that caller
        shows it. So the smallest shift over a caller's outgoing calls (to two callees or more)
        is the caller's, and what an edge shows beyond it is the callee's (median over its
        callers). Per service (rows), its parts (columns, NaN where it has none): `own`, its own
        spans' self time; `caller`, its part as a caller; `callee`, its part as a callee; `wait`,
        its calls' start waits as a callee (`wait_parts`).

        The smallest, not the median: a slow caller lifts every one of its calls, one slow
        callee lifts only its own, and with two callees the median is their mean, which gave
        the caller half of one callee's network delay and the callee the other half (the
        caller then often ranked first). Measured with the median -> the smallest, the time
        shift alone, AC@1 on network delays: testbed 0.69 -> 0.82 (49 faults), simulated
        Hotel Reservation 0.20 -> 0.80, Social Network 0.69 -> 0.92, Train Ticket 0.64 -> 0.82;
        simulated CPU faults unchanged (docs/issue-12.md, session 6). `caller_part="median"`
        is the rule before, kept for that comparison (`bench/time_shift.py`). The smallest is
        capped by what the caller shows of its own (`_caller_cap`): with two faulty callees at
        once every call of their caller is slow, and the caller is not.
        """
        own = _own_times(forest)
        shifts = self._time_shifts(own)
        servers = shifts[~shifts["client"]].groupby("service")["shift"].mean()
        edges = _edge_shifts(shifts)
        caller = _caller_shares(edges, "min" if caller_part == "smallest" else "median")
        if caller_part == "smallest":
            caller = np.minimum(caller, _caller_cap(caller.index, servers, edges))
        callee = _callee_parts(edges, caller)
        return pd.concat({"own": servers, "caller": caller, "callee": callee, "wait": self._wait_parts(own)}, axis=1)

    def wait_parts(self, forest: SpanForest) -> pd.Series:
        """Per callee, how far (log2) the start waits of the calls into it moved: per call edge,
        the window's summed start waits (from the client span's start to the callee's server span's)
        over the sum of their keys' normal medians; a caller's share is the smallest over its callees
        (two or more, else 0), and a callee's part the median over its callers of what its edge shows
        beyond its caller's share (the split the call gaps get in `service_shift_parts`).

        A ratio of sums, not a mean of log2 ratios: a CPU quota (CFS throttling) leaves most calls
        alone and holds a few for up to a period while the callee cannot run, so the waits' p50 stays
        and their tail grows. On the single-fault testbed recording the gaps' mean log2 shift put the
        target first in 7 of 22 such faults, the start waits' ratio of sums in 18, network delays and
        interference staying at 21/21 and 19/19 (docs/issue-12.md, session 18)."""
        return self._wait_parts(_own_times(forest))

    def _wait_parts(self, own: pd.DataFrame) -> pd.Series:
        """`wait_parts` of the spans of an `_own_times` frame."""
        calls = own[own["client"]]
        waits = pd.DataFrame({"service": calls["service"], "callee": calls["callee"], "wait": calls["wait"],
                              "normal": self.wait_ns.reindex(calls["key"]).to_numpy()})
        sums = waits[waits["normal"].notna()].groupby(["service", "callee"])[["wait", "normal"]].sum()
        edges = np.log2(sums["wait"] / sums["normal"])
        return _callee_parts(edges, _caller_shares(edges, "min"))

    def call_edge_shifts(self, forest: SpanForest) -> pd.Series:
        """Per call edge (index: `service`, the caller, and `callee`), the mean log2 shift of its
        calls' gaps (network and queues) from the normal period's median of their span key: what
        `service_shift_parts` splits between the caller and the callee."""
        return _edge_shifts(self._time_shifts(_own_times(forest)))

    def _time_shifts(self, own: pd.DataFrame) -> pd.DataFrame:
        """An `_own_times` frame with `shift`, log2 of each span's own time over its key's normal median
        (a server span's self time, a client span's gap); spans of keys the period never saw left out."""
        own = own.copy()
        normal = np.where(own["client"], self.gap_ns.reindex(own["key"]).to_numpy(),
                          self.server_ns.reindex(own["key"]).to_numpy())
        own["shift"] = np.log2(own["ns"] / normal)
        return own[~np.isnan(normal)]

    def structure_shift(self, forest: SpanForest) -> pd.Series:
        """Per service, how far its operations' structure moved from the normal period: per
        operation, |mean children - normal mean| / max(normal mean, 1) plus the rise of the
        share of its spans where an error *begins* (an error span with no error child: callers
        that record the failed call are not where it began); a service's shift is the mean
        over its spans. Means against means, so an operation whose call count varies from
        request to request is not a change. A code fault (an early return, an exception)
        changes the calls a service makes and its status, not its time; the change counts for
        the service that made (or skipped) the calls. Operations the normal period never saw
        are not scored. How far a service's structure moves with no fault at all is
        `structure_noise`."""
        return self.structure_parts(forest)[["calls", "errors"]].sum(axis=1)

    def structure_parts(self, forest: SpanForest) -> pd.DataFrame:
        """`structure_shift`'s two parts per service (rows), as columns: `calls` (the change of
        its operations' child counts) and `errors` (the rise of the share of its spans where an
        error begins), and `error_spans`, the number of its spans in `forest` where one begins."""
        return _structure_parts(_structure_frame(forest), self.children, self.errors)

    def structure_tests(self, forest: SpanForest) -> pd.DataFrame:
        """Per service of `forest` (rows): how unlikely its structure is under the normal period,
        by counts of spans, so that the evidence grows with how many spans a change is seen on.

        A span is *odd* when an error begins in it or it has fewer children than any span of its
        key had in the period (an early return, an exception that skips calls; more children
        than ever is left out: a cache that misses more under a slow store makes them with no
        code fault), unless one of its calls failed: a caller that stops calling after a callee's
        exception changed nothing of its own, and the callee's span, where the error begins, is
        odd already (with 2-3 concurrent faults the caller of an excepting service was put first
        for another fault's window, docs/issue-12.md, session 17). Per span key, `p` is the
        binomial chance of at least as many odd spans in the window as it holds, each odd with
        the period's own share of them: its error origins, plus one if its fewest children were
        seen on one span only (Good-Turing's estimate of the unseen, for the low tail), counted
        with one more (Laplace), so that a short period is a weak witness. A service's `p` is its
        keys' smallest; `tests` counts its keys, so that a caller can correct for how many were
        looked at (`bmeg.models.window.structure_significant`). Keys the period never saw are not
        tested."""
        frame = _structure_frame(forest)
        normal = self.key_counts.reindex(frame["key"])
        fewer = (frame["children"].to_numpy() < normal["least"].to_numpy()) & ~frame["failed_call"].to_numpy()
        frame["odd"] = np.maximum(frame["errors"], fewer)
        frame = frame[normal["spans"].notna().to_numpy()]
        window = frame.groupby("key").agg(spans=("odd", "size"), odd=("odd", "sum"), service=("service", "first"))
        normal = self.key_counts.loc[window.index]
        p = binom.sf(window["odd"] - 1, window["spans"], (normal["odd"] + 1.0) / (normal["spans"] + 2.0))
        tests = pd.DataFrame({"p": np.where(window["odd"] > 0, p, 1.0), "service": window["service"]})
        by_service = tests.groupby("service")["p"]
        return pd.DataFrame({"p": by_service.min(), "tests": by_service.size()})


def _caller_shares(edges: pd.Series, how: Literal["min", "median"]) -> pd.Series:
    """Per caller of `edges` (a shift per (caller `service`, `callee`)), its share of its calls'
    shift: their smallest (or median) over two callees or more; 0 with one callee, where a
    caller-side and a callee-side slowdown look alike and the callee gets it."""
    by_caller = edges.groupby(level="service")
    return by_caller.agg(how).where(by_caller.size() >= 2, 0.0)


def _callee_parts(edges: pd.Series, caller: pd.Series) -> pd.Series:
    """Per callee of `edges`, the median over its callers of what its edge shows beyond its caller's share."""
    return (edges - caller.reindex(edges.index.get_level_values("service")).to_numpy()).groupby(level="callee").median()


def _caller_cap(callers: pd.Index, servers: pd.Series, edges: pd.Series) -> pd.Series:
    """Per caller, the most of its calls' common shift that can be its own: `CALLER_OWN_FACTOR`
    times the larger of its own self-time shift and the shift of the calls made *to* it (median
    over its callers), at least 0; no cap (inf) for a service nobody calls (an entry).

    A caller that is slow itself shows it beyond its outgoing calls: a CPU-starved one in its
    own self time (compose-post-service under interference: own 2.0, its calls 4.9-7.5), one
    whose network interface is delayed in the calls coming in as well. A caller all of whose
    callees are slow shows neither (text-service with both its callees delayed at once: own
    0.54, its calls 5.05 and 6.17): the time is its callees'. An entry service has no calls in
    to tell a delayed interface by (the simulated frontend's and nginx's network delays: own
    0.0, calls 8.5-9.0), so it keeps the smallest of its calls (docs/issue-12.md, session 18)."""
    incoming = edges.groupby(level="callee").median().reindex(callers)
    evidence = pd.concat([servers.reindex(callers), incoming], axis=1).max(axis=1).clip(lower=0.0)
    return (CALLER_OWN_FACTOR * evidence).where(incoming.notna(), np.inf)


def _edge_shifts(shifts: pd.DataFrame) -> pd.Series:
    """Per (caller `service`, `callee`): the mean shift of the client spans of `NormalStats._time_shifts`."""
    return shifts[shifts["client"]].groupby(["service", "callee"])["shift"].mean()


def _normal_key_counts(frame: pd.DataFrame) -> pd.DataFrame:
    """Per span key of a normal period's `_structure_frame`: its spans, error origins, fewest
    children (`least`) and odd spans as `structure_tests` estimates them: its error origins,
    plus one if its fewest children were seen on one span only."""
    by_key = frame.groupby("key").agg(spans=("errors", "size"), errors=("errors", "sum"), least=("children", "min"))
    at_least = frame[frame["children"].to_numpy() == by_key["least"].reindex(frame["key"]).to_numpy()]
    once = at_least.groupby("key").size().reindex(by_key.index) == 1
    return by_key.assign(odd=by_key["errors"] + once.astype(float))


def _structure_frame(forest: SpanForest) -> pd.DataFrame:
    """Per span: key, service, number of children, 1.0 where an error begins, whether a child of it
    (a call it made) has an error status."""
    origins, failed_call = _error_spans(forest)
    return pd.DataFrame({"key": operation_keys(forest), "service": forest.spans["service"].to_numpy(zero_copy_only=False),
                         "children": _child_counts(forest), "errors": origins, "failed_call": failed_call})


def _structure_parts(frame: pd.DataFrame, children: pd.Series, errors: pd.Series) -> pd.DataFrame:
    """`NormalStats.structure_parts` of the spans in `frame` against per-key normal means."""
    by_key = frame.groupby("key").agg(children=("children", "mean"), errors=("errors", "mean"),
                                      error_spans=("errors", "sum"), spans=("children", "size"),
                                      service=("service", "first"))
    normal_children = children.reindex(by_key.index)
    calls = (by_key["children"] - normal_children).abs() / np.maximum(normal_children, 1.0)
    began = (by_key["errors"] - errors.reindex(by_key.index)).clip(lower=0.0)
    known = by_key[calls.notna()].assign(calls=calls * by_key["spans"], errors=began * by_key["spans"])
    by_service = known.groupby("service")
    spans = by_service["spans"].sum()
    return pd.DataFrame({"calls": by_service["calls"].sum() / spans, "errors": by_service["errors"].sum() / spans,
                         "error_spans": by_service["error_spans"].sum()})


def structure_noise(forest: SpanForest, frame: pd.DataFrame, children: pd.Series, errors: pd.Series,
                    slices: int = NOISE_SLICES, min_traces: int = NOISE_MIN_TRACES,
                    min_visits: int = NOISE_MIN_VISITS) -> tuple[pd.Series, pd.Series]:
    """Per service, the largest structure shift of a slice of a fault-free period against the
    whole: how far the service's structure moves with no fault at all; and the same of its
    `errors` part alone (`NormalStats.structure_parts`).

    The period's traces are cut by start time into `slices` consecutive slices of equal trace
    counts (fewer, so that each holds at least `min_traces`); by time, not at random, because
    what makes a service's calls vary is often a state that drifts (a cache filling and being
    evicted: the testbed's post-storage-service calls its store on a miss only, and a 2-s slice
    of its normal period moved 0.04-0.31). A period too short for two slices has no measured
    noise (empty series). `frame` is `_structure_frame(forest)`; `children` and `errors`
    are the whole period's per-key means.

    Where fewer than `min_visits` of a slice's traces would visit a service, the slices' own
    shifts are no measure of it: a mean over a handful of requests swings widely, and a
    service's noise read from two or three slices is as often far too small. Its noise is then
    the spread the slices would show by sampling alone (`sampled_noise`), from its operations'
    variances over the whole period. With 300 recent traces as the normal period (`bmeg
    evaluate rca --recent-traces 300`), 50-trace slices held 3 spans of url-shorten-service's
    compose_urls, all of a post with no URL, and its noise read 1.00: above the early return
    that moved it by 1.00 (docs/issue-12.md, session 13). A long fixed period has enough
    visits of most services in every slice.
    """
    count = min(slices, forest.num_traces // max(min_traces, 1))
    if count < 2:
        return pd.Series(dtype=float), pd.Series(dtype=float)
    order = np.argsort(forest.spans["start_ns"].to_numpy()[forest.root], kind="stable")
    slice_of_trace = np.empty(forest.num_traces, dtype=np.int64)
    slice_of_trace[order] = np.arange(forest.num_traces) * count // forest.num_traces
    slice_of_span = slice_of_trace[forest.trace_index]
    parts = [_structure_parts(frame[slice_of_span == i], children, errors) for i in range(count)]
    noise = pd.concat([part[["calls", "errors"]].sum(axis=1) for part in parts], axis=1).max(axis=1)
    error_noise = pd.concat([part["errors"] for part in parts], axis=1).max(axis=1)
    visits = pd.DataFrame({"service": frame["service"], "trace": forest.trace_index}).drop_duplicates()
    visits = visits.groupby("service").size().reindex(noise.index)
    rare = noise.index[visits < min_visits * count]
    if len(rare):
        sampled, sampled_errors = sampled_noise(frame, count)
        noise[rare], error_noise[rare] = sampled.reindex(rare), sampled_errors.reindex(rare)
    return noise, error_noise


def sampled_noise(frame: pd.DataFrame, slices: int) -> tuple[pd.Series, pd.Series]:
    """`structure_noise` of each service as sampling alone would make it, and of its `errors`
    part: the expected largest of `slices` slices' shifts (`expected_largest_normal`) were each
    operation's slice mean spread as that of a random 1/`slices` of its spans (the variance of
    its child counts, and of its error origins, over the spans of `frame`), and a service's shift
    their span-weighted sum (so its spread at most the weighted sum of theirs)."""
    by_key = frame.groupby("key").agg(spans=("children", "size"), mean=("children", "mean"),
                                      variance=("children", lambda c: c.var(ddof=0)), errors=("errors", "mean"),
                                      service=("service", "first"))
    spread = np.sqrt((slices - 1) / by_key["spans"])  # times each span's sd: a slice mean's sd about the whole's
    calls = by_key["spans"] * spread * np.sqrt(by_key["variance"]) / np.maximum(by_key["mean"], 1.0)
    errors = by_key["spans"] * spread * np.sqrt(by_key["errors"] * (1.0 - by_key["errors"]))
    by_service = pd.DataFrame({"calls": calls, "errors": errors, "spans": by_key["spans"],
                               "service": by_key["service"]}).groupby("service").sum()
    largest = expected_largest_normal(slices)
    return (largest * (by_service["calls"] + by_service["errors"]) / by_service["spans"],
            largest * by_service["errors"] / by_service["spans"])


def expected_largest_normal(count: int) -> float:
    """E max |Z_i| over `count` independent standard normal Z_i (0.80 for one, 1.59 for six)."""
    x = np.linspace(0.0, 10.0, 4001)
    inside = erf(x / np.sqrt(2.0)) ** count  # P(max |Z| <= x)
    return float(np.trapezoid(1.0 - inside, x))


def _child_counts(forest: SpanForest) -> np.ndarray:
    has_parent = forest.parent >= 0
    return np.bincount(forest.parent[has_parent], minlength=forest.num_spans).astype(np.float64)


def _error_spans(forest: SpanForest) -> tuple[np.ndarray, np.ndarray]:
    """Per span: 1.0 where it has an error status and none of its children has (where the error
    begins), and whether any of its children has one (a call it made failed)."""
    error = pc.equal(forest.spans["status"], "error").to_numpy(zero_copy_only=False)
    has_parent = forest.parent >= 0
    child_errors = np.bincount(forest.parent[has_parent], weights=error[has_parent], minlength=forest.num_spans)
    return (error & (child_errors == 0)).astype(np.float64), child_errors > 0


def _own_times(forest: SpanForest) -> pd.DataFrame:
    """Per span: service, key, own ns (self time; a client span's is its call's gap), client?, callee,
    and a client span's start wait (`wait`: ns from its start to its callee's server span's, at least
    `MIN_EXCLUSIVE_NS`; NaN for other spans)."""
    service = forest.spans["service"].to_numpy(zero_copy_only=False)
    _, is_client = span_roles(forest)
    callee = np.full(forest.num_spans, None, dtype=object)
    called = called_spans(forest, is_client)
    callee[forest.parent[called]] = service[called]
    calls = np.zeros(forest.num_spans, dtype=bool)  # a client span with a child: its callee is known
    calls[forest.parent[called]] = True
    wait = np.full(forest.num_spans, np.nan)
    wait[forest.parent[called]] = np.maximum(
        forest.start_ns[called].astype(np.float64) - forest.start_ns[forest.parent[called]].astype(np.float64), MIN_EXCLUSIVE_NS)
    return pd.DataFrame({"service": service, "key": operation_keys(forest), "client": is_client & calls,
                         "callee": callee, "ns": np.maximum(self_time_ns(forest), MIN_EXCLUSIVE_NS).astype(float),
                         "wait": wait})

