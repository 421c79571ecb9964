"""A fault campaign on the running testbed: `bmeg generate socialnet --backend testbed ...`.

1. The testbed runs (started here if it was not, and stopped at the end then); faults a
   killed campaign left are undone first.
2. A fault-free calibration period (`calibration_s`) gives each operation's normal times.
3. Episodes of the scenario run one after another in real time, each with its faults drawn
   by `plan_faults` (the simulator's campaign files and rules; the testbed scenarios list
   which services may be hit; `testbed: {code_share}` turns that share into code faults,
   `code_request_shares` the shares of their operation's requests they hit),
   applied and undone by `faults` at their wall-clock times,
   until the requested traces have been served (rate x episode length per episode).
4. The Collector's file exporter is read back through bmeg's OTLP reader; traces are
   assembled and labelled (`labels`), and the dataset is written in the simulator's layout:
   spans/traces/nodes Parquet and `dataset.json`, plus `normal.parquet` (the calibration
   period's fault-free spans, for `--normal` and `bmeg bootstrap`), `faults.json` (each fault as it ran)
   and `fault_list.json` (Nezha's format, which `bmeg evaluate rca` reads; pods are called
   `<service>-testbed-<n>`, so the default two-part pod suffix yields the service).
SIGTERM and SIGINT undo the faults in force before the campaign exits; after a SIGKILL the
next campaign, `up` or `down` does (the state file holds every fault's undo record).

`record_healthy` (`bmeg testbed record`) is the campaign without faults: the running testbed's
traffic for a fixed time, as it is (no fault in force, the load at the rate `up` was given),
written as one span Parquet file of the traces that began in that time, for `bmeg bootstrap`
or as fresh healthy traffic to count false alarms on (`bench/healthy.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bmeg.faultinject.errors import SpecError
from bmeg.faultinject.scenario import Fault, Scenario, parse_scenario, plan_faults, scenario_path
from bmeg.faultinject.spec import load_topology, read_yaml
from bmeg.faultinject.tables import NODES_SCHEMA, NORMAL, TRACES_SCHEMA
from bmeg.faultinject.testbed import labels as labelling
from bmeg.faultinject.testbed.collector import read_collector_spans
from bmeg.faultinject.testbed.deployment import CODE_OPERATIONS, SERVICES
from bmeg.faultinject.testbed.faults import apply_fault, undo_all, undo_fault
from bmeg.faultinject.testbed.supervisor import DEFAULT_RATE, Testbed, down, start_load, up
from bmeg.faultinject.testbed.system import TestbedError
from bmeg.traces.schema import traces_begun_between

#: Nezha fault types for the fault list (`bmeg.evaluation.faults.LATENCY_FAULTS` are latency faults)
INJECT_TYPES = {"interference": "cpu_contention", "saturation": "cpu_consumed", "network": "network_delay",
                "misconfiguration": "misconfiguration", "background": "gc_pause", "code": "exception"}
FLUSH_S = 3.0  # the SDK's batch delay (5 s max) is cut by the services' shutdown, the Collector's by 200 ms
#: a recording's last traces reach the Collector's file within the SDK's batch delay (5 s, the
#: services keep running), the Collector's batch (200 ms) and its file's flush (500 ms)
RECORD_FLUSH_S = 7.0


def load_testbed_scenario(path: Path) -> tuple[Scenario, float, tuple[float, ...]]:
    """A campaign file, the share of its drawn faults that become code faults, and the shares
    of an operation's requests those code faults may hit.

    A testbed campaign may add `testbed: {code_share: S, code_request_shares: [s1, ...]}` to
    the simulator's format: code faults (an operation returns early or fails) are a source only
    real processes have; each hits one of `code_request_shares` (default [1]: every request) of
    its operation's requests, drawn evenly."""
    data = read_yaml(path)
    extra = data.pop("testbed", None) if isinstance(data, dict) else None
    extra = extra or {}
    if not isinstance(extra, dict) or set(extra) - {"code_share", "code_request_shares"}:
        raise SpecError(f"{path}: testbed: takes only code_share and code_request_shares, not {extra!r}")
    share = extra.get("code_share", 0.0)
    if not isinstance(share, int | float) or not 0 <= share <= 1:
        raise SpecError(f"{path}: testbed.code_share must be a number in [0, 1], not {share!r}")
    request_shares = extra.get("code_request_shares", [1.0])
    if (not isinstance(request_shares, list) or not request_shares
            or not all(isinstance(s, int | float) and 0 < s <= 1 for s in request_shares)):
        raise SpecError(f"{path}: testbed.code_request_shares must be a list of numbers in (0, 1], not {request_shares!r}")
    return parse_scenario(data, str(path)), float(share), tuple(float(s) for s in request_shares)


