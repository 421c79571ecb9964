"""The testbed's faults, each done by a real mechanism and undone cleanly.

| source            | mechanism                                                                 | undo                       |
|-------------------|---------------------------------------------------------------------------|----------------------------|
| interference      | a `stress-ng --cpu 1` hog pinned to the target's CPU, in a cgroup whose   | kill the hog, remove its   |
|                   | `cpu.shares` is (factor - 1) x the service's: the target keeps ~1/factor  | cgroup (and the quota      |
|                   | of its CPU while both want it (its CPU neighbours lose as much); with     | restored)                  |
|                   | `shared_cgroup` 1 the hog's cgroup is a child of the target's (a job in   |                            |
|                   | the same pod), whose quota grows by the hog's core: the target alone      |                            |
|                   | keeps ~1/factor, its CPU neighbours compete with one cgroup as before     |                            |
| saturation        | the target's `cpu.cfs_quota_us` cut to `capacity` x twice the CPU it has  | quota and period restored  |
|                   | used per second since `up` (its demand, start-up left out): 1 leaves      |                            |
|                   | the headroom a limit needs for bursts, 0.5 its average use, below it      |                            |
|                   | cannot keep up;                                                           |                            |
|                   | the CFS period lengthened (up to 1 s) so the quota stays >= the kernel's |                            |
|                   | 1-ms minimum                                                              |                            |
| network           | the delay (ms +- jitter) set on the target's front proxy, which every     | delay 0                    |
|                   | caller goes through (`bandwidth_kbit`: the front proxy restarted with its |                            |
|                   | upstream through a relay in a network namespace shaped by `tc tbf`)       | proxy restored, netns gone |
| misconfiguration  | `pool_size`: workers (and db_pool where the service has a database) set  | the normal config, SIGHUP  |
|                   | to it; `hit_ratio`: cache_items cut to a few entries; config + SIGHUP     |                            |
| background        | SIGSTOP/SIGCONT pauses of `pause_ms` every ~`every_ms` (a pauser process) | pauser stopped, SIGCONT    |
| code              | `POST /_admin/fault` {"operation", "mode": return or error, "share"}:     | mode none                  |
|                   | `share` (0-1], default 1) of the operation's requests fail or return      |                            |
|                   | early, every 1/share-th by a counter                                      |                            |

Every fault writes its undo record into the state file *before* it changes anything
(write-ahead), so `undo_all` (run by `up`, `down` and every campaign start) can undo a fault
whose campaign was killed at any point. Undo is idempotent.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bmeg.faultinject.cpu import saturation_quota
from bmeg.faultinject.testbed import system
from bmeg.faultinject.testbed.deployment import (
    CFS_PERIOD_US,
    CACHES,
    CODE_OPERATIONS,
    SERVICES,
    STORE_USERS,
    service_cpu,
)
from bmeg.faultinject.testbed.state import TestbedState, netns_prefix, record_process, service_cgroup, write_config
from bmeg.faultinject.testbed.stores import wait_port
from bmeg.faultinject.testbed.system import ProcessRecord, TestbedError, spawn

#: cgroup v1 cpu.shares of a service's cgroup (the kernel's default)
SERVICE_SHARES = 1024
#: cache size a `hit_ratio` misconfiguration sets: a cache of a handful of entries
SMALL_CACHE_ITEMS = 4
#: hogs and pausers end by themselves this long after the fault should have: a safety net
SAFETY_MARGIN_S = 30.0
TESTBED_SOURCES = ("interference", "saturation", "network", "misconfiguration", "background", "code")


def admin_post(address: str, path: str, body: dict, timeout_s: float = 5.0) -> None:
    request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if response.status >= 300:
                raise TestbedError(f"POST {address}{path} answered {response.status}")
    except urllib.error.HTTPError as error:
        raise TestbedError(f"POST {address}{path} {body} answered {error.code}: {error.read()[:200]!r}") from None
    except (urllib.error.URLError, OSError) as error:
        raise TestbedError(f"POST {address}{path} failed: {error}") from None


def _servicerecord_process(state: TestbedState, service: str) -> ProcessRecord:
    if service not in SERVICES:
        raise TestbedError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    record = state.processes.get(service)
    if record is None or not record.alive():
        raise TestbedError(f"{service} is not running (bmeg testbed status)")
    return record


def apply_fault(testbed, state: TestbedState, fault_id: str, service: str, source: str,
                parameters: dict[str, float], until_s: float, seed: int = 0) -> dict:
    """Start a fault now; `until_s` (Unix seconds) bounds hogs and pausers should nobody undo it."""
    if fault_id in state.faults:
        raise TestbedError(f"fault {fault_id} is already applied")
    if source not in TESTBED_SOURCES:
        raise TestbedError(f"unknown fault source {source!r}; known: {', '.join(TESTBED_SOURCES)}")
    record = _servicerecord_process(state, service)
    undo: dict = {"service": service, "source": source, "parameters": dict(parameters)}
    state.faults[fault_id] = undo
    state.save()  # write-ahead: whatever happens next, undo_all sees this fault
    try:
        _APPLY[source](testbed, state, fault_id, record, parameters, until_s, seed, undo)
    except BaseException:
        undo_fault(testbed, state, fault_id)
        raise
    undo["applied_ns"] = time.time_ns()
    state.save()
    return undo


def undo_fault(testbed, state: TestbedState, fault_id: str) -> int | None:
    """Undo one fault (idempotent); returns when it ended (ns), None when it was not applied."""
    undo = state.faults.get(fault_id)
    if undo is None:
        return None
    _UNDO[undo["source"]](testbed, state, fault_id, undo)
    del state.faults[fault_id]
    state.save()
    return time.time_ns()


def undo_all(testbed, state: TestbedState) -> list[str]:
    done = []
    for fault_id in list(state.faults):
        undo = state.faults[fault_id]
        try:
            undo_fault(testbed, state, fault_id)
            done.append(f"undid {undo['source']} fault {fault_id} on {undo['service']}")
        except TestbedError as error:  # e.g. the service is gone: nothing of the fault is left in it
            done.append(f"fault {fault_id}: {error}")
            del state.faults[fault_id]
            state.save()
    return done


# --- interference: a CPU hog on the target's CPU -----------------------------------------


def _interference(testbed, state, fault_id, record, parameters, until_s, seed, undo) -> None:
    factor = float(parameters.get("factor", 3.0))
    cpu = record.cpu if record.cpu is not None else service_cpu(undo["service"])
    # CFS weighs sibling cgroups: a hog beside the services' cgroups slows every service pinned to
    # its CPU as much as the target (half the testbed's services); one inside the target's cgroup
    # competes with the target's threads alone, the cgroup keeping one share on the CPU
    shared = bool(parameters.get("shared_cgroup", 0.0))
    target = Path(record.cgroup or testbed.cgroup(undo["service"]))
    cgroup = target / f"hog-{fault_id}" if shared else testbed.cgroup(f"hog-{fault_id}")
    undo["cgroup"] = str(cgroup)
    if shared:
        undo["target_cgroup"], undo["quota_cores"] = str(target), system.quota_cores(target)
    state.save()
    if shared:  # the hog's core on top of the target's own limit: the hog does not throttle it
        system.set_quota(target, hog_quota(undo["quota_cores"]))
    seconds = max(1, int(until_s - time.time() + SAFETY_MARGIN_S))
    hog = spawn_hog(f"hog:{fault_id}", cgroup, factor, cpu, seconds, Path(state.run_dir) / "logs" / "hogs.log")
    undo["hog"] = hog.to_json()


def spawn_hog(name: str, cgroup: Path, factor: float, cpu: int, seconds: int, log: Path) -> ProcessRecord:
    """A one-core `stress-ng` hog pinned to `cpu` for `seconds`, in a new cgroup `cgroup` weighted
    `factor - 1` times a service's CPU shares: beside a service's threads in one parent cgroup, it
    takes `factor - 1` times their CPU time while both want it."""
    system.make_cgroup(cgroup, None, CFS_PERIOD_US)
    (cgroup / "cpu.shares").write_text(str(max(2, int(SERVICE_SHARES * (factor - 1)))))
    return spawn(name, "hog", ["stress-ng", "--cpu", "1", "--cpu-method", "int64", "--taskset", str(cpu),
                               "--timeout", f"{seconds}s", "--quiet"], log, cpu=cpu, cgroup=cgroup)


def _undo_interference(testbed, state, fault_id, undo) -> None:
    if "hog" in undo:
        system.stop(ProcessRecord(**undo["hog"]), timeout_s=2)
    if "cgroup" in undo:
        system.remove_cgroup_tree(Path(undo["cgroup"]))
    target = Path(undo.get("target_cgroup", ""))
    if "quota_cores" in undo and target.is_dir():
        system.set_quota(target, undo["quota_cores"])


def hog_quota(quota_cores: float | None) -> float | None:
    """The quota of a cgroup that a one-core hog joins: its own plus the hog's core (None: unlimited)."""
    return None if quota_cores is None else quota_cores + 1.0


