"""The operating-system mechanisms the testbed uses, each small and undoable.

- Processes: started in a session (process group) of their own, so stopping one stops its
  children too (stress-ng's workers); pinned to a CPU and placed in a cgroup *before* they
  exec (so every thread they create inherits both). A `ProcessRecord` keeps the pid with the
  process's start time (`/proc/PID/stat` field 22), so a pid the kernel reused for another
  process is never signalled.
- cgroup v1 `cpu` controller: one cgroup per service under `/sys/fs/cgroup/cpu/<group>/`;
  the CPU limit is `cpu.cfs_quota_us` over `cpu.cfs_period_us`.
- Network namespaces with a veth pair and a `tc tbf` qdisc on both ends (this kernel has no
  netem): bandwidth faults route an edge through a relay inside the namespace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CPU_CGROUP_ROOT = Path(os.environ.get("BMEG_CPU_CGROUP_ROOT", "/sys/fs/cgroup/cpu"))
#: the testbed runs from a source checkout: the Go application (`testbed/`) and the Kafka and
#: Collector scripts (`scripts/`) are not part of the installed package
SOURCE_ROOT = Path(__file__).resolve().parents[3]
#: The shortest span a demand is measured over from a mark (`cpu_demand_cores`): CPU time is
#: counted in 10-ms ticks, so a service using 0.005 cores needs seconds to show its rate
MIN_DEMAND_S = 5.0


class TestbedError(RuntimeError):
    """Something the testbed needs is missing or failed (the message says what to do)."""


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    return int(text[text.rindex(")") + 2 :].split()[19])


def process_state(pid: int) -> str | None:
    """The process's state letter (R, S, T for stopped, Z...), None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2]


@dataclass
class ProcessRecord:
    """A process the testbed started: enough to find it again from another process."""

    name: str
    role: str  # service, proxy, store, collector, load, hog, relay, pauser
    pid: int
    ticks: int
    command: list[str]
    log: str
    cgroup: str | None = None
    cpu: int | None = None

    def alive(self) -> bool:
        return start_ticks(self.pid) == self.ticks and process_state(self.pid) not in (None, "Z")

    def to_json(self) -> dict:
        return asdict(self)


def spawn(name: str, role: str, command: list[str], log: Path, *, cpu: int | None = None,
          cgroup: Path | None = None, user: str | None = None, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> ProcessRecord:
    """Start `command` in its own session, pinned to `cpu` and inside `cgroup` from its first instruction."""
    log.parent.mkdir(parents=True, exist_ok=True)
    procs = str(cgroup / "cgroup.procs") if cgroup else None

    def place() -> None:  # runs in the child between fork and exec
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        if procs:
            with open(procs, "w") as handle:
                handle.write(str(os.getpid()))

    if user is not None:  # drop privileges after `place` ran as root (cgroup.procs is root's)
        command = ["setpriv", f"--reuid={user}", f"--regid={_group_of(user)}", "--clear-groups", "--", *command]
    with open(log, "ab") as out:
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=place, env=env, cwd=cwd)
        except (OSError, subprocess.SubprocessError) as error:
            raise TestbedError(f"cannot start {name} ({' '.join(command)}): {error}") from None
    ticks = start_ticks(process.pid)
    # Popen's object is dropped: the process outlives this one; reaped by init when we exit
    _children.append(process)
    return ProcessRecord(name, role, process.pid, ticks if ticks is not None else -1, command, str(log),
                         str(cgroup) if cgroup else None, cpu)


#: Popen objects of processes started here (polled so that exited ones do not linger as zombies)
_children: list[subprocess.Popen] = []


def reap() -> None:
    for child in list(_children):
        if child.poll() is not None:
            _children.remove(child)


def _group_of(user: str) -> str:
    import grp
    import pwd

    return grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name


def signal_group(record: ProcessRecord, signum: int) -> bool:
    """Send `signum` to the record's process group, only if the record's process still runs."""
    if not record.alive():
        return False
    try:
        os.killpg(record.pid, signum)
    except ProcessLookupError:
        return False
    return True


def signal_process(record: ProcessRecord, signum: int) -> bool:
    if not record.alive():
        return False
    try:
        os.kill(record.pid, signum)
    except ProcessLookupError:
        return False
    return True


