"""The testbed's state file: what runs and what a fault changed, so another process can undo it.

`<run dir>/state.json` is rewritten atomically (write a temporary file, rename) *before* a
change is made where the change could be left behind (a fault's undo record is written
before the fault is applied), and after a process starts. Whatever kills the process that
made a change (SIGTERM, SIGKILL, a crash), the next `up`, `down` or campaign reads the file
and undoes it (`bmeg.faultinject.testbed.supervisor.repair`).

Names that need no state file to be found: every process the testbed starts lives in the
cgroup tree `/sys/fs/cgroup/cpu/bmeg-testbed-<port base>/`, and every network namespace is
called `bmegtb<port base>-<n>`, so even a state file lost mid-write leaves nothing behind.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from bmeg.faultinject.testbed import system
from bmeg.faultinject.testbed.deployment import CFS_PERIOD_US, DEFAULT_MIX, Ports, port_base, service_config
from bmeg.faultinject.testbed.system import ProcessRecord

STATE_FILE = "state.json"


def run_dir(base: int | None = None) -> Path:
    """`BMEG_TESTBED_RUN_DIR`, or `${TMPDIR:-/tmp}/bmeg-testbed-<user>-<port base>`."""
    if "BMEG_TESTBED_RUN_DIR" in os.environ:
        return Path(os.environ["BMEG_TESTBED_RUN_DIR"])
    import pwd

    user = os.environ.get("USER") or pwd.getpwuid(os.getuid()).pw_name
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"bmeg-testbed-{user}-{base or port_base()}"


GROUP_PREFIX = "bmeg-testbed-"


def cgroup_group(base: int) -> str:
    return f"{GROUP_PREFIX}{base}"


def netns_prefix(base: int) -> str:
    return f"bmegtb{base}-"


@dataclass
class TestbedState:
    """What `up` started and what faults are applied now (undo records)."""

    __test__ = False  # not a pytest class

    base: int
    run_dir: str
    rate: float = 0.0
    mix: str = DEFAULT_MIX
    seed: int = 0
    binary: str = ""
    otlp_endpoint: str = ""
    spans_file: str = ""
    started_at: float = 0.0
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    #: fault id -> its undo record (see `bmeg.faultinject.testbed.faults`)
    faults: dict[str, dict] = field(default_factory=dict)
    #: service -> configuration overrides in force (misconfiguration faults, retunes)
    overrides: dict[str, dict] = field(default_factory=dict)
    #: service -> where its CPU demand is counted from (`system.demand_mark`, taken when `up`
    #: has started everything: a saturation quota is sized from the use after start-up)
    demand_marks: dict[str, list[float]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / STATE_FILE

    def save(self) -> None:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {**{k: v for k, v in self.__dict__.items() if k != "processes"},
                    "processes": {name: record.to_json() for name, record in self.processes.items()}}
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(document, indent=1))
        os.replace(temporary, path)

    @classmethod
    def load(cls, directory: Path) -> TestbedState | None:
        path = directory / STATE_FILE
        if not path.exists():
            return None
        try:
            document = json.loads(path.read_text())
            processes = {name: ProcessRecord(**record) for name, record in document.pop("processes", {}).items()}
            return cls(**document, processes=processes)
        except (json.JSONDecodeError, TypeError) as error:
            raise ValueError(f"{path} is not a testbed state file ({error}); remove it after "
                             f"`bmeg testbed down` repaired what it could") from None


@dataclass(frozen=True)
class Testbed:
    """Where one testbed lives: its port base and run directory."""

    __test__ = False  # not a pytest class

    base: int
    run: Path

    @classmethod
    def default(cls) -> Testbed:
        base = port_base()
        return cls(base, run_dir(base))

    @property
    def ports(self) -> Ports:
        return Ports(self.base)

    @property
    def group(self) -> Path:
        return system.cgroup_path(cgroup_group(self.base))

    def cgroup(self, name: str) -> Path:
        return self.group / name

    def state(self) -> TestbedState | None:
        return TestbedState.load(self.run)

    def config_path(self, service: str, instance: int = 0) -> Path:
        return self.run / "configs" / (f"{service}.json" if instance == 0 else f"{service}-{instance}.json")


def record_process(state: TestbedState, record: ProcessRecord) -> ProcessRecord:
    """Note a process the testbed started in the state file (at once: a crash must not lose it)."""
    state.processes[record.name] = record
    state.save()
    return record


def service_cgroup(testbed: Testbed, name: str, quota_cores: float | None = None) -> Path:
    """The cgroup `name` in the testbed's tree, made if missing, with that CPU quota (None: no limit)."""
    path = testbed.cgroup(name)
    system.make_cgroup(path, quota_cores, CFS_PERIOD_US)
    return path


def instance_name(service: str, instance: int = 0) -> str:
    """A service instance's process name: the service's own for the first, `<service>-<n>` for replicas."""
    return service if instance == 0 else f"{service}-{instance}"


def write_config(testbed: Testbed, state: TestbedState, service: str, instance: int = 0) -> Path:
    """Write the configuration instance `instance` of `service` runs with: its normal one with the
    overrides in force (faults, retunes) on top, as a Deployment's pods share one pod template."""
    config = service_config(service, testbed.ports, state.otlp_endpoint, instance).to_json()
    config.update(state.overrides.get(service, {}))
    if instance:
        config["instance"] = instance_name(service, instance)
    path = testbed.config_path(service, instance)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))
    return path
