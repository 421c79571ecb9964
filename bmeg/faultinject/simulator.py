"""A lean discrete-event simulator of a microservice application under open-loop load.

Mechanics (why bottlenecks behave like real ones):
- Each replica has a worker pool and a FIFO queue in front of it. A worker is held for the
  whole operation, including the time it waits on downstream calls, so a slow service fills
  its callers' pools and latency spreads upstream (back-pressure). A full queue rejects.
- CPU work runs on the replica's cores as FCFS servers: threads beyond the cores wait.
  Because bursts are requested in time order, a burst's start and end are known at once
  from the cores' next-free times (a small heap), which keeps the event count low.
- An operation does half its self time, then its steps (calls, parallel groups, branches,
  cache lookups), then the other half. Every message pays a network delay. A network fault
  delays what its service sends (its calls and answers, as tc netem on its interface does) or,
  `inbound`, the requests it receives (a proxy in front of it, as the testbed's).
- Faults change replica or service state between their start and end events. A saturation
  fault's `capacity` shrinks the replica's cores (a fraction of a core slows every burst
  alike); its `quota` instead sets a CFS bandwidth quota (`bmeg.faultinject.cpu`) of `quota` x
  twice the replica's own average CPU use so far, per 100-ms period, as the testbed does: bursts
  run at full speed until the period's quota is spent, then wait for the next period. An
  interference fault's `factor` slows every burst alike (a noisy neighbour on the memory
  bandwidth, the caches); with `slice_ms` it is a CPU hog with (factor - 1) x the replica's
  weight instead: it holds the CPU for a time slice of `slice_ms`, the replica runs in the
  gaps of slice / (factor - 1) between them (`bmeg.faultinject.cpu.timeshare`). One CPU fault
  per replica at a time: a quota and a hog together apply the quota only. Taking a request
  in needs the CPU too: under either, a request that arrives while the replica may not run
  waits before its server span starts (the gap between the caller's client span and it), and
  so does reading a response: under either, the caller's client span ends when the caller may
  run again, so a CPU fault slows its client spans to callees it did not touch (as on the
  testbed, where a hogged or throttled service's calls to its stores stretch). A pause does
  not delay the read (the fluid campaigns' and the closed loop's data stay as they were).
- With the topology's `cpu_waits: at-wakeup` (what `fit_twin` sets), a process stamps a span's
  times when it runs: a server span opens when its handler's first burst gets a core, and a client span ends
  when the caller gets a core to read the answer, so a replica's backlog of bursts (FCFS on its
  cores, a hog's slice, a spent quota) lands in the wait before its server spans and in its
  client spans, not in its self time; and a burst no longer than a hog's slice runs to its end
  once started (the scheduler lets a woken thread run its slice).
  The testbed's hogged services show it: self time p50 x0.8-1.7, their calls to their stores
  p50 x3,600-13,800. Unset (the shipped topologies), the wait lands inside the span. Twins
  trained at-wakeup rank the testbed's CPU faults better and the twin's own fluid-form CPU
  faults worse (docs/issue-12.md, sessions 25-26).

Times are float nanoseconds from the episode's start. The output is columnar (lists turned
into numpy arrays) and becomes Arrow tables in `bmeg.faultinject.tables`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from heapq import heapify, heappop, heappush, heapreplace
from itertools import count
from typing import NamedTuple

import numpy as np

from bmeg.faultinject.cpu import saturation_quota, throttle, timeshare
from bmeg.faultinject.scenario import Fault
from bmeg.faultinject.spec import (
    BranchStep,
    CacheStep,
    CallStep,
    ParallelStep,
    SequenceStep,
    TopologySpec,
)

#: The version of what the simulator outputs. BUMP IT BY HAND WHEN A CHANGE CAN CHANGE THE
#: OUTPUT (a mechanic here, in `cpu.py`, the twin's fit, the tables, the shipped campaigns):
#: the caches of generated datasets (`bmeg.datasets.loader.cached_path`) and of bootstrapped
#: runs (`bmeg.evaluation.bootstrap.cached_run_dir`) are keyed by it, so a stale one is never
#: reused. `tests/test_simulator_version.py` fails when a small episode's output changes and
#: the version did not.
SIMULATOR_VERSION = 4

SERVER, CLIENT = 0, 1
SAMPLE_BLOCK = 4096
#: CPU a wake-up needs (ns): under a spent CFS quota even that waits for the next period
WAKEUP_NS = 1.0


def _lognormal_stream(rng: np.random.Generator, mu: float, sigma: float):
    while True:
        yield from np.exp(mu + sigma * rng.standard_normal(SAMPLE_BLOCK)).tolist()


def _uniform_stream(rng: np.random.Generator):
    while True:
        yield from rng.random(SAMPLE_BLOCK).tolist()


class Replica:
    __slots__ = ("index", "cpu", "cores", "slowdown", "interference", "pool", "busy", "queue", "fault",
                 "pause_starts", "pause_ends", "link_free", "used_ns", "quota", "period", "window", "spent", "hog")

    def __init__(self, index: int, cores: float, workers: int):
        self.index = index  # global instance number
        self.cpu = cores  # the CPU limit, possibly fractional
        self.cores = [0.0]  # heap of the whole cores' next-free times
        self.interference = 1.0  # slowdown factor from a noisy neighbour
        self.slowdown = 1.0  # what one unit of work costs here: fractional cores and interference
        _resize_cores(self, cores, 0.0)
        self.pool = workers
        self.busy = 0
        self.queue: deque = deque()
        self.fault = -1  # index of the active fault touching this replica
        self.pause_starts: list[float] = []
        self.pause_ends: list[float] = []
        self.link_free = 0.0
        self.used_ns = 0.0  # CPU time its bursts took since the episode started
        self.quota = 0.0  # a CFS quota (ns of CPU per `period` ns); 0: none
        self.period = 0.0
        self.window = 0  # the CFS ledger: the period it is in and the quota spent there
        self.spent = 0.0
        self.hog: tuple[float, float, float] | None = None  # a CPU hog's (cycle, slice, phase) in ns


class ServiceState:
    __slots__ = ("index", "name", "spec", "storage", "replicas", "active", "next_rr", "queue_cap",
                 "net_delay", "net_jitter", "net_inbound", "bytes_per_ns", "hit_override")

    def __init__(self, index: int, name: str, spec, first_instance: int):
        self.index = index
        self.name = name
        self.spec = spec
        self.storage = spec.storage
        self.replicas = [Replica(first_instance + i, spec.cores, spec.workers) for i in range(spec.replicas)]
        self.active = spec.replicas
        self.next_rr = 0
        self.queue_cap = spec.queue
        self.net_delay = 0.0  # extra delay (ns) on every message this service sends
        self.net_jitter = 0.0
        self.net_inbound = False  # the delay is on the requests it receives instead
        self.bytes_per_ns = 0.0  # 0: no bandwidth limit
        self.hit_override: float | None = None  # a cache's hit ratio under misconfiguration


class Op:
    __slots__ = ("key", "service", "name_id", "client_id", "draw", "steps", "response_bytes")

    def __init__(self, key, service, name_id, client_id, draw, response_bytes):
        self.key = key
        self.service = service
        self.name_id = name_id  # server span name
        self.client_id = client_id  # default client span name
        self.draw = draw
        self.steps = ()
        self.response_bytes = response_bytes


# The compiled call trees: a spec's steps with names resolved to ids and times in ns.
class _Call(NamedTuple):
    op: Op
    client: int  # name id of the client span
    timeout_ns: float  # 0: none


class _Cache(NamedTuple):
    op: Op
    client: int
    hit_ratio: float
    on_miss: tuple  # steps run after a miss


class _Parallel(NamedTuple):
    steps: tuple


class _Sequence(NamedTuple):
    steps: tuple


class _Branch(NamedTuple):
    cumulative: list[float]  # running sums of the options' probabilities
    options: tuple  # the steps of each option


_Step = _Call | _Cache | _Parallel | _Sequence | _Branch


class Frame:
    """A running sequence or parallel group inside one visit."""

    __slots__ = ("visit", "parent", "items", "index", "pending", "error")

    def __init__(self, visit, parent, items):
        self.visit = visit
        self.parent = parent
        self.items = items
        self.index = 0
        self.pending = 0
        self.error = False


class Visit:
    """One operation executed at one replica for one trace (and the call that caused it)."""

    __slots__ = ("op", "trace", "replica", "span", "client_span", "frame", "on_miss", "cache_fault",
                 "t_arrive", "t_steps", "steps_wait", "post_work", "extra", "error", "done", "fault")

    def __init__(self, op, trace, client_span, frame):
        self.op = op
        self.trace = trace
        self.client_span = client_span
        self.frame = frame  # the caller's frame to notify (None for a request's root)
        self.on_miss = None
        self.cache_fault = False
        self.replica = None
        self.span = -1
        self.steps_wait = 0.0
        self.extra = 0.0
        self.error = False
        self.done = False
        self.fault = -1


#: The columns of `SimulationResult` the event loop appends to, and their dtypes.
OUTPUT_COLUMNS: dict[str, type] = {
    "span_trace": np.int64, "span_parent": np.int64, "span_service": np.int32, "span_operation": np.int32,
    "span_start": np.float64, "span_end": np.float64, "span_kind": np.int8, "span_error": np.bool_,
    "span_instance": np.int32, "span_peer": np.int32,
    "visit_span": np.int64, "visit_key": np.int32, "visit_local": np.float64, "visit_fault": np.int32,
    "visit_cache_fault": np.bool_,
    "trace_request": np.int32, "trace_start": np.float64, "trace_end": np.float64,
}


@dataclass
class SimulationResult:
    """Columnar output of one episode; ids are indices into the name lists."""

    span_trace: np.ndarray
    span_parent: np.ndarray
    span_service: np.ndarray
    span_operation: np.ndarray
    span_start: np.ndarray
    span_end: np.ndarray
    span_kind: np.ndarray
    span_error: np.ndarray
    span_instance: np.ndarray
    span_peer: np.ndarray  # store service id of a storage client span, -1 otherwise
    visit_span: np.ndarray  # the span that stands for a visit (server span, or storage client span)
    visit_key: np.ndarray  # operation key (service:operation)
    visit_local: np.ndarray  # ns spent at the service itself: queueing, CPU, its own network delay
    visit_fault: np.ndarray  # a fault on the visit's replica while it was there (arrival to end), -1 if none
    visit_cache_fault: np.ndarray  # a cache miss caused by a misconfigured cache
    trace_request: np.ndarray
    trace_start: np.ndarray
    trace_end: np.ndarray
    services: list[str]
    storage: list[str | None]
    operations: list[str]
    instances: list[str]
    op_keys: list[str]
    requests: list[str]
    faults: list[Fault]


class Simulator:
    def __init__(self, topology: TopologySpec, faults: list[Fault], seed_sequence: np.random.SeedSequence):
        self.topology = topology
        self.faults = faults
        streams = seed_sequence.spawn(4)
        self.rng = np.random.default_rng(streams[0])
        self.uniform = _uniform_stream(np.random.default_rng(streams[1]))
        mu, sigma = topology.network.latency.log_params_ns()
        self.network = _lognormal_stream(np.random.default_rng(streams[2]), mu, sigma)
        self._op_seeds = streams[3]
        self.request_bytes = topology.network.request_bytes
        self.at_wakeup = topology.cpu_waits == "at-wakeup"
        self.heap: list = []
        self.sequence = count()
        self._compile()
        self._reset_output()

    # ---- set-up -------------------------------------------------------------------------
    def _compile(self) -> None:
        self.names: list[str] = []
        self._name_ids: dict[str, int] = {}
        self.services: dict[str, ServiceState] = {}
        self.instances: list[str] = []
        for index, (name, spec) in enumerate(self.topology.services.items()):
            state = ServiceState(index, name, spec, len(self.instances))
            self.instances.extend(f"{name}-{i}" for i in range(spec.replicas))
            self.services[name] = state
        self.ops: dict[str, Op] = {}
        targets = [f"{s}:{o}" for s, spec in self.topology.services.items() for o in spec.operations]
        op_rngs = self._op_seeds.spawn(len(targets))
        for key, target in enumerate(targets):
            service, _, spec = self.topology.operation(target)
            operation = target.split(":", 1)[1]
            mu, sigma = spec.self_time.log_params_ns()
            client = operation[: -len("_server")] + "_client" if operation.endswith("_server") else f"{operation}_client"
            self.ops[target] = Op(key, self.services[service], self._name(operation), self._name(client),
                                  _lognormal_stream(np.random.default_rng(op_rngs[key]), mu, sigma), spec.response_bytes)
        self.op_keys = targets
        for target, op in self.ops.items():
            op.steps = self._compile_steps(self.topology.operation(target)[2].calls)
        self.requests = list(self.topology.requests)
        self.entries = [self.ops[r.entry] for r in self.topology.requests.values()]

    def _name(self, name: str) -> int:
        if name not in self._name_ids:
            self._name_ids[name] = len(self.names)
            self.names.append(name)
        return self._name_ids[name]

    def _compile_steps(self, steps) -> tuple:
        return tuple(self._compile_step(step) for step in steps)

    def _compile_step(self, step) -> _Step:
        if isinstance(step, CallStep):
            op = self.ops[step.call]
            client = self._name(step.client) if step.client else op.client_id
            timeout = step.timeout_ms * 1e6 if step.timeout_ms else 0.0
            return _Call(op, client, timeout)
        if isinstance(step, CacheStep):
            op = self.ops[step.cache]
            client = self._name(step.client) if step.client else op.client_id
            return _Cache(op, client, step.hit_ratio, self._compile_steps(step.on_miss))
        if isinstance(step, ParallelStep):
            return _Parallel(self._compile_steps(step.parallel))
        if isinstance(step, SequenceStep):
            return _Sequence(self._compile_steps(step.sequence))
        assert isinstance(step, BranchStep)
        cumulative = np.cumsum([option.p for option in step.branch]).tolist()
        return _Branch(cumulative, tuple(self._compile_steps(option.steps) for option in step.branch))

    def _reset_output(self) -> None:
        for name in OUTPUT_COLUMNS:  # a list per column of SimulationResult, appended to as events run
            setattr(self, name, [])

    # ---- the event loop -----------------------------------------------------------------
    def _at(self, t: float, handler, subject) -> None:
        heappush(self.heap, (t, next(self.sequence), handler, subject))

    def run(self, duration_s: float) -> SimulationResult:
        arrivals, kinds = self._arrivals(duration_s)
        for index, fault in enumerate(self.faults):
            self._at(fault.start_s * 1e9, self._fault_start, index)
            self._at(fault.end_s * 1e9, self._fault_end, index)
        self._arrival_times = arrivals
        self._arrival_kinds = kinds
        if len(arrivals):
            self._at(arrivals[0], self._arrival, 0)
        heap = self.heap
        while heap:
            t, _, handler, subject = heappop(heap)
            handler(subject, t)
        return self._result()

    def _arrivals(self, duration_s: float) -> tuple[list[float], list[int]]:
        workload = self.topology.workload
        expected = int(workload.rate * duration_s)
        if workload.arrivals == "constant":
            times = np.arange(expected) / workload.rate
        else:
            gaps = self.rng.exponential(1 / workload.rate, size=expected + 10 * int(math.sqrt(expected)) + 10)
            times = np.cumsum(gaps)
            times = times[times < duration_s]
        weights = np.array([r.weight for r in self.topology.requests.values()])
        kinds = self.rng.choice(len(weights), size=len(times), p=weights / weights.sum())
        return (times * 1e9).tolist(), kinds.tolist()

    def _arrival(self, index: int, t: float) -> None:
        if index + 1 < len(self._arrival_times):
            self._at(self._arrival_times[index + 1], self._arrival, index + 1)
        trace = len(self.trace_start)
        kind = self._arrival_kinds[index]
        self.trace_request.append(kind)
        self.trace_start.append(t)
        self.trace_end.append(-1.0)
        self._visit_arrives(Visit(self.entries[kind], trace, -1, None), t)

    # ---- a visit's life: arrive, queue, pre-burst, steps, post-burst, respond ------------
    def _visit_arrives(self, visit: Visit, t: float) -> None:
        service = visit.op.service
        replica = service.replicas[service.next_rr % service.active]
        service.next_rr += 1
        visit.replica = replica
        visit.t_arrive = t
        # under a fault from the moment it arrives: a visit that waits at the faulted replica and
        # starts after the fault's end was still slowed by it (labels: "at the time")
        visit.fault = replica.fault
        ready = self._wakeup(replica, t)
        if ready > t:  # the request waits in the socket until the replica may run
            self._at(ready, self._take, visit)
        else:
            self._take(visit, t)

    def _wakeup(self, replica: Replica, t: float) -> float:
        """When a message that arrives at t can be taken in: a throttled replica (its period's
        quota spent) waits for the next period, one under a hog for the end of the hog's slice."""
        if replica.quota:
            return throttle(t, WAKEUP_NS, replica.period, replica.quota, replica.window, replica.spent)[0] - WAKEUP_NS
        if replica.hog is not None:
            return timeshare(t, 0.0, *replica.hog)
        return t

    def _on_core(self, replica: Replica, t: float) -> float:
        """When a burst asked for at t gets a core (`cpu_waits: at-wakeup`): its turn on the
        replica's cores (FCFS), then `_wakeup`'s wait (a spent quota, a hog's slice)."""
        return self._wakeup(replica, max(t, replica.cores[0]))

    def _take(self, visit: Visit, t: float) -> None:
        replica, service = visit.replica, visit.op.service
        if replica.busy < replica.pool:
            replica.busy += 1
            self._start(visit, t)
        elif len(replica.queue) < service.queue_cap:
            replica.queue.append(visit)
        else:  # rejected: the caller gets an error after the network round trip
            visit.error = True
            if visit.frame is None:
                self.trace_end[visit.trace] = t
            else:
                self._at(t + next(self.network), self._returned, visit)

    def _start(self, visit: Visit, t: float) -> None:
        op = visit.op
        service = op.service
        replica = visit.replica
        if visit.fault < 0:
            visit.fault = replica.fault
        if service.storage is None:
            if visit.frame is None:  # the entry's span: from the request's arrival
                start = visit.t_arrive
            else:
                start = self._on_core(replica, t) if self.at_wakeup else t
            visit.span = self._open_span(visit.trace, visit.client_span, service.index, op.name_id,
                                         start, SERVER, replica.index, -1)
        work = next(op.draw)
        if op.steps:
            visit.post_work = work * 0.5
            self._at(self._cpu(replica, t, work * 0.5), self._pre_done, visit)
        else:
            self._at(self._cpu(replica, t, work), self._post_done, visit)

    def _cpu(self, replica: Replica, t: float, work: float, held: bool = False) -> float:
        """FCFS on the replica's cores; returns when this burst of work ends. A `held` burst runs
        from t on the core its thread already has (at-wakeup: the work after the answer it read),
        and the bursts queued for the cores wait as much longer."""
        cores = replica.cores
        start = cores[0] if cores[0] > t and not held else t
        run = work * replica.slowdown
        replica.used_ns += work * replica.interference  # the CPU's time: a fraction of a core is not slower CPU
        if replica.quota:
            end, replica.window, replica.spent = throttle(start, run, replica.period, replica.quota,
                                                          replica.window, replica.spent)
        elif replica.hog is not None:
            short = self.at_wakeup and run <= replica.hog[1]  # a woken thread runs its slice
            end = timeshare(start, 0.0, *replica.hog) + run if short else timeshare(start, run, *replica.hog)
        else:
            end = start + run
        if replica.pause_starts:
            end = _stall(replica.pause_starts, replica.pause_ends, start, end)
        heapreplace(cores, max(cores[0], start) + end - start if held else end)
        return end

    def _pre_done(self, visit: Visit, t: float) -> None:
        visit.t_steps = t
        frame = Frame(visit, None, visit.op.steps)
        self._advance(frame, t)

    def _steps_done(self, visit: Visit, t: float, error: bool) -> None:
        visit.steps_wait = t - visit.t_steps
        visit.error = visit.error or error
        self._at(self._cpu(visit.replica, t, visit.post_work, held=self.at_wakeup), self._post_done, visit)

    def _post_done(self, visit: Visit, t: float) -> None:
        replica = visit.replica
        replica.busy -= 1
        while replica.queue and replica.busy < replica.pool:
            replica.busy += 1
            self._start(replica.queue.popleft(), t)
        service = visit.op.service
        if visit.span >= 0:
            self.span_end[visit.span] = t
            self.span_error[visit.span] = visit.error
        if visit.frame is None:
            self.trace_end[visit.trace] = t
            arrive = t
        else:
            arrive = self._send(service, replica, t, visit.op.response_bytes, visit)
            # the caller reads the response when it may run (a spent quota, a hog's slice; at-wakeup: a core)
            caller = visit.frame.visit.replica
            self._at(self._on_core(caller, arrive) if self.at_wakeup else self._wakeup(caller, arrive),
                     self._returned, visit)
        fault = visit.fault if visit.fault >= 0 else replica.fault
        self.visit_span.append(visit.span if visit.span >= 0 else visit.client_span)
        self.visit_key.append(visit.op.key)
        self.visit_local.append(t - visit.t_arrive - visit.steps_wait + visit.extra)
        self.visit_fault.append(fault)
        self.visit_cache_fault.append(visit.cache_fault)

    def _send(self, service: ServiceState, replica: Replica, t: float, size: int, visit: Visit) -> float:
        """When a message sent at t arrives; delay added by a network fault counts as the sender's."""
        arrive = t + next(self.network)
        outbound = not service.net_inbound
        if (service.net_delay and outbound) or service.bytes_per_ns:
            extra = self._delay(service) if outbound else 0.0
            if service.bytes_per_ns:
                replica.link_free = max(replica.link_free, t) + size / service.bytes_per_ns
                extra += replica.link_free - t
            extra = max(extra, 0.0)
            visit.extra += extra
            arrive += extra
        return arrive

    def _delay(self, service: ServiceState) -> float:
        """A network fault's delay on one message: the delay +- a uniform jitter."""
        return service.net_delay + service.net_jitter * (2 * next(self.uniform) - 1)

    def _returned(self, visit: Visit, t: float) -> None:
        if visit.done:  # the caller already gave up (timeout)
            return
        visit.done = True
        self.span_end[visit.client_span] = t
        self.span_error[visit.client_span] = visit.error
        if visit.on_miss is not None and not visit.error:
            self._advance(Frame(visit.frame.visit, visit.frame, visit.on_miss), t)
        else:
            self._child_done(visit.frame, t, visit.error)

    def _timeout(self, visit: Visit, t: float) -> None:
        if visit.done:
            return
        visit.done = True
        self.span_end[visit.client_span] = t
        self.span_error[visit.client_span] = True
        self._child_done(visit.frame, t, True)

    # ---- steps --------------------------------------------------------------------------
    def _advance(self, frame: Frame, t: float) -> None:
        """Start a sequence's next step, or finish the sequence."""
        if frame.index < len(frame.items) and not frame.error:
            step = frame.items[frame.index]
            frame.index += 1
            self._begin(step, frame, t)
        else:
            self._frame_done(frame, t)

    def _frame_done(self, frame: Frame, t: float) -> None:
        if frame.parent is None:
            self._steps_done(frame.visit, t, frame.error)
        else:
            self._child_done(frame.parent, t, frame.error)

    def _child_done(self, frame: Frame, t: float, error: bool) -> None:
        frame.error = frame.error or error
        if frame.pending:  # a parallel group
            frame.pending -= 1
            if frame.pending == 0:
                self._frame_done(frame, t)
        else:
            self._advance(frame, t)

    def _begin(self, step: _Step, frame: Frame, t: float) -> None:
        kind = type(step)
        if kind is _Call or kind is _Cache:
            self._call(step, frame, t)
        elif kind is _Parallel:
            group = Frame(frame.visit, frame, ())
            group.pending = len(step.steps)
            for child in step.steps:
                self._begin(child, group, t)
        elif kind is _Sequence:
            self._advance(Frame(frame.visit, frame, step.steps), t)
        else:
            draw = next(self.uniform)
            cumulative = step.cumulative
            choice = 0
            while choice < len(cumulative) - 1 and draw >= cumulative[choice]:
                choice += 1
            self._advance(Frame(frame.visit, frame, step.options[choice]), t)

    def _call(self, step: _Call | _Cache, frame: Frame, t: float) -> None:
        caller = frame.visit
        op = step.op
        callee = op.service
        source = caller.op.service
        client = self._open_span(caller.trace, caller.span, source.index, step.client, t, CLIENT,
                                 caller.replica.index, callee.index if callee.storage else -1)
        visit = Visit(op, caller.trace, client, frame)
        if type(step) is _Cache:
            draw = next(self.uniform)
            normal_hit = draw < step.hit_ratio
            hit = normal_hit if callee.hit_override is None else draw < callee.hit_override
            visit.cache_fault = normal_hit and not hit
            if not hit and step.on_miss:
                visit.on_miss = step.on_miss
        elif step.timeout_ns:
            self._at(t + step.timeout_ns, self._timeout, visit)
        arrive = self._send(source, caller.replica, t, self.request_bytes, caller)
        if callee.net_inbound:  # a delay in front of the callee: the time is the callee's (labels)
            delay = max(self._delay(callee), 0.0)
            visit.extra += delay
            arrive += delay
        self._at(arrive, self._visit_arrives, visit)

    def _open_span(self, trace, parent, service, operation, start, kind, instance, peer) -> int:
        self.span_trace.append(trace)
        self.span_parent.append(parent)
        self.span_service.append(service)
        self.span_operation.append(operation)
        self.span_start.append(start)
        self.span_end.append(start)
        self.span_kind.append(kind)
        self.span_error.append(False)
        self.span_instance.append(instance)
        self.span_peer.append(peer)
        return len(self.span_trace) - 1

    # ---- faults -------------------------------------------------------------------------
    def _targets(self, fault: Fault) -> list[Replica]:
        replicas = self.services[fault.service].replicas
        count_ = fault.parameter("replicas")
        if fault.source in ("interference", "background") and count_:
            return replicas[: int(count_)]
        return replicas

    def _fault_start(self, index: int, t: float) -> None:
        fault = self.faults[index]
        service = self.services[fault.service]
        self._effect(fault)(fault, service, t, True)
        for replica in self._targets(fault)[: service.active]:
            replica.fault = index

    def _fault_end(self, index: int, t: float) -> None:
        fault = self.faults[index]
        service = self.services[fault.service]
        self._effect(fault)(fault, service, t, False)
        for replica in service.replicas:
            if replica.fault == index:
                replica.fault = -1

    def _effect(self, fault: Fault):
        """What a fault's source does to its service: `(fault, service, t, on)`, on at its start,
        off (back to the spec) at its end; each source's two halves side by side."""
        effects = {"interference": self._interference, "saturation": self._saturation,
                   "network": self._network, "misconfiguration": self._misconfiguration}
        return effects.get(fault.source, self._background)

    def _interference(self, fault: Fault, service: ServiceState, t: float, on: bool) -> None:
        factor, slice_ms = fault.parameter("factor"), fault.parameter("slice_ms")
        for replica in self._targets(fault):
            if slice_ms is None:
                _interfere(replica, factor if on else 1.0)
            elif not on or factor <= 1:
                replica.hog = None
            else:  # the hog's slice, then the replica's gap of slice / (factor - 1); a random phase
                hold = slice_ms * 1e6
                cycle = hold * factor / (factor - 1)
                replica.hog = (cycle, hold, t + next(self.uniform) * cycle)

    def _saturation(self, fault: Fault, service: ServiceState, t: float, on: bool) -> None:
        if not on:
            for replica in service.replicas:
                _resize_cores(replica, service.spec.cores, t)
                replica.quota = 0.0
            service.active = len(service.replicas)
            return
        if fault.parameter("quota") is not None:
            for replica in service.replicas:
                _set_quota(replica, fault.parameter("quota"), t)
        if fault.parameter("capacity") is not None:
            for replica in service.replicas:
                _resize_cores(replica, service.spec.cores * fault.parameter("capacity"), t)
        if fault.parameter("replicas") is not None:
            service.active = max(1, min(int(fault.parameter("replicas")), len(service.replicas)))

    def _network(self, fault: Fault, service: ServiceState, t: float, on: bool) -> None:
        if not on:
            service.net_delay = service.net_jitter = service.bytes_per_ns = 0.0
            service.net_inbound = False
            return
        service.net_delay = (fault.parameter("delay_ms") or 0.0) * 1e6
        service.net_inbound = bool(fault.parameter("inbound")) and service.net_delay > 0
        service.net_jitter = fault.parameter("jitter_ms") * 1e6
        kbit = fault.parameter("bandwidth_kbit")
        service.bytes_per_ns = kbit * 1e3 / 8 / 1e9 if kbit else 0.0

    def _misconfiguration(self, fault: Fault, service: ServiceState, t: float, on: bool) -> None:
        if not on:
            service.hit_override = None
            for replica in service.replicas:
                replica.pool = service.spec.workers
                while replica.queue and replica.busy < replica.pool:  # the larger pool takes the queue
                    replica.busy += 1
                    self._start(replica.queue.popleft(), t)
            return
        if fault.parameter("pool_size") is not None:
            for replica in service.replicas:
                replica.pool = int(fault.parameter("pool_size"))
        if fault.parameter("hit_ratio") is not None:
            service.hit_override = fault.parameter("hit_ratio")

    def _background(self, fault: Fault, service: ServiceState, t: float, on: bool) -> None:
        """Stop-the-world pauses on the target replicas while the fault lasts."""
        for replica in self._targets(fault):
            replica.pause_starts, replica.pause_ends = self._pauses(fault) if on else ([], [])

    def _pauses(self, fault: Fault) -> tuple[list[float], list[float]]:
        starts, ends = [], []
        every = fault.parameter("every_ms") * 1e6
        length = fault.parameter("pause_ms") * 1e6
        t = fault.start_s * 1e9 + self.rng.exponential(every)
        while t < fault.end_s * 1e9:
            starts.append(t)
            t += length * self.rng.uniform(0.5, 1.5)
            ends.append(t)
            t += self.rng.exponential(every)
        return starts, ends

    def _result(self) -> SimulationResult:
        return SimulationResult(
            **{name: np.array(getattr(self, name), dtype=dtype) for name, dtype in OUTPUT_COLUMNS.items()},
            services=list(self.services),
            storage=[s.storage for s in self.services.values()],
            operations=self.names,
            instances=self.instances,
            op_keys=self.op_keys,
            requests=self.requests,
            faults=list(self.faults),
        )


