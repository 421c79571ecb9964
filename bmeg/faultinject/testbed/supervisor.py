"""`bmeg testbed up / down / status`: start, stop and describe the socialnet testbed.

`up` first repairs whatever an earlier run left (`repair`: its processes, CPU hogs, quotas,
paused processes, relays, network namespaces), then starts, in order: Kafka (shared, through
`scripts/kafka.sh`; left running by `down`), the OpenTelemetry Collector (`scripts/otelcol.sh`),
Redis, memcached and PostgreSQL (`stores`), the twelve services, each in its own cgroup v1
`cpu` cgroup with a quota of `DEFAULT_QUOTA_CORES` and pinned to one CPU, a front proxy per
service, and the open-loop load generator at `rate` requests/s against nginx-web-server's
proxy. Everything the testbed starts lives in the cgroup tree named after the port base
(see `state`), and `down` stops it all and removes the tree.
"""

from __future__ import annotations

import json
import shutil
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from bmeg.faultinject.testbed import system
from bmeg.faultinject.testbed.deployment import (
    CFS_PERIOD_US,
    DEFAULT_MIX,
    DEFAULT_QUOTA_CORES,
    ENTRY,
    SERVICES,
    service_cpu,
)
from bmeg.faultinject.testbed.faults import undo_all
from bmeg.faultinject.testbed.state import (
    GROUP_PREFIX,
    Testbed,
    TestbedState,
    instance_name,
    netns_prefix,
    record_process,
    service_cgroup,
    write_config,
)
from bmeg.faultinject.testbed.stores import start_stores, wait_port
from bmeg.faultinject.testbed.system import SOURCE_ROOT, ProcessRecord, TestbedError, spawn

DEFAULT_RATE = 50.0
#: order in which `down` stops roles: the load first, stores and the Collector last (spans flush)
STOP_ORDER = ("load", "pauser", "hog", "replica", "service", "relay", "proxy", "store", "collector")
HEALTH_TIMEOUT_S = 60.0
#: another port base's cgroup tree with no task, untouched this long, was left by a killed run
ABANDONED_AFTER_S = 600.0
#: the reference's user count (DeathStarBench's socfb-Reed98 graph has 962 users), 10 followees each
USERS, FOLLOWS = 962, 10
INIT_TIMEOUT_S = 300.0
#: the load generator's longest run (~35 MB of per-request records per hour at 200 req/s)
LOAD_MAX_S = 4 * 3600.0
#: Posts each user composes when the testbed comes up (then each user's timelines are read once, so
#: the caches hold them), unless `BMEG_TESTBED_POSTS_PER_USER` says otherwise (0: the stores start
#: empty). With 10, a page of the timelines the load reads (`start=0, stop=10`), they are full from
#: the start; with none the timelines fill for about half an hour (10 composes/s over 962 users),
#: reading more posts each minute: a drift of the application that a baseline recorded in its first
#: minutes reads as slowness (docs/issue-12.md, sessions 22-23).
DEFAULT_POSTS_PER_USER = 10
POSTS_ENV = "BMEG_TESTBED_POSTS_PER_USER"


def posts_per_user() -> int:
    """`BMEG_TESTBED_POSTS_PER_USER` as a whole number (`DEFAULT_POSTS_PER_USER` where unset);
    anything else is refused."""
    text = os.environ.get(POSTS_ENV, str(DEFAULT_POSTS_PER_USER))
    if not (text.isascii() and text.isdigit()):
        raise TestbedError(f"{POSTS_ENV}={text!r} is not a whole number of posts")
    return int(text)


def build_binary() -> str:
    """`bash testbed/build.sh` (it rebuilds only when the sources changed); the binary's path."""
    script = SOURCE_ROOT / "testbed" / "build.sh"
    if not script.is_file():
        raise TestbedError(f"{script} is missing: the socialnet application is not in this checkout")
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        raise TestbedError(f"testbed/build.sh failed (exit {result.returncode}): {result.stderr.strip()[-800:]}")
    return lines[-1]


def ensure_kafka() -> None:
    script = SOURCE_ROOT / "scripts" / "kafka.sh"
    if subprocess.run(["bash", str(script), "status"], capture_output=True).returncode == 0:
        return
    result = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True)
    if result.returncode != 0:
        raise TestbedError(f"scripts/kafka.sh start failed: {result.stderr.strip()[-800:]}")


# --- repair ----------------------------------------------------------------------------