def with_code_faults(faults: list[Fault], share: float, rng: np.random.Generator,
                     request_shares: tuple[float, ...] = (1.0,)) -> list[Fault]:
    """Each fault becomes, with probability `share`, a code fault on the same service and
    times: one of its operations (`CODE_OPERATIONS`) fails (error) or returns early, even odds,
    on one of `request_shares` of its requests (parameter `share`)."""
    drawn = []
    for fault in faults:
        operations = CODE_OPERATIONS.get(fault.service, ())
        if operations and rng.random() < share:
            fault = Fault(fault.service, "code", fault.kind, fault.start_s, fault.end_s,
                          {"operation": float(rng.integers(len(operations))), "error": float(rng.integers(2)),
                           "share": float(rng.choice(request_shares))})
        drawn.append(fault)
    return drawn


class _Stop(Exception):
    """SIGTERM: leave the campaign's loop, undo the faults."""


def run_campaign(out: str | Path, scenario: str | Path, traces: int, seed: int = 0, rate: float | None = None,
                 calibration_s: float = 20.0, testbed: Testbed | None = None, progress=print) -> dict:
    if traces < 1:
        raise ValueError(f"traces must be at least 1, not {traces}")
    bed = testbed or Testbed.default()
    plan_file = scenario_path(scenario)
    plan, code_share, request_shares = load_testbed_scenario(plan_file)
    topology = load_topology("socialnet")
    unknown = set(plan.campaign.services or []) - set(SERVICES) if plan.campaign else set()
    unknown |= {f.service for f in plan.faults} - set(SERVICES)
    if unknown:
        raise ValueError(f"scenario {plan.name!r} names services the testbed does not run: {sorted(unknown)}")
    running = bed.state()
    started_here = running is None or not all(r.alive() for r in running.processes.values() if r.role not in ("hog", "load"))
    if running is None or started_here:
        state = up(bed, rate=rate or DEFAULT_RATE, seed=seed)
    elif rate is not None and rate != running.rate:
        raise ValueError(f"the testbed runs at {running.rate:g} req/s; stop it (bmeg testbed down) to use --rate {rate:g}")
    else:
        state = running
        start_load(bed, state)  # a fresh generator: its per-request records start empty
    for line in undo_all(bed, state):
        progress(f"repaired: {line}")
    per_episode = state.rate * (plan.duration_s - plan.warmup_s)
    episodes = max(1, math.ceil(traces / per_episode))
    rng = np.random.default_rng(seed)
    applied: list[labelling.AppliedFault] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def stop(signum, frame):
        raise _Stop()

    for sig in previous:
        signal.signal(sig, stop)
    began = time.time_ns()
    try:
        progress(f"calibrating for {calibration_s:g} s (no faults)")
        time.sleep(calibration_s)
        calibration_end = time.time_ns()
        for episode in range(episodes):
            faults = with_code_faults(plan_faults(plan, topology, rng), code_share, rng, request_shares)
            progress(f"episode {episode + 1}/{episodes}: {len(faults)} faults")
            applied += _run_episode(bed, state, faults, plan.duration_s, episode, seed, len(applied), progress)
        ended = time.time_ns()
    except _Stop:
        raise TestbedError("campaign stopped by a signal; its faults were undone") from None
    finally:
        undo_all(bed, state)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    time.sleep(FLUSH_S)
    try:
        card = _write_dataset(Path(out), bed, state, plan, plan_file, applied, began, calibration_end, ended, traces, seed)
    finally:
        if started_here:
            down(bed)
    return card


