"""Stage 1 against the crowd: a trace is no alarm for being as slow as the whole machine is.

When the machine stalls (another job takes the CPU), every trace in flight is slow at once, on
whichever service was running: measured on the testbed with a CPU hog, most false alarms came
in bursts, within 1 s of another (docs/issue-12.md, session 10). A fault confined to one
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
- A flagged trace is explained by the crowd, and not flagged, in either of two cases; in both,
  every service the trace is slow on (a visit at `slow_z` or more) must be slow in the crowd
  too, so a trace slow on a service the crowd is not slow on still stands, and so does a trace
  with no slow visit at all (flagged for its structure, an error, a wait: not slowness).
  - A stalled machine (session 11): at least `machine_share` of the services counted are slow.
  - A busy machine (session 15, gated by the stream and on by default since session 16;
    `busy_z` None turns it off): another job takes part of
    the CPU, and the crowd shows it as a tail spread over services, not as a stall: at least
    `busy_services` services slow in the crowd, none of them slow on `fault_share` of its
    visits or more (where one is, a fault holds that service: a network delay or a pinned hog
    slows nearly every visit of it), and the trace's own slowness moderate: every visit below
    z = `busy_z` (the hogs and delays of the testbed's faults put their slow visits mostly
    above it, a busy machine's mostly below). Here a service the trace is slow on only needs
    a slow visit among the crowd's (of at least `min_visits` visits), not `slow_share` of them:
    under a one-core hog, 5-25% of a service's visits were slow. And the stream must not look
    like a fault (session 16): at most `busy_ceiling` of the traces the stream began in the
    `window_s` seconds before the trace are above stage 1's threshold (`alarm_share`: each by
    its own model's threshold, before any check). A fault confined to a service the traffic
    goes through puts many of them above it at once: on the testbed, a median 49-66% for the
    traces of network and interference faults, 8% for a one-core hog's bursts; that share is
    the model's own verdicts, so it carries from one bootstrapped model to another where a
    z-score's magnitude did not (session 15: on a model bootstrapped from another recording,
    the network faults' slow visits fell below z = 12, and without this gate a third of them
    were held).

The parameters were chosen on the testbed's fault-free recordings and its single-fault dataset
(docs/issue-12.md, sessions 11, 15 and 16), never on the dev set. The rule reads only what the stream's
history keeps (`bmeg.models.history.Observation`: per node, its service, its trace's start, its
self-time z-score; per trace, its start and whether stage 1 put it above its threshold), so a replayed recording (`bmeg diagnose`: every earlier trace of the file)
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
    busy_services: int = 2
    fault_share: float = 0.5
    busy_z: float | None = 12.0  # None: only a stalled machine explains a trace (session 11's rule)
    busy_ceiling: float | None = 0.25  # None: the busy case reads no alarm share (session 15's rule)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"the crowd's window must be positive, not {self.window_s} s")
        if not (0 < self.slow_share <= 1 and 0 < self.machine_share <= 1 and 0 < self.fault_share <= 1
                and (self.busy_ceiling is None or 0 <= self.busy_ceiling <= 1)):
            raise ValueError("slow_share, machine_share, fault_share and busy_ceiling are shares: above 0 "
                             "(busy_ceiling: at least 0), at most 1")
        if self.busy_z is not None and not (self.busy_z > self.slow_z and self.busy_services >= 1):
            raise ValueError(f"busy_z must be above slow_z ({self.slow_z}), not {self.busy_z}, and busy_services "
                             f"at least 1, not {self.busy_services}")
        if self.min_visits < 1:
            raise ValueError(f"min_visits must be at least 1, not {self.min_visits}")

    def reads(self, starts_ns: np.ndarray) -> tuple[int, int]:
        """[earliest, latest): the trace starts the crowds of traces beginning at `starts_ns`
        (not empty) read."""
        return int(np.min(starts_ns)) - int(self.window_s * 1e9), int(np.max(starts_ns))

    def crowd_counts(self, past: Observation | Sequence[Observation],
                     starts_ns: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(services of the past, int [T, S]: visits, int [T, S]: slow visits) in the crowd of
        each trace beginning at `starts_ns`: `past`'s nodes (one batch's or several, counted
        together) whose trace began in [start - window_s, start). Each batch's nodes are sorted
        by service and time once (`Observation.by_service`, kept with it in a stream's history),
        so a batch's check searches the few batches its windows overlap instead of sorting them
        all again (~55 µs a trace at 1,000 traces/s: docs/issue-14.md)."""
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

    def alarm_share(self, past_start_ns: np.ndarray, past_above: np.ndarray, starts_ns: np.ndarray) -> np.ndarray:
        """float [T]: the share of the past traces (their starts, whether each was above stage 1's
        threshold; in any order) begun in [start - window_s, start) that were above it, for each
        trace beginning at `starts_ns` (0 where none was begun then)."""
        order = np.argsort(past_start_ns, kind="stable")
        times = np.asarray(past_start_ns, dtype=np.int64)[order]
        above_so_far = np.r_[0, np.cumsum(np.asarray(past_above, dtype=bool)[order])]
        starts = np.asarray(starts_ns, dtype=np.int64)
        lo = np.searchsorted(times, starts - int(self.window_s * 1e9), side="left")
        hi = np.searchsorted(times, starts, side="left")  # begun strictly before
        return (above_so_far[hi] - above_so_far[lo]) / np.maximum(hi - lo, 1)

    def explained(self, past: Observation | Sequence[Observation], traces: Observation, trace_index: np.ndarray,
                  num_traces: int, alarm_share: np.ndarray | None = None) -> np.ndarray:
        """bool [num_traces]: the traces whose slowness the crowd explains (see the module's
        docstring). `traces` holds the nodes of the traces judged (`trace_index`: each node's
        trace), `past` the stream's nodes they are set against (only those begun before each
        trace are read), `alarm_share` [num_traces] the stream's recent share above stage 1's
        threshold (`alarm_share`; needed by the busy case unless `busy_ceiling` is None)."""
        starts = np.zeros(num_traces, dtype=np.int64)
        starts[trace_index] = traces.trace_start_ns
        names, visits, slow_visits = self.crowd_counts(past, starts)
        counted = visits >= self.min_visits
        slow = counted & (slow_visits >= self.slow_share * visits)
        own_slow = traces.z_self >= self.slow_z
        codes, services = traces.numbered
        known_as = {name: i for i, name in enumerate(names)}
        column = np.array([known_as.get(name, -1) for name in services], dtype=np.int64)[codes]
        any_slow = np.bincount(trace_index, weights=own_slow, minlength=num_traces) > 0

        def all_seen(in_crowd: np.ndarray) -> np.ndarray:
            """bool [T]: no slow visit of the trace is on a service the crowd (`in_crowd` [T, S])
            does not show slow, or does not know."""
            seen = np.zeros(len(column), dtype=bool)
            known = column >= 0
            seen[known] = in_crowd[trace_index[known], column[known]]
            return np.bincount(trace_index, weights=own_slow & ~seen, minlength=num_traces) == 0

        machine_stalled = slow.sum(axis=1) >= self.machine_share * np.maximum(counted.sum(axis=1), 1)
        machine_stalled &= counted.any(axis=1)
        explained = machine_stalled & all_seen(slow)
        if self.busy_z is not None:
            share = np.where(counted, slow_visits / np.maximum(visits, 1), 0.0)
            busy = (slow.sum(axis=1) >= self.busy_services) & ~(share >= self.fault_share).any(axis=1)
            if self.busy_ceiling is not None:
                if alarm_share is None:
                    raise ValueError("the busy case with a busy_ceiling reads the stream's alarm share: pass it")
                busy &= alarm_share <= self.busy_ceiling
            moderate = np.bincount(trace_index, weights=traces.z_self >= self.busy_z, minlength=num_traces) == 0
            explained |= busy & moderate & all_seen(counted & (slow_visits > 0))
        return any_slow & explained
