"""Traces still in flight, and blame from them: what a controller reading live spans can know
of the requests that have not finished.

An OpenTelemetry SDK exports a span when it ends (in batches, every 5 s by default), so the
spans of a slow request arrive only after it ends: a controller that reads finished traces sees
the requests that avoided a stalled service and misses the ones stuck in it, the very traces
that tell of the fault. What has arrived of a trace still open says something all the same:
- `open_traces`: a trace none of whose spans is a root (no span without a parent) is still
  open, or ended less than the export lag ago. Its root began no later than its earliest
  arrived span, so its end-to-end latency is at least `visible_ns - first_ns`, where
  `visible_ns` is the time up to which every ended span has arrived (now minus the export
  lag): a lower bound (a *censored* latency), which `censored_latency_ms` gives.
- an arrived span whose parent has not arrived names an open span (or one ended within the
  lag): a client or internal span's parent is a span of its own process, so its service is
  the arrived span's; a server span's parent is its caller's client span, whose service the
  span does not name, so it says nothing (the caller's own other spans do). These services are
  a trace's `stalled` ones: it waits in them or in something they call. A request queued at
  a callee before its server span starts (a worker pool's queue, a CPU-throttled process)
  leaves no span of the callee, only its caller stalled, so the cause lies in a stalled
  service or below one in the call graph.
- `saturation_diagnosis`: when the application's p95, counting the open traces at their
  lower bounds, is beyond its SLO, the services stalled in open traces that already exceed the
  SLO and those in finished traces beyond it (`in_slow_traces`: once a mitigation has begun to
  work, the slow traces finish in time to be read), and every service below them in the
  normal call graph, are the suspects; of those, the
  ones whose CPU quota throttles them (the share of CFS periods in which the cgroup ran out of
  quota, `nr_throttled / nr_periods`, at least `THROTTLED_SHARE` and above its normal share)
  are blamed, scored by that excess (`InFlightRule` does this on a controller's window first,
  its finished-trace rule otherwise). The traces say where the time goes, the cgroup says
  which service there lacks CPU; a service throttled away from the slow traces, or throttled
  while the SLO holds, is not blamed. Nothing found: None, and the caller uses its rule on the
  finished traces.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from bmeg.diagnosis import Diagnosis, ServiceScore
from bmeg.mitigation.closed_loop import WindowRule
from bmeg.mitigation.planner import THROTTLED_SHARE, descendants
from bmeg.mitigation.simulated import Window

MODEL_VERSION = "in-flight-saturation-rule"


def open_traces(spans: pa.Table) -> pd.DataFrame:
    """One row per trace with no root span among `spans`: `trace_id`, `first_ns` (the earliest
    start of its arrived spans) and `stalled` (a sorted tuple of the services with an open span
    inferred from an arrived non-server span whose parent has not arrived)."""
    columns = ["trace_id", "first_ns", "stalled"]
    if spans.num_rows == 0:
        return pd.DataFrame({c: [] for c in columns})
    frame = spans.select(["trace_id", "span_id", "parent_id", "service", "start_ns", "kind"]).to_pandas()
    parent = frame["parent_id"].fillna("")
    rooted = set(frame.loc[parent == "", "trace_id"])
    frame = frame[~frame["trace_id"].isin(rooted)]
    if frame.empty:
        return pd.DataFrame({c: [] for c in columns})
    known = set(zip(frame["trace_id"], frame["span_id"]))
    orphan = np.array([(t, p) not in known for t, p in zip(frame["trace_id"], frame["parent_id"].fillna(""))], dtype=bool)
    inner = orphan & (frame["kind"].to_numpy() != "server")
    stalled = frame[inner].groupby("trace_id")["service"].agg(lambda s: tuple(sorted(set(s))))
    first = frame.groupby("trace_id")["start_ns"].min()
    out = pd.DataFrame({"trace_id": first.index, "first_ns": first.to_numpy()})
    out["stalled"] = [stalled.get(t, ()) for t in out["trace_id"]]
    return out


def censored_latency_ms(first_ns: np.ndarray, visible_ns: int) -> np.ndarray:
    """Lower bounds of open traces' latencies (ms): every span that ended before `visible_ns`
    has arrived, and their roots have not."""
    return np.maximum(0, visible_ns - np.asarray(first_ns, dtype=np.int64)) / 1e6


def stalled_beyond(open_: pd.DataFrame, slo_ms: float) -> set[str]:
    """The services stalled in open traces (with their lower-bound `latency_ms`) whose latency
    is already known to exceed the SLO."""
    if open_.empty:
        return set()
    late = open_["latency_ms"].to_numpy() > slo_ms
    return {service for stalled in open_.loc[late, "stalled"] for service in stalled}


def in_slow_traces(spans: pa.Table, slo_ms: float) -> set[str]:
    """The services with a span in a finished trace whose root took longer than the SLO."""
    if spans.num_rows == 0:
        return set()
    frame = spans.select(["trace_id", "parent_id", "service", "duration_ns"]).to_pandas()
    roots = frame[frame["parent_id"].fillna("") == ""]
    slow = set(roots.loc[roots["duration_ns"] > slo_ms * 1e6, "trace_id"])
    return set(frame.loc[frame["trace_id"].isin(slow), "service"])


def throttled_share(periods: float, throttled: float) -> float:
    """The share of CFS periods in which the cgroup ran out of quota (0 when it never ran)."""
    return throttled / periods if periods > 0 else 0.0


def saturation_diagnosis(application: str, app_p95_ms: float, slo_ms: float, waited_in: Collection[str],
                         edges: set[tuple[str, str]], throttled: Mapping[str, float],
                         normal_throttled: Mapping[str, float], candidates: Collection[str]) -> Diagnosis | None:
    """The throttled services in or below `waited_in` (those the slow traces wait in) while the SLO
    is violated (see the
    module); None when the SLO holds or no such service is found."""
    if not app_p95_ms > slo_ms or not waited_in:
        return None
    below = descendants(edges)
    suspects = set(waited_in).union(*(below.get(s, set()) for s in waited_in)) & set(candidates)
    excess = {s: throttled.get(s, 0.0) - normal_throttled.get(s, 0.0) for s in suspects}
    causes = {s: e for s, e in excess.items() if throttled.get(s, 0.0) >= THROTTLED_SHARE and e > 0}
    if not causes:
        return None
    top = max(causes.values())
    ranking = [ServiceScore(service=s, score=round(e / top, 4), bottleneck=True)
               for s, e in sorted(causes.items(), key=lambda item: -item[1])]
    return Diagnosis(model_version=MODEL_VERSION, application=application, traces=[], ranking=ranking,
                     window_method=None, window_health=None)


@dataclass
class InFlightRule:
    """A controller's window rule: `saturation_diagnosis` on the window's open traces and its
    telemetry's throttled shares first, `rule` on its finished traces when that finds nothing.
    `edges` and `normal_throttled` come from the normal phase (its call graph: a stalled
    service's callees may have no finished span in a fault's window)."""

    application: str
    rule: WindowRule
    slo_ms: float
    edges: set[tuple[str, str]]
    normal_throttled: Mapping[str, float]
    candidates: frozenset[str]

    def diagnose_window(self, window: Window, edges: set[tuple[str, str]]) -> Diagnosis:
        if window.open_traces is not None:
            throttled = {s: t.cpu_throttled for s, t in window.telemetry.items() if t.cpu_throttled is not None}
            slow = stalled_beyond(window.open_traces, self.slo_ms) | in_slow_traces(window.spans, self.slo_ms)
            found = saturation_diagnosis(self.application, window.latencies.app_p95_ms, self.slo_ms, slow, self.edges | edges,
                                         throttled, self.normal_throttled, self.candidates)
            if found is not None:
                return found
        return self.rule.diagnose_window(window, edges)