def record_healthy(out: str | Path, seconds: float, testbed: Testbed | None = None) -> dict:
    """Record the running testbed's fault-free traffic for `seconds` into the Parquet file `out`;
    returns what was recorded. The testbed must run (`bmeg testbed up`) with its load and no
    fault in force (a fault would make the traffic unhealthy)."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, not {seconds}")
    bed = testbed or Testbed.default()
    state = bed.state()
    if state is None or not all(r.alive() for r in state.processes.values() if r.role != "hog"):
        raise TestbedError(f"the testbed on port base {bed.base} is not running (or degraded): run `bmeg testbed up` first")
    if state.faults:
        raise TestbedError(f"faults in force ({', '.join(sorted(state.faults))}): the traffic would not be "
                           "fault-free; `bmeg testbed down` undoes them")
    began = time.time_ns()
    time.sleep(seconds)
    ended = time.time_ns()
    load_average = os.getloadavg()
    time.sleep(RECORD_FLUSH_S)
    spans = traces_begun_between(read_collector_spans(Path(state.spans_file)), began, ended)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(spans, out)
    return {"out": str(out), "seconds": round((ended - began) / 1e9, 1), "rate": state.rate,
            "traces": pc.count_distinct(spans["trace_id"]).as_py(), "spans": spans.num_rows,
            "began_ns": began, "ended_ns": ended, "port_base": bed.base,
            "load_average_1_5_15": [round(v, 2) for v in load_average]}


def _run_episode(bed, state, faults, duration_s: float, episode: int, seed: int, first: int,
                 progress) -> list[labelling.AppliedFault]:
    """Apply and undo the episode's faults at their times; returns them as they really ran. A
    fault that cannot be applied (its mechanism failed: the message says why) is left out of
    the labels and the campaign goes on."""
    t0 = time.monotonic()
    events = sorted([(f.start_s, 1, i) for i, f in enumerate(faults)] + [(f.end_s, 0, i) for i, f in enumerate(faults)])
    started: dict[int, int] = {}
    done: list[labelling.AppliedFault] = []
    for at, is_start, index in events:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        fault, fault_id = faults[index], f"e{episode}-{index}"
        if is_start:
            until = time.time() + (fault.end_s - fault.start_s)
            # stamped before the call: a fault shows while it is being applied (a hog from ~0.5 s
            # before the call returned, README "between the rounds"), so its window starts here
            calling = time.time_ns()
            try:
                apply_fault(bed, state, fault_id, fault.service, fault.source, fault.parameters, until, seed + first + index)
            except TestbedError as error:
                progress(f"fault {fault_id} ({fault.source} on {fault.service}) not applied: {error}")
                continue
            started[index] = calling
        elif index in started:
            end = undo_fault(bed, state, fault_id) or time.time_ns()
            done.append(labelling.AppliedFault(0, fault.service, fault.source, fault.kind,
                                               started[index], end, dict(fault.parameters)))
    time.sleep(max(0.0, t0 + duration_s - time.monotonic()))
    return [replace(f, index=first + i) for i, f in enumerate(sorted(done, key=lambda f: f.start_ns))]


def _write_dataset(out: Path, bed, state, plan, plan_file, faults, began, calibration_end, ended, requested, seed) -> dict:
    spans = read_collector_spans(Path(state.spans_file))
    starts = spans["start_ns"]
    spans = spans.filter(pc.and_(pc.greater_equal(starts, began), pc.less(starts, ended)))
    recording = label_recording(spans, faults, calibration_end, plan.duration_s)
    write_labelled(out, recording, faults)
    (out / "fault_list.json").write_text(json.dumps(_fault_list(faults), indent=1))
    card = {
        "name": f"socialnet-testbed-{plan.name}-n{recording.traces.num_rows}-s{seed}",
        "backend": "testbed",
        "topology": {"name": "socialnet", "services": list(SERVICES), "rate": state.rate},
        "scenario": {"name": plan.name, "kind": plan.kind, "file": str(plan_file),
                     "sha256": hashlib.sha256(Path(plan_file).read_bytes()).hexdigest()},
        "requested_traces": requested, **label_counts(recording, faults), "seed": seed,
        "files": {**LABELLED_FILES, "fault_list": "fault_list.json"},
        "generation": {"seconds": round((ended - began) / 1e9, 1), "calibration_s": round((calibration_end - began) / 1e9, 1),
                       "began_ns": began, "calibration_end_ns": calibration_end, "ended_ns": ended},
    }
    (out / "dataset.json").write_text(json.dumps(card, indent=2))
    return card


@dataclass(frozen=True)
class LabelledRecording:
    """A campaign's spans labelled (`bmeg.faultinject.testbed.labels`): the dataset's tables."""

    frame: labelling.NodeFrame
    calibration: labelling.Calibration
    labels: labelling.Labels
    keep: np.ndarray  # bool per trace: the campaign's (after the calibration period)
    span_keep: np.ndarray  # the same per span
    nodes: pa.Table  # the kept traces' nodes, `NODES_SCHEMA`
    traces: pa.Table  # the kept traces, `TRACES_SCHEMA`


def label_recording(spans: pa.Table, faults: list[labelling.AppliedFault], calibration_end: int, episode_s: float,
                    high: float = labelling.HIGH, aftermath_s: dict[str, float] | None = None) -> LabelledRecording:
    """Label a campaign's spans (those begun before `calibration_end` are its fault-free
    calibration period) against the faults as they ran, with bounds at the `high` quantile (and
    each source's `aftermath_s`, `labelling.label`)."""
    frame = labelling.node_frame(spans)
    forest = frame.forest
    root = forest.parent < 0
    trace_start = np.zeros(forest.num_traces, dtype=np.int64)
    trace_start[forest.trace_index[root]] = frame.start_ns[root]
    calibration = labelling.calibrate(frame, trace_start[forest.trace_index] < calibration_end, high)
    labels = labelling.label(frame, faults, calibration, aftermath_s)
    keep = trace_start >= calibration_end  # the dataset holds the campaign's traces, not the calibration's
    span_keep = keep[forest.trace_index]
    table = forest.spans
    nodes = pa.Table.from_arrays([table["trace_id"], table["span_id"], pa.array(frame.node_service.astype(str)),
                                  pa.array(labels.span_bottleneck)], schema=NODES_SCHEMA)
    return LabelledRecording(frame, calibration, labels, keep, span_keep,
                             nodes.filter(pa.array(span_keep & frame.is_node)),
                             _traces_table(frame, labels, faults, trace_start, keep, episode_s, calibration_end))


#: The files `write_labelled` writes, as a dataset card names them.
LABELLED_FILES = {"spans": "spans.parquet", "traces": "traces.parquet", "nodes": "nodes.parquet",
                  "faults": "faults.json", "normal": "normal.parquet"}


def write_labelled(out: Path, recording: LabelledRecording, faults: list[labelling.AppliedFault]) -> None:
    """A labelled recording's dataset files in `out` (`LABELLED_FILES`: `bmeg.datasets` reads them): the
    campaign's spans, the calibration period's (fault-free: `bmeg bootstrap`'s and `bmeg evaluate rca
    --normal`'s), the node and trace labels, and the faults as they ran."""
    out.mkdir(parents=True, exist_ok=True)
    table = recording.frame.forest.spans
    pq.write_table(table.filter(pa.array(recording.span_keep)), out / "spans.parquet")
    pq.write_table(table.filter(pa.array(~recording.span_keep)), out / "normal.parquet")
    pq.write_table(recording.nodes, out / "nodes.parquet")
    pq.write_table(recording.traces, out / "traces.parquet")
    (out / "faults.json").write_text(json.dumps([asdict(f) for f in faults], indent=1))


def label_counts(recording: LabelledRecording, faults: list[labelling.AppliedFault]) -> dict:
    """A labelled recording's dataset card entries: its traces, labels and faults counted, the rule."""
    traces = recording.traces
    anomalous = int(pc.sum(traces["anomalous"]).as_py() or 0)
    return {
        "traces": traces.num_rows, "anomalous_traces": anomalous, "normal_traces": traces.num_rows - anomalous,
        "exposed_traces": int(recording.labels.trace_exposed[recording.keep].sum()),
        "achieved_imbalance": anomalous / max(1, traces.num_rows - anomalous),
        "faults": len(faults), "faults_per_source": _count(f.source for f in faults),
        "fault_sources": _count(traces["fault_source"].to_pylist()), "labels": labelling.LABEL_RULE,
        "calibration_p99_local_us": {k: round(v / 1e3, 1) for k, v in sorted(recording.calibration.local_high.items())},
        "assembly_warnings": len(recording.frame.forest.warnings),
    }


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))


