"""Injected faults with their ground truth, read from a fault list (Nezha's `fault_list.json`).

The list maps an hour (any key) to entries with `inject_timestamp` (Unix seconds),
`inject_pod` and `inject_type`. The true service is the pod name with its last
`pod_suffix_parts` dash-separated parts removed (Kubernetes names a Deployment's pods
`<deployment>-<replica set hash>-<pod hash>`, so 2 by default; 0 keeps the pod name as it is).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: Fault types that slow a service down (performance bottlenecks); the rest are code faults
#: (a wrong return value, an exception) that need not change latency.
LATENCY_FAULTS = frozenset({"cpu_contention", "cpu_consumed", "network_delay"})
DEFAULT_POD_SUFFIX_PARTS = 2


@dataclass(frozen=True)
class InjectedFault:
    service: str
    kind: str  # inject_type
    start_ns: int
    pod: str

    @property
    def is_latency(self) -> bool:
        return self.kind in LATENCY_FAULTS


def service_from_pod(pod: str, suffix_parts: int = DEFAULT_POD_SUFFIX_PARTS) -> str:
    """`cartservice-579f59597d-wc2lz` -> `cartservice` (with 2 suffix parts)."""
    if suffix_parts < 0:
        raise ValueError(f"suffix_parts must not be negative, not {suffix_parts}")
    parts = pod.split("-")
    if suffix_parts == 0:
        return pod
    if len(parts) <= suffix_parts:
        raise ValueError(f"pod name {pod!r} has no {suffix_parts} dash-separated parts after a service name")
    return "-".join(parts[:-suffix_parts])


def read_fault_list(path: str | Path, pod_suffix_parts: int = DEFAULT_POD_SUFFIX_PARTS) -> list[InjectedFault]:
    """The faults of a fault list, in time order; a malformed entry is a ValueError naming it."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected an object keyed by hour, got {type(document).__name__}")
    faults = []
    for key, entries in document.items():
        for index, entry in enumerate(entries if isinstance(entries, list) else [entries]):
            try:
                pod = str(entry["inject_pod"])
                faults.append(InjectedFault(
                    service=service_from_pod(pod, pod_suffix_parts), kind=str(entry["inject_type"]),
                    start_ns=int(float(entry["inject_timestamp"]) * 1e9), pod=pod,
                ))
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}: entry {key}[{index}] is malformed ({error!r}); it needs "
                                 "inject_timestamp, inject_pod and inject_type") from None
    return sorted(faults, key=lambda fault: fault.start_ns)


def code_fault_kinds(faults_json: str | Path) -> dict[tuple[int, str], str]:
    """What each code fault of a testbed campaign did, from its `faults.json`, keyed by (start
    in whole ms, service): `return share=S` or `exception share=S` (its `error` parameter, and
    the share of its operation's requests it hit, 1 when absent). The fault list names every
    code fault `exception`."""
    kinds = {}
    for fault in json.loads(Path(faults_json).read_text()):
        if fault["source"] == "code":
            parameters = fault["parameters"]
            mode = "exception" if float(parameters.get("error", 1.0)) >= 0.5 else "return"
            kinds[fault_key(fault["start_ns"], fault["service"])] = f"{mode} share={float(parameters.get('share', 1.0)):g}"
    return kinds


def fault_key(start_ns: int, service: str) -> tuple[int, str]:
    """A fault's key across a fault list and a campaign's faults.json (the list keeps ms)."""
    return round(start_ns / 1e6), service