# --- saturation: the CPU quota cut -------------------------------------------------------


def _saturation(testbed, state, fault_id, record, parameters, until_s, seed, undo) -> None:
    cgroup = Path(record.cgroup or testbed.cgroup(undo["service"]))
    undo["cgroup"], undo["quota_cores"], undo["period_us"] = str(cgroup), system.quota_cores(cgroup), system.period_us(cgroup)
    state.save()
    demand = system.cpu_demand_cores(record, cgroup, state.demand_marks.get(undo["service"]))
    cores, period = saturation_quota(float(parameters.get("capacity", 0.2)), demand)
    undo["cut_cores"] = round(cores, 6)
    system.set_period(cgroup, period)
    system.set_quota(cgroup, cores)


def _undo_saturation(testbed, state, fault_id, undo) -> None:
    cgroup = Path(undo.get("cgroup", ""))
    if "quota_cores" in undo and cgroup.is_dir():
        system.set_period(cgroup, undo.get("period_us", CFS_PERIOD_US))
        system.set_quota(cgroup, undo["quota_cores"])


# --- network: delay on the front proxy, bandwidth through a shaped namespace ---------------


def _proxy_admin(testbed, service: str) -> str:
    return f"127.0.0.1:{testbed.ports.proxy_admin(service)}"


