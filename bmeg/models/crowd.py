"""Stage 1 against the crowd: a trace is no alarm for being as slow as the whole machine is.

When the machine stalls (another job takes the CPU), every trace in flight is slow at once, on
whichever service was running: measured on the testbed with a CPU hog, most false alarms came
in bursts, within 1 s of another (README, issue 12, session 10). A fault confined to one
service (a saturated service, a network delay to it) makes that service slow and leaves the
others as they were. So each trace is set against the crowd: the nodes of the traces the
stream began in the `window_s` seconds before it, among those it has brought by the time the
trace is judged (its past only: never a trace begun at the same time or later). Whether an
earlier trace came in an earlier batch or in the trace's own does not matter, so the verdict
does not depend on how the stream was cut into batches, only on what had arrived: a trace
begun earlier but still running when the trace is judged is not read (the Kafka consumer
judges a trace after its spans went quiet, by then most of its crowd has ended).

- A visit is slow when its self-time z-score against its (service, operation)'s normal
  baseline (`bmeg.models.features`: the p90 of a normal visit is at z = 1) is at least `slow_z`.
- A service is slow in the crowd when at least `slow_share` of its visits there are slow, of at
  least `min_visits` visits (fewer: the service is not counted).
- The machine is slow when at least `machine_share` of the services counted are slow.
- A flagged trace is explained by the crowd, and not flagged, when the machine is slow and
  every service the trace is slow on (a visit at `slow_z` or more) is slow in the crowd too. A
  trace slow on a service the crowd is not slow on still stands, and so does a trace with no
  slow visit at all (flagged for its structure, an error, a wait: not slowness).

The parameters were chosen on the testbed's fault-free recordings and its single-fault dataset
(README, issue 12, session 11), never on the dev set. The rule reads only what the stream's
history keeps (`bmeg.models.history.Observation`: per node, its service, its trace's start, its
self-time z-score), so a replayed recording (`bmeg diagnose`: every earlier trace of the file)
and a served stream (the Kafka consumer, the REST server: the history's last seconds and the
batch's earlier traces) judge a trace by the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bmeg.models.history import Observation

@dataclass(frozen=True)
class CrowdRule:
    window_s: float = 1.0
    slow_z: float = 5.0
    slow_share: float = 0.05
    min_visits: int = 5
    machine_share: float = 0.5

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"the crowd's window must be positive, not {self.window_s} s")
        if not (0 < self.slow_share <= 1 and 0 < self.machine_share <= 1):
            raise ValueError("slow_share and machine_share are shares: above 0, at most 1")
        if self.min_visits < 1:
            raise ValueError(f"min_visits must be at least 1, not {self.min_visits}")

    def reads(self, starts_ns: np.ndarray) -> tuple[int, int]:
        """[earliest, latest): the trace starts the crowds of traces beginning at `starts_ns`
        (not empty) read."""
        return int(np.min(starts_ns)) - int(self.window_s * 1e9), int(np.max(starts_ns))

    def slow_services(self, past: Observation | Sequence[Observation],
                      starts_ns: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(services of the past, bool [T, S]: slow in each trace's crowd, bool [T, S]: counted),
        for traces beginning at `starts_ns`; the crowd is `past`'s nodes (`crowd_counts`)."""
        names, visits, slow = self.crowd_counts(past, starts_ns)
        counted = visits >= self.min_visits
        return names, counted & (slow >= self.slow_share * visits), counted

    def crowd_counts(self, past: Observation | Sequence[Observation],
                     starts_ns: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(services of the past, int [T, S]: visits, int [T, S]: slow visits) in the crowd of
        each trace beginning at `starts_ns`: `past`'s nodes (one batch's or several, counted
        together) whose trace began in [start - window_s, start). Each batch's nodes are sorted
        by service and time once (`Observation.by_service`, kept with it in a stream's history),
        so a batch's check searches the few batches its windows overlap instead of sorting them
        all again (~55 µs a trace at 1,000 traces/s: README, issue 14)."""
        parts = [past] if isinstance(past, Observation) else list(past)
        # searched in time order (numpy's search is several times faster on sorted needles), put back after
        order = np.argsort(starts_ns, kind="stable")
        starts_ns = np.asarray(starts_ns, dtype=np.int64)[order]
        lower = starts_ns - int(self.window_s * 1e9)
        names = list(dict.fromkeys(name for part in parts for name in part.by_service.names[part.by_service.present]))
        column = {name: i for i, name in enumerate(names)}
        visits = np.zeros((len(starts_ns), len(names)), dtype=np.int64)
        slow = np.zeros_like(visits)
        for part in parts:
            times = part.by_service
            slow_so_far = np.r_[0, np.cumsum(times.z_self >= self.slow_z)]
            lo, hi = times.rows_before(lower), times.rows_before(starts_ns)  # [S, T] each
            columns = [column[name] for name in times.names[times.present]]
            visits[:, columns] += (hi - lo).T
            slow[:, columns] += (slow_so_far[hi] - slow_so_far[lo]).T
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        return names, visits[back], slow[back]

    def explained(self, past: Observation | Sequence[Observation], traces: Observation, trace_index: np.ndarray,
                  num_traces: int) -> np.ndarray:
        """bool [num_traces]: the traces whose slowness the crowd explains (see the module's
        docstring). `traces` holds the nodes of the traces judged (`trace_index`: each node's
        trace), `past` the stream's nodes they are set against (only those begun before each
        trace are read)."""
        starts = np.zeros(num_traces, dtype=np.int64)
        starts[trace_index] = traces.trace_start_ns
        names, slow, counted = self.slow_services(past, starts)
        machine_slow = slow.sum(axis=1) >= self.machine_share * np.maximum(counted.sum(axis=1), 1)
        machine_slow &= counted.any(axis=1)
        own_slow = traces.z_self >= self.slow_z
        codes, services = traces.numbered
        known_as = {name: i for i, name in enumerate(names)}
        column = np.array([known_as.get(name, -1) for name in services], dtype=np.int64)[codes]
        # a slow visit of a service the crowd is not slow on (or does not know) stands out
        in_crowd = np.zeros(len(column), dtype=bool)
        known = column >= 0
        in_crowd[known] = slow[trace_index[known], column[known]]
        stands_out = np.bincount(trace_index, weights=own_slow & ~in_crowd, minlength=num_traces) > 0
        any_slow = np.bincount(trace_index, weights=own_slow, minlength=num_traces) > 0
        return machine_slow & any_slow & ~stands_out