def _traces_table(frame, labels, faults, trace_start, keep, episode_s: float, calibration_end: int) -> pa.Table:
    forest = frame.forest
    root = np.flatnonzero(forest.parent < 0)
    chosen = np.flatnonzero(keep)
    order = np.empty(forest.num_traces, dtype=np.int64)
    order[forest.trace_index[root]] = root
    roots = order[chosen]
    end = frame.start_ns + frame.inclusive_ns.astype(np.int64)
    kinds, sources, services = [], [], []
    for trace in chosen.tolist():
        hit = [faults[i] for i in labels.trace_faults[trace]]
        kinds.append("+".join(sorted({f.kind for f in hit})) or NORMAL)
        sources.append("+".join(sorted({f.source for f in hit})) or NORMAL)
        services.append(sorted({f.service for f in hit}))
    episode = ((trace_start[chosen] - calibration_end) // int(episode_s * 1e9)).astype(np.int32)
    return pa.Table.from_arrays([
        pa.array([forest.trace_ids[t] for t in chosen.tolist()], pa.string()),
        pa.array(forest.spans["operation"].to_numpy(zero_copy_only=False)[roots].astype(str)),
        pa.array(trace_start[chosen]),
        pa.array(end[roots] - frame.start_ns[roots]),
        pa.array(frame.error[roots]),
        pa.array(labels.trace_anomalous[chosen]),
        pa.array(kinds, pa.string()), pa.array(sources, pa.string()), pa.array(services, pa.list_(pa.string())),
        pa.array(episode),
    ], schema=TRACES_SCHEMA)


def _fault_list(faults) -> dict[str, list[dict]]:
    hours: dict[str, list[dict]] = {}
    for fault in faults:
        hour = time.strftime("%Y-%m-%d %H", time.gmtime(fault.start_ns / 1e9))
        hours.setdefault(hour, []).append({"inject_timestamp": f"{fault.start_ns / 1e9:.3f}",
                                           "inject_pod": f"{fault.service}-testbed-0",
                                           "inject_type": INJECT_TYPES[fault.source],
                                           "end_timestamp": f"{fault.end_ns / 1e9:.3f}",
                                           "source": fault.source, "kind": fault.kind})
    return hours
