"""A CPU limit as the Linux kernel enforces it: the CFS bandwidth quota.

A container's CPU limit is not a slower CPU. The kernel gives its cgroup a quota of CPU time
per period (`cpu.cfs_quota_us` per `cpu.cfs_period_us`, 100 ms by default); the cgroup's threads
run at full speed until the period's quota is spent, then none of them runs until the next
period starts and the quota refills. A service that uses a small share of its quota on average
is never throttled; cut the quota near its use and most requests still run at once, but one
that arrives after a burst has spent the period's quota waits for the next period (tens of
milliseconds): the local time's median barely moves and its tail grows by one or two orders
of magnitude (the testbed's saturation faults, docs/testbed.md "Do the faults show?": p50 x1.35, p95
x18.7). A fluid model, every burst slowed by quota/period, moves the median as much as the tail.

`throttle` is that rule for one burst of work, charged to the cgroup's ledger of the current
period; `saturation_quota` is how the testbed (`bmeg.faultinject.testbed.faults`) and the
simulator (`bmeg.faultinject.simulator`, a saturation fault's `quota`) cut a quota relative to
the service's own CPU use.

A CPU hog on the target's core (the testbed's interference: `stress-ng` with (factor - 1) x
the target's shares) is not a slower CPU either: the scheduler gives the hog its time slice
(a few ms) and the target the gaps between them (`timeshare`). A request that wakes during the
hog's slice waits for its end however little work it has, so short requests gain the slice's
milliseconds and the tail grows more than the median (the testbed: p50 x14.7, p95 x26.6).
"""

from __future__ import annotations

import math

#: the kernel's default CFS period
CFS_PERIOD_US = 100_000
#: a saturation fault's `capacity` (testbed) or `quota` (simulator) of 1 is this many times the
#: service's average CPU use: the headroom a limit needs for bursts
SATURATION_HEADROOM = 2.0
#: the longest CFS period a saturation fault sets (the kernel's maximum)
SATURATION_MAX_PERIOD_US = 1_000_000
#: the smallest quota the kernel takes per period
MIN_QUOTA_US = 1000


def saturation_quota(capacity: float, demand_cores: float) -> tuple[float, int]:
    """(quota in cores, CFS period in us) for a service that used `demand_cores` on average.

    The cut is relative to what the service uses, not to its limit: `capacity` x twice the
    demand (the span exporter's batches and the GC come in bursts, so a quota of the average
    use alone throttles every burst). The kernel takes no quota below 1 ms per period, so a
    small quota gets a longer period (at most 1 s; below 0.001 of a core the quota stays 1 ms
    per second)."""
    cores = max(0.0, capacity) * SATURATION_HEADROOM * demand_cores
    period = CFS_PERIOD_US if cores * CFS_PERIOD_US >= MIN_QUOTA_US else \
        min(SATURATION_MAX_PERIOD_US, int(MIN_QUOTA_US / max(cores, 1e-9)) + 1)
    return max(cores, MIN_QUOTA_US / period), period


def throttle(start: float, run: float, period: float, quota: float, window: int, used: float) -> tuple[float, int, float]:
    """When a burst of `run` CPU time that could start at `start` ends under a quota of `quota`
    per `period` (all in the same unit), and the ledger after it: `(end, window, used)`, where
    `window` is the index of the period the ledger is in and `used` the quota spent in it.

    The burst runs while the period has quota left and stops for the rest of the period when it
    is spent; a burst that crosses a period's end is charged to both. One ledger per cgroup,
    charged in the order bursts are asked for: a burst that would start in a period before the
    ledger's (another core ran ahead) is charged to the ledger's period, from its start."""
    if quota <= 0 or period <= 0:
        raise ValueError(f"a CFS quota needs a positive quota and period, not {quota} per {period}")
    k = max(int(start // period), window)
    if k > window:
        used = 0.0
    t = max(start, k * period)
    while True:
        step = max(0.0, min(run, quota - used, (k + 1) * period - t))
        t, run, used = t + step, run - step, used + step
        if run <= 0:
            return t, k, used
        k, used = k + 1, 0.0  # quota spent or period over: the next period's quota
        t = max(t, k * period)


def timeshare(start: float, run: float, cycle: float, hold: float, phase: float) -> float:
    """When a burst of `run` CPU time that could start at `start` ends on a CPU that a hog holds
    for `hold` of every `cycle`, from `phase` on (it holds [phase + k cycle, phase + k cycle + hold)).

    A CPU hog with (factor - 1) x the target's weight takes its time slice and leaves the target
    1/factor of the CPU: the target runs in the gaps between the hog's slices. A burst that wakes
    during a slice waits for its end, whatever its size, so a short request waits up to a whole
    slice (the tail) while a long one is slowed about `cycle / (cycle - hold)` times."""
    if not 0 <= hold < cycle:
        raise ValueError(f"a hog holds a part of its cycle: {hold} of {cycle}")
    free = cycle - hold
    position = (start - phase) % cycle
    t = start + max(0.0, hold - position)  # waits out the hog's slice
    left = cycle - max(position, hold)  # of the gap it starts in
    if run <= left:
        return t + run
    rest = run - left
    cycles = math.ceil(rest / free)
    return t + left + (cycles - 1) * cycle + hold + rest - (cycles - 1) * free