def repair(testbed: Testbed) -> list[str]:
    """Undo everything a testbed (running, or left by a killed run) changed; returns what was done."""
    done: list[str] = []
    state = testbed.state()
    if state is not None:
        done += undo_all(testbed, state)
        for role in STOP_ORDER:
            for record in [r for r in state.processes.values() if r.role == role]:
                if record.alive():
                    system.stop(record)
                    done.append(f"stopped {record.name} (pid {record.pid})")
    killed = system.kill_cgroup_tree(testbed.group)
    if killed:
        done.append(f"killed {killed} processes left in {testbed.group}")
    system.remove_cgroup_tree(testbed.group)
    for name in system.list_netns(netns_prefix(testbed.base)):
        system.remove_netns(name)
        done.append(f"removed network namespace {name}")
    if state is not None:
        state.path.unlink(missing_ok=True)
    return done


# --- up / down / status ----------------------------------------------------------------


def up(testbed: Testbed, rate: float = DEFAULT_RATE, mix: str = DEFAULT_MIX, seed: int = 0) -> TestbedState:
    if rate <= 0:
        raise ValueError(f"rate must be positive, not {rate}")
    posts = posts_per_user()  # a bad value is refused before anything starts
    _check_reachable(testbed.run)
    repairs = repair(testbed) + system.remove_abandoned_cgroup_trees(
        GROUP_PREFIX, testbed.group, ABANDONED_AFTER_S)
    binary = build_binary()
    ensure_kafka()
    testbed.run.mkdir(parents=True, exist_ok=True)
    testbed.run.chmod(0o755)  # the stores run as nobody
    system.make_cgroup(testbed.group, None, CFS_PERIOD_US)
    state = TestbedState(base=testbed.base, run_dir=str(testbed.run), rate=rate, binary=binary, started_at=time.time(),
                         mix=mix, seed=seed)
    state.save()
    try:
        _start_all(testbed, state, posts)
    except BaseException:
        repair(testbed)
        raise
    state.demand_marks = {service: system.demand_mark(testbed.cgroup(service)) for service in SERVICES}
    state.save()
    if repairs:
        (testbed.run / "logs" / "repairs.log").write_text("\n".join(repairs) + "\n")
    return state


def _check_reachable(run: Path) -> None:
    """The stores run as nobody: every folder above the run dir must let others through."""
    for folder in run.resolve().parents:
        if folder.exists() and not folder.stat().st_mode & 0o001:
            raise TestbedError(f"{folder} is not searchable by others (mode {folder.stat().st_mode & 0o777:o}): "
                               f"the stores run as nobody; put the run dir elsewhere (BMEG_TESTBED_RUN_DIR)")


def _start_all(testbed: Testbed, state: TestbedState, posts: int) -> None:
    from bmeg.faultinject.testbed.collector import start_collector

    ports, logs = testbed.ports, testbed.run / "logs"
    collector = start_collector(testbed, service_cgroup(testbed, "collector"))
    state.otlp_endpoint, state.spans_file = collector.otlp_endpoint, str(collector.spans_file)
    record_process(state, collector.record)
    for record in start_stores(testbed.run, ports, lambda name: service_cgroup(testbed, name)):
        record_process(state, record)
    for service in SERVICES:
        start_service(testbed, state, service)
    proxies = service_cgroup(testbed, "proxies")
    for service in SERVICES:
        record_process(state, spawn(f"proxy:{service}", "proxy", [
            state.binary, "proxy", "--listen", f"127.0.0.1:{ports.proxy(service)}",
            "--upstream", f"127.0.0.1:{ports.service(service)}", "--admin", f"127.0.0.1:{ports.proxy_admin(service)}"],
            logs / f"proxy-{service}.log", cgroup=proxies))
    for service in SERVICES:
        wait_healthy(state, service, f"127.0.0.1:{ports.service(service)}")
        wait_port(ports.proxy(service), 10, f"proxy of {service}", state.processes[f"proxy:{service}"].alive)
    init_users(testbed, state, posts)
    start_load(testbed, state)