def stop(record: ProcessRecord, timeout_s: float = 5.0) -> None:
    """SIGTERM the process group (SIGCONT first: a paused process cannot exit), SIGKILL after `timeout_s`."""
    if not record.alive():
        return
    signal_group(record, signal.SIGCONT)
    signal_group(record, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reap()
        if not record.alive():
            return
        time.sleep(0.05)
    signal_group(record, signal.SIGKILL)
    while record.alive() and time.monotonic() < deadline + 5:
        reap()
        time.sleep(0.05)


def pin(record: ProcessRecord, cpu: int) -> None:
    """Move every thread of a running process to `cpu` (`taskset -a`: Go's threads all go)."""
    if not record.alive():
        raise TestbedError(f"{record.name} (pid {record.pid}) is not running")
    run(["taskset", "-a", "-p", "-c", str(cpu), str(record.pid)])
    record.cpu = cpu


# --- cgroup v1 cpu ----------------------------------------------------------------------


def cgroup_path(group: str, name: str | None = None) -> Path:
    return CPU_CGROUP_ROOT / group / name if name else CPU_CGROUP_ROOT / group


def make_cgroup(path: Path, quota_cores: float | None, period_us: int) -> None:
    if not CPU_CGROUP_ROOT.is_dir():
        raise TestbedError(f"no cgroup v1 cpu controller at {CPU_CGROUP_ROOT} (set BMEG_CPU_CGROUP_ROOT)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(period_us))
    except OSError as error:
        raise TestbedError(f"cannot create cgroup {path}: {error} (the testbed needs root)") from None
    set_quota(path, quota_cores)


def set_quota(path: Path, cores: float | None) -> None:
    """CPU limit in cores (None: unlimited)."""
    period = int((path / "cpu.cfs_period_us").read_text())
    quota = -1 if cores is None else max(1000, int(round(cores * period)))
    (path / "cpu.cfs_quota_us").write_text(str(quota))


def set_period(path: Path, period_us: int) -> None:
    """The CFS period (1 ms - 1 s); the quota keeps its microseconds, so set it afterwards."""
    (path / "cpu.cfs_period_us").write_text(str(min(1_000_000, max(1000, int(period_us)))))


def period_us(path: Path) -> int:
    return int((path / "cpu.cfs_period_us").read_text())


def quota_cores(path: Path) -> float | None:
    quota = int((path / "cpu.cfs_quota_us").read_text())
    if quota < 0:
        return None
    return quota / int((path / "cpu.cfs_period_us").read_text())


def cpu_usage_s(path: Path) -> float:
    """CPU seconds used so far by the processes now in the cgroup (user + system, all threads;
    cpuacct is a hierarchy of its own on this machine, so /proc is read instead)."""
    ticks = 0
    for pid in (path / "cgroup.procs").read_text().split():
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = text[text.rindex(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _uptime_s() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def demand_mark(cgroup: Path) -> list[float]:
    """[CPU seconds the cgroup's processes have used, uptime in seconds]: where `cpu_demand_cores`
    starts counting (a list: it is kept in the state file's JSON)."""
    return [cpu_usage_s(cgroup), _uptime_s()]


def cpu_demand_cores(record: ProcessRecord, cgroup: Path, mark: list[float] | None = None) -> float:
    """The CPU the processes in `cgroup` used per second (their demand): since `mark`
    (`demand_mark`, taken once the testbed is up) where it lies at least `MIN_DEMAND_S` back and
    the CPU counted has not fallen since (a restart), else since `record` started. Since the start alone
    counts the service's start-up: social-graph-service used 0.005 cores at 100 req/s and 0.03-0.15
    on average since its start over its first 80 s, so a saturation quota sized from that did
    not throttle it (docs/issue-12.md, session 20)."""
    now, used = _uptime_s(), cpu_usage_s(cgroup)
    if mark is not None and now - mark[1] >= MIN_DEMAND_S and used >= mark[0]:
        return (used - mark[0]) / (now - mark[1])
    age = now - record.ticks / os.sysconf("SC_CLK_TCK")
    return used / age if age > 0 else 0.0


def throttled_s(path: Path) -> float:
    """Seconds the cgroup spent throttled by its quota."""
    for line in (path / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "throttled_time":
            return int(value) / 1e9
    return 0.0


def cfs_periods(path: Path) -> tuple[int, int]:
    """The cgroup's CFS counters: periods in which it ran, and those in which it ran out of quota."""
    counts = dict(line.split(" ", 1) for line in (path / "cpu.stat").read_text().splitlines() if " " in line)
    return int(counts.get("nr_periods", 0)), int(counts.get("nr_throttled", 0))


def cgroup_tree(path: Path) -> list[Path]:
    """The cgroup and its descendants, deepest first."""
    if not path.is_dir():
        return []
    return sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [path]


def kill_cgroup_tree(path: Path, timeout_s: float = 5.0) -> int:
    """SIGCONT then SIGKILL every task left in the cgroup tree (every process the testbed
    started lives in it, so this finds what a killed run left even without its state file);
    returns how many processes were killed."""
    killed = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = {int(pid) for group in cgroup_tree(path) for pid in (group / "cgroup.procs").read_text().split()}
        if not pids:
            break
        for pid in pids:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        killed |= pids
        reap()
        time.sleep(0.05)
    return len(killed)


def remove_cgroup_tree(path: Path) -> None:
    """Kill what runs in a cgroup tree and remove it (deepest first)."""
    kill_cgroup_tree(path)
    for group in cgroup_tree(path):
        try:
            group.rmdir()
        except OSError as error:
            raise TestbedError(f"cannot remove cgroup {group}: {error}") from None


def remove_abandoned_cgroup_trees(prefix: str, keep: Path, min_age_s: float) -> list[str]:
    """Remove the cgroup trees named `prefix*` that a run killed with its whole process group
    left (a test's testbed on a port base of its own, never started again to repair it): no
    task anywhere in the tree and the tree untouched for `min_age_s`. A live testbed always
    has processes in its tree, and one being started has a fresh one; the kernel refuses to
    remove a cgroup with a task in it, so a process that moved in meanwhile keeps its tree."""
    removed = []
    for root in sorted(CPU_CGROUP_ROOT.glob(f"{prefix}*")) if CPU_CGROUP_ROOT.is_dir() else []:
        tree = cgroup_tree(root)
        if root == keep or time.time() - max(group.stat().st_mtime for group in tree) < min_age_s:
            continue
        if any((group / "cgroup.procs").read_text().strip() for group in tree):
            continue
        try:
            for group in tree:
                group.rmdir()
        except OSError:
            continue
        removed.append(f"removed the abandoned cgroup tree {root}")
    return removed


# --- network namespaces and tc tbf ------------------------------------------------------


def run(command: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise TestbedError(f"{command[0]} is not installed (bash scripts/apt-install.sh iproute2)") from None
    if check and result.returncode != 0:
        raise TestbedError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def make_shaped_netns(name: str, host_ip: str, ns_ip: str, rate_kbit: int) -> None:
    """A namespace `name` joined to the host by a veth pair (host_ip <-> ns_ip, a /30), with
    `tc tbf` at `rate_kbit` on both ends: traffic either way between them is shaped."""
    host_if, ns_if = _veth(name, "h"), _veth(name, "n")
    run(["ip", "netns", "add", name])
    run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if])
    run(["ip", "link", "set", ns_if, "netns", name])
    run(["ip", "addr", "add", f"{host_ip}/30", "dev", host_if])
    run(["ip", "link", "set", host_if, "up"])
    run(["ip", "netns", "exec", name, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if])
    run(["ip", "netns", "exec", name, "ip", "link", "set", ns_if, "up"])
    run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
    # burst: at least one MTU-sized packet per timer tick; latency bounds the queue
    tbf = ["tbf", "rate", f"{rate_kbit}kbit", "burst", "16kb", "latency", "200ms"]
    run(["tc", "qdisc", "add", "dev", host_if, "root", *tbf])
    run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", ns_if, "root", *tbf])


def _veth(netns: str, end: str) -> str:
    """Interface names (at most 15 characters): `bt<base><n>h` on the host, `...n` inside."""
    return "bt" + netns.removeprefix("bmegtb").replace("-", "")[:12] + end


def remove_netns(name: str) -> None:
    """Delete the namespace (its veth end goes with it, and with it the host end)."""
    host_if = _veth(name, "h")
    if Path("/sys/class/net", host_if).exists():
        run(["ip", "link", "del", host_if], check=False)
    if netns_exists(name):
        run(["ip", "netns", "del", name], check=False)


def list_netns(prefix: str) -> list[str]:
    directory = Path("/run/netns")
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefix)) if directory.is_dir() else []