def _network(testbed, state, fault_id, record, parameters, until_s, seed, undo) -> None:
    service = undo["service"]
    delay = float(parameters.get("delay_ms", 0.0))
    if delay > 0:
        undo["delay"] = True
        state.save()
        admin_post(_proxy_admin(testbed, service), "/_admin/delay",
                   {"ms": delay, "jitter_ms": float(parameters.get("jitter_ms", 0.0))})
    if parameters.get("bandwidth_kbit"):
        _shape_bandwidth(testbed, state, fault_id, service, int(parameters["bandwidth_kbit"]), undo)


def _undo_network(testbed, state, fault_id, undo) -> None:
    service = undo["service"]
    if undo.get("delay"):
        proxy = state.processes.get(f"proxy:{service}")
        if proxy is not None and proxy.alive():
            admin_post(_proxy_admin(testbed, service), "/_admin/delay", {"ms": 0})
    if "netns" in undo:
        _unshape_bandwidth(testbed, state, fault_id, undo)


def _netns_addresses(testbed, service: str) -> tuple[str, str]:
    """A /30 per service in 10.213.0.0/16 (10.213.<port base % 64 * 4 + ...>)."""
    index = SERVICES.index(service)
    third = (testbed.base // 100) % 256
    return f"10.213.{third}.{4 * index + 1}", f"10.213.{third}.{4 * index + 2}"


def _shape_bandwidth(testbed, state, fault_id, service: str, kbit: int, undo: dict) -> None:
    """callers -> front proxy -> relay in the shaped namespace (ns side) -> host relay -> service.

    The front proxy is restarted with the namespace relay as its upstream (its TCP connections
    end, callers reconnect); both directions cross the veth pair and its tbf qdiscs."""
    name = f"{netns_prefix(testbed.base)}{SERVICES.index(service)}"
    host_ip, ns_ip = _netns_addresses(testbed, service)
    undo["netns"] = name
    state.save()
    system.make_shaped_netns(name, host_ip, ns_ip, kbit)
    ports, logs, binary = testbed.ports, Path(state.run_dir) / "logs", state.binary
    relays = service_cgroup(testbed, "relays")
    port = ports.relay(service)
    host_relay = spawn(f"relay-host:{service}", "relay", [binary, "proxy", "--listen", f"{host_ip}:{port}",
                       "--upstream", f"127.0.0.1:{ports.service(service)}"], logs / f"relay-{service}.log", cgroup=relays)
    undo["relays"] = [host_relay.to_json()]
    state.save()
    ns_relay = spawn(f"relay-ns:{service}", "relay", ["ip", "netns", "exec", name, binary, "proxy", "--listen",
                     f"{ns_ip}:{port}", "--upstream", f"{host_ip}:{port}"], logs / f"relay-{service}.log", cgroup=relays)
    undo["relays"].append(ns_relay.to_json())
    state.save()
    _restart_proxy(testbed, state, service, f"{ns_ip}:{port}")


def _unshape_bandwidth(testbed, state, fault_id, undo: dict) -> None:
    service = undo["service"]
    proxy = state.processes.get(f"proxy:{service}")
    if proxy is not None and proxy.command[proxy.command.index("--upstream") + 1] != f"127.0.0.1:{testbed.ports.service(service)}":
        _restart_proxy(testbed, state, service, f"127.0.0.1:{testbed.ports.service(service)}")
    for relay in undo.get("relays", []):
        system.stop(ProcessRecord(**relay), timeout_s=2)
    system.remove_netns(undo["netns"])


def _restart_proxy(testbed, state: TestbedState, service: str, upstream: str) -> None:

    old = state.processes[f"proxy:{service}"]
    system.stop(old, timeout_s=2)
    command = list(old.command)
    command[command.index("--upstream") + 1] = upstream
    new = record_process(state, spawn(old.name, "proxy", command, Path(old.log), cgroup=Path(old.cgroup) if old.cgroup else None))
    wait_port(testbed.ports.proxy(service), 10, f"proxy of {service}", new.alive)


# --- misconfiguration: the service's config, reloaded -------------------------------------


def misconfiguration_overrides(service: str, parameters: dict[str, float]) -> dict[str, int]:
    """The service with a cache gets it cut to a few entries (whatever was drawn: the simulator's
    campaigns draw `hit_ratio` for its stores, not for it); `pool_size`, or a `hit_ratio` on a
    service without a cache, sets the worker pool, and the store pool where the service has
    stores, to `pool_size` (1 when not given)."""
    overrides: dict[str, int] = {}
    if service in CACHES:
        overrides["cache_items"] = SMALL_CACHE_ITEMS
    if parameters.get("pool_size") is not None or not overrides:
        size = int(parameters.get("pool_size", 1))
        overrides["workers"] = size
        if service in STORE_USERS:
            overrides["db_pool"] = size
    return overrides


def reload_service(testbed, state: TestbedState, service: str) -> None:
    """Rewrite the configuration of each instance of the service (its replicas too) with its
    overrides in force and SIGHUP it (it re-reads workers, db_pool and cache_items without
    dropping requests)."""
    for instance, record in service_instances(state, service):
        write_config(testbed, state, service, instance)
        system.signal_process(record, signal.SIGHUP)


def service_instances(state: TestbedState, service: str) -> list[tuple[int, ProcessRecord]]:
    """The running instances of a service, (instance number, process), the first one first."""
    found = []
    for name, record in state.processes.items():
        number = "0" if name == service else name.removeprefix(f"{service}-")
        if number.isdigit() and record.role in ("service", "replica") and record.alive():
            found.append((int(number), record))
    return sorted(found, key=lambda pair: pair[0])


def _misconfiguration(testbed, state, fault_id, record, parameters, until_s, seed, undo) -> None:
    service = undo["service"]
    undo["overrides_before"] = dict(state.overrides.get(service, {}))
    state.save()
    state.overrides[service] = {**undo["overrides_before"], **misconfiguration_overrides(service, parameters)}
    state.save()
    reload_service(testbed, state, service)


def _undo_misconfiguration(testbed, state, fault_id, undo) -> None:
    service = undo["service"]
    if "overrides_before" not in undo:
        return
    if undo["overrides_before"]:
        state.overrides[service] = undo["overrides_before"]
    else:
        state.overrides.pop(service, None)
    state.save()
    reload_service(testbed, state, service)


# --- background: stop-the-world pauses ---------------------------------------------------


def _background(testbed, state, fault_id, record, parameters, until_s, seed, undo) -> None:
    cgroup = testbed.cgroup(f"pauser-{fault_id}")
    undo["target"], undo["cgroup"] = record.to_json(), str(cgroup)
    state.save()
    system.make_cgroup(cgroup, None, CFS_PERIOD_US)
    pauser = spawn(f"pauser:{fault_id}", "pauser", [
        sys.executable, str(Path(__file__).with_name("pauser.py")), str(record.pid), str(record.ticks),
        f"{float(parameters.get('pause_ms', 100.0)):g}", f"{float(parameters.get('every_ms', 500.0)):g}",
        str(seed), f"{until_s:.3f}"], Path(state.run_dir) / "logs" / "pausers.log", cgroup=cgroup)
    undo["pauser"] = pauser.to_json()


def _undo_background(testbed, state, fault_id, undo) -> None:
    if "pauser" in undo:
        system.stop(ProcessRecord(**undo["pauser"]), timeout_s=2)
    if "target" in undo:  # the pauser may have been SIGKILLed while the target was stopped
        system.signal_process(ProcessRecord(**undo["target"]), signal.SIGCONT)
    if "cgroup" in undo:
        system.remove_cgroup_tree(Path(undo["cgroup"]))


# --- code faults: an operation returns early or fails -------------------------------------


def code_operation(service: str, value: str | float | None) -> str:
    """A code fault's operation: a route as given, or an index into `CODE_OPERATIONS[service]`
    (campaigns draw numbers: fault parameters are numeric)."""
    if isinstance(value, str) and value:
        return value
    choices = CODE_OPERATIONS.get(service, ())
    if value is None or not choices:
        raise TestbedError(f"a code fault on {service} needs an operation")
    return choices[int(value) % len(choices)]


def _code(testbed, state, fault_id, record, parameters, until_s, seed, undo) -> None:
    service = undo["service"]
    operation = code_operation(service, parameters.get("operation"))
    undo["operation"] = operation
    state.save()
    mode = "error" if float(parameters.get("error", 1.0)) >= 0.5 else "return"
    admin_post(f"127.0.0.1:{testbed.ports.service(service)}", "/_admin/fault",
               {"operation": operation, "mode": mode, "share": float(parameters.get("share", 1.0))})


def _undo_code(testbed, state, fault_id, undo) -> None:
    service = undo["service"]
    record = state.processes.get(service)
    if "operation" in undo and record is not None and record.alive():
        admin_post(f"127.0.0.1:{testbed.ports.service(service)}", "/_admin/fault",
                   {"operation": undo["operation"], "mode": "none"})


_APPLY = {"interference": _interference, "saturation": _saturation, "network": _network,
          "misconfiguration": _misconfiguration, "background": _background, "code": _code}
_UNDO = {"interference": _undo_interference, "saturation": _undo_saturation, "network": _undo_network,
         "misconfiguration": _undo_misconfiguration, "background": _undo_background, "code": _undo_code}