def init_users(testbed: Testbed, state: TestbedState, posts: int = 0) -> dict:
    """Register the users and their follows, then compose their first posts (`socialnet load
    --init`, closed loop): a fresh database has none, home timelines stay empty without follows,
    and timelines that fill during the run slow its reads as it goes (`posts` a user: `posts_per_user`)."""
    command = [state.binary, "load", "--target", f"http://127.0.0.1:{testbed.ports.proxy(ENTRY)}", "--init",
               "--users", str(USERS), "--follows", str(FOLLOWS), "--posts", str(posts),
               "--rate", "1", "--duration", "0.001"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=INIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"registering {USERS} users and their posts took over {INIT_TIMEOUT_S:.0f} s") from None
    try:
        summary = json.loads(result.stdout)["init"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise TestbedError(f"socialnet load --init failed (exit {result.returncode}): {result.stderr.strip()[-500:]}") from None
    if result.returncode != 0 or summary.get("errors"):
        raise TestbedError(f"socialnet load --init: {summary.get('errors')} errors, first: {summary.get('first_error')}")
    (testbed.run / "logs" / "init.json").write_text(json.dumps(summary))
    return summary


def start_load(testbed: Testbed, state: TestbedState) -> ProcessRecord:
    """(Re)start the open-loop load generator at the testbed's rate. It keeps a record per request
    until it ends, so it runs at most `LOAD_MAX_S`; campaigns restart it when they begin."""
    old = state.processes.get("load")
    if old is not None and old.alive():
        system.stop(old)
    return record_process(state, spawn("load", "load", [
        state.binary, "load", "--target", f"http://127.0.0.1:{testbed.ports.proxy(ENTRY)}", "--rate", f"{state.rate:g}",
        "--duration", f"{LOAD_MAX_S:g}", "--users", str(USERS), "--mix", state.mix, "--seed", str(state.seed)],
        testbed.run / "logs" / "load.log", cgroup=service_cgroup(testbed, "load")))


def start_service(testbed: Testbed, state: TestbedState, service: str, instance: int = 0) -> ProcessRecord:
    """Write the service's configuration (with the overrides in force) and start it in its cgroup."""
    path = write_config(testbed, state, service, instance)
    name = instance_name(service, instance)
    cgroup = service_cgroup(testbed, name, DEFAULT_QUOTA_CORES)
    return record_process(state, spawn(name, "service" if instance == 0 else "replica",
                                [state.binary, "service", "--config", str(path)],
                                testbed.run / "logs" / f"{name}.log", cpu=service_cpu(service), cgroup=cgroup))


def wait_healthy(state: TestbedState, name: str, address: str, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    record = state.processes[name]
    last = "no answer"
    while time.monotonic() < deadline:
        if not record.alive():
            raise TestbedError(f"{name} exited while starting; see {record.log}:\n{_tail(record.log)}")
        try:
            with urllib.request.urlopen(f"http://{address}/healthz", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as error:
            last = str(error)
        time.sleep(0.2)
    raise TestbedError(f"{name} was not healthy within {timeout_s:.0f} s ({last}); see {record.log}")


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def down(testbed: Testbed) -> list[str]:
    """Stop everything, undo every fault, and delete the stores' data and the spans file (the
    logs stay in the run dir; the spans went to Kafka too)."""
    done = repair(testbed)
    data = [testbed.run / "stores", testbed.run / "spans.otlp"]
    for path in data:
        if path.is_dir():
            shutil.rmtree(path)
        path.unlink(missing_ok=True)
    return done


def status(testbed: Testbed) -> dict:
    """What runs: each process (pid, alive, port, cgroup quota and CPU used), the load rate, faults."""
    state = testbed.state()
    leftovers = [p.name for p in system.cgroup_tree(testbed.group)]
    if state is None:
        return {"running": False, "run_dir": str(testbed.run), "port_base": testbed.base,
                "leftover_cgroups": leftovers, "leftover_netns": system.list_netns(netns_prefix(testbed.base))}
    system.reap()
    ports = testbed.ports
    processes = []
    for record in state.processes.values():
        entry = {"name": record.name, "role": record.role, "pid": record.pid, "alive": record.alive(),
                 "state": system.process_state(record.pid) if record.alive() else None, "cpu": record.cpu}
        service = record.name.split(":", 1)[-1]
        if record.role == "service":
            entry["port"] = ports.service(service)
        elif record.role == "proxy":
            entry["port"], entry["admin_port"] = ports.proxy(service), ports.proxy_admin(service)
        elif record.role == "store":
            entry["port"] = getattr(ports, record.name)
        if record.cgroup and Path(record.cgroup).is_dir():
            entry["cpu_quota_cores"] = system.quota_cores(Path(record.cgroup))
            entry["cpu_used_s"] = round(system.cpu_usage_s(Path(record.cgroup)), 3)
        processes.append(entry)
    return {"running": all(p["alive"] for p in processes if p["role"] != "hog"),
            "run_dir": state.run_dir, "port_base": state.base, "rate": state.rate,
            "entry": f"http://127.0.0.1:{ports.proxy(ENTRY)}", "otlp_endpoint": state.otlp_endpoint,
            "spans_file": state.spans_file, "uptime_s": round(time.time() - state.started_at, 1),
            "processes": processes, "faults": state.faults, "overrides": state.overrides,
            "pid": os.getpid()}