def _stall(starts: list[float], ends: list[float], start: float, end: float) -> float:
    """End of a burst [start, end) stretched by the stop-the-world pauses it runs into."""
    i = bisect_right(starts, start) - 1
    if i >= 0 and ends[i] > start:  # starts inside a pause: waits for its end
        end += ends[i] - start
    i += 1
    while i < len(starts) and starts[i] < end:
        end += ends[i] - starts[i]
        i += 1
    return end


def _resize_cores(replica: Replica, cores: float, t: float) -> None:
    """Change a replica's CPU (a container limit): whole cores as servers, a fraction as slowdown."""
    whole = max(1, math.ceil(cores))
    current = replica.cores
    if whole < len(current):  # the cores kept are the ones busy longest
        kept = sorted(current)[-whole:]
    else:
        kept = current + [t] * (whole - len(current))
    heapify(kept)
    replica.cores = kept
    replica.cpu = cores
    _interfere(replica, replica.interference)


def _set_quota(replica: Replica, share: float, t: float) -> None:
    """A CFS quota of `share` x twice the replica's average CPU use since the episode started."""
    cores, period_us = saturation_quota(share, replica.used_ns / t if t > 0 else 0.0)
    replica.period = period_us * 1e3
    replica.quota = cores * replica.period
    replica.window, replica.spent = int(t // replica.period), 0.0


def _interfere(replica: Replica, factor: float) -> None:
    """Set the noisy-neighbour slowdown; work also runs slower on a fraction of a core."""
    replica.interference = factor
    replica.slowdown = len(replica.cores) / replica.cpu * factor


def simulate(topology: TopologySpec, faults: list[Fault], duration_s: float, seed: int | np.random.SeedSequence) -> SimulationResult:
    """Run one episode of `duration_s` seconds of arrivals (then drain) under `faults`."""
    seed_sequence = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    return Simulator(topology, faults, seed_sequence).run(duration_s)
