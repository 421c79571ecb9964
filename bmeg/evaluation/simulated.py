"""Synthetic validation for the root-cause harness: labelled fault windows simulated from a twin.

Methods and thresholds are chosen here, never on real labelled faults. `simulated_faults`
takes a topology (a twin fitted by `bmeg twin fit`, or any spec), simulates a normal period,
then one episode per (service, fault source) with that fault active for the whole episode,
and writes each episode to its own trace file with a fault list in Nezha's layout, so that
`run_rca` sees simulated faults exactly as it sees real ones.

Fault types are named as the real fault lists name them where the mechanics match:
`interference` (a noisy neighbour slowing the replica's CPU work) is `cpu_contention`,
`saturation` (a CPU limit too small) is `cpu_consumed`, `network` (netem delay on every
message the service sends) is `network_delay`.

Code faults change what a service does, not how fast: the simulator has no such source, so
they are applied to a fault-free episode's spans (`code_fault`, the mechanics in
`bmeg.faultinject.codefaults`: an early return or an exception in a share of the service's
requests; its calls vanish, the error status goes up the callers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from bmeg.faultinject import Fault, TopologySpec, simulate, spans_of
from bmeg.faultinject.codefaults import CODE_FAULTS, apply_code_fault
from bmeg.faultinject.scenario import SCHEDULER_PARAMETERS, SOURCE_PARAMETERS, kernel_form_parameters
from bmeg.traces.io import write_spans

#: Simulated fault sources and the real fault types they stand for.
SOURCES = {"interference": "cpu_contention", "saturation": "cpu_consumed", "network": "network_delay"}
#: Share of the faulty service's requests a code fault hits.
CODE_FAULT_SHARE = 0.5
#: Simulated time between episodes, so that windows never overlap.
EPISODE_GAP_S = 600
EPOCH_NS = 1_700_000_000 * 10**9


@dataclass(frozen=True)
class SimulatedFaults:
    normal: pa.Table  # spans of the normal period
    traces: Path  # folder of episode files
    fault_list: Path  # fault list in Nezha's layout (pod = service: use pod_suffix_parts=0)
    window_minutes: float


def simulated_faults(spec: TopologySpec, out: Path, normal_s: float = 60.0, window_s: float = 60.0,
                     seed: int = 0, services: list[str] | None = None, scheduler: bool = False) -> SimulatedFaults:
    """Simulate a normal period and one faulty episode per service and source under `out`. The
    CPU faults slow every burst alike (a smaller core, a noisy neighbour) or, with `scheduler`,
    work as the kernel's scheduler makes them (a CFS quota, a hog's time slices: `kernel_form_parameters`),
    as the testbed injects them and `bmeg bootstrap` trains on them."""
    rng = np.random.default_rng(seed)
    out = Path(out)
    (out / "traces").mkdir(parents=True, exist_ok=True)
    normal = spans_of(simulate(spec, [], normal_s, seed), EPOCH_NS, seed)
    targets = services or spec.code_services()
    entries = []
    kinds = [*SOURCES, *CODE_FAULTS]
    for index, (service, kind) in enumerate((s, k) for s in targets for k in kinds):
        start_ns = EPOCH_NS + (index + 1) * EPISODE_GAP_S * 10**9
        episode_seed = seed * 10_000 + index + 1
        if kind in CODE_FAULTS:
            parameters = {"share": CODE_FAULT_SHARE}
            spans = code_fault(spans_of(simulate(spec, [], window_s, episode_seed), start_ns, episode_seed),
                               service, kind, CODE_FAULT_SHARE, rng)
        else:
            parameters = {name: float(rng.uniform(lo, hi)) for name, (lo, hi) in SOURCE_PARAMETERS[kind].items()}
            if kind == "network":
                parameters.pop("bandwidth_kbit")  # a delay fault, as the real lists' network_delay
            if scheduler and kind in SCHEDULER_PARAMETERS:
                parameters = kernel_form_parameters(kind, parameters, rng)
            fault = Fault(service, kind, "single", 0.0, window_s, parameters)
            spans = spans_of(simulate(spec, [fault], window_s, episode_seed), start_ns, episode_seed)
        if spans.num_rows == 0:
            continue  # the service is never visited: nothing to find
        write_spans(spans, out / "traces" / f"episode_{index:04d}.parquet", "parquet")
        entries.append({"inject_timestamp": str(start_ns / 1e9), "inject_pod": service,
                        "inject_type": SOURCES.get(kind, kind), "parameters": parameters})
    fault_list = out / "fault_list.json"
    fault_list.write_text(json.dumps({"simulated": entries}, indent=1))
    return SimulatedFaults(normal, out / "traces", fault_list, window_s / 60)


def code_fault(spans: pa.Table, service: str, kind: str, share: float, rng: np.random.Generator) -> pa.Table:
    """`spans` with a `return` or `exception` fault in `service` (`bmeg.faultinject.codefaults`).
    Only traces that visit the service are kept: the others cannot show the fault."""
    return apply_code_fault(spans, service, kind, share, rng).spans
