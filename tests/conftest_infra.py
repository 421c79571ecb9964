"""Fixtures for the real parts the integration tests talk to: a Kafka broker, a Kubernetes
API server with RBAC, the OpenTelemetry Collector (`otelcol_binary`, `Collector`), and a
broker of one test's own that it can kill and start again (`Broker`).

`scripts/test.sh` (that is, `make test`) starts both and exports the variables read here.
Run by hand, start them yourself (`scripts/kafka.sh start`, `scripts/kube-apiserver.sh start`);
a fixture whose part is not running skips its tests, except under CI (`CI=true`), where a
missing part is a failure: CI always starts them, so their absence there is a bug.
"""

from __future__ import annotations

import getpass
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RBAC_MANIFEST = ROOT / "mitigation" / "rbac.yaml"
APP_NAMESPACE = "socialnet"

# The scripts' defaults, for runs outside scripts/test.sh.
DEFAULT_KAFKA_PORT = 19092
DEFAULT_KUBE_RUN_DIR = Path(tempfile.gettempdir()) / f"bmeg-kube-{getpass.getuser()}"


def pytest_configure(config: pytest.Config) -> None:
    # kafka-python loads its protocol schemas through a deprecated importlib API, with two
    # warnings per schema: noise that would bury the project's own warnings.
    for module, function in [("kafka.protocol.schemas.load_json", "read_text"),
                             ("importlib.resources._legacy", "open_text")]:
        config.addinivalue_line(
            "filterwarnings", f"ignore:{function} is deprecated:DeprecationWarning:{module}")


def _missing(what: str, how_to_start: str) -> None:
    """Fail under CI, skip elsewhere: the part is not running."""
    message = f"{what} is not running (start it with `{how_to_start}`)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}; CI must start it before pytest", pytrace=False)
    pytest.skip(message)


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """"127.0.0.1:PORT" of the test broker (env `BMEG_KAFKA_BOOTSTRAP`, else the default port)."""
    bootstrap = os.environ.get("BMEG_KAFKA_BOOTSTRAP")
    if bootstrap is None:
        port = int(os.environ.get("BMEG_KAFKA_PORT", DEFAULT_KAFKA_PORT))
        bootstrap = f"127.0.0.1:{port}"
    host, _, port_text = bootstrap.rpartition(":")
    if not _answers(host, int(port_text)):
        _missing(f"the Kafka broker at {bootstrap}", "scripts/kafka.sh start")
    return bootstrap


@pytest.fixture(scope="session")
def kube_run_dir() -> Path:
    """The API server's run directory, which holds admin.kubeconfig and controller.kubeconfig."""
    run_dir = Path(os.environ.get("BMEG_KUBE_RUN_DIR", DEFAULT_KUBE_RUN_DIR))
    if not (run_dir / "admin.kubeconfig").is_file():
        _missing(f"the Kubernetes API server (no kubeconfig in {run_dir})",
                 "scripts/kube-apiserver.sh start")
    return run_dir


@pytest.fixture(scope="session")
def kube_admin_kubeconfig(kube_run_dir: Path) -> Path:
    """Kubeconfig of `bmeg-admin`, in group system:masters: allowed everything."""
    return kube_run_dir / "admin.kubeconfig"


@pytest.fixture(scope="session")
def kube_controller_kubeconfig(kube_run_dir: Path) -> Path:
    """Kubeconfig of the mitigation controller, user
    `system:serviceaccount:bmeg:bmeg-mitigation`: allowed only what mitigation/rbac.yaml grants,
    once that is applied (see `kube_app_namespace`)."""
    return kube_run_dir / "controller.kubeconfig"


def _api_client(kubeconfig: Path):
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        client.VersionApi(api).get_code(_request_timeout=5)
    except Exception as error:  # any failure to answer means: not running
        api.close()
        _missing(f"the Kubernetes API server of {kubeconfig} ({error.__class__.__name__})",
                 "scripts/kube-apiserver.sh start")
    return api


@pytest.fixture(scope="session")
def kube_admin(kube_admin_kubeconfig: Path):
    """A `kubernetes.client.ApiClient` acting as the cluster admin."""
    api = _api_client(kube_admin_kubeconfig)
    yield api
    api.close()


@pytest.fixture(scope="session")
def kube_controller(kube_controller_kubeconfig: Path):
    """A `kubernetes.client.ApiClient` acting as the mitigation controller."""
    api = _api_client(kube_controller_kubeconfig)
    yield api
    api.close()


def load_manifest(path: Path) -> list[dict]:
    """The objects of a multi-document YAML manifest."""
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def apply_objects(api, objects: list[dict]) -> list[dict]:
    """Server-side apply each object, as `kubectl apply --server-side` does; returns the
    objects as the server stored them."""
    from kubernetes import dynamic

    cluster = dynamic.DynamicClient(api)
    applied = []
    for body in objects:
        resource = cluster.resources.get(api_version=body["apiVersion"], kind=body["kind"])
        stored = cluster.server_side_apply(
            resource, body=body, field_manager="bmeg-tests", force_conflicts=True)
        applied.append(stored.to_dict())
    return applied


@pytest.fixture(scope="session")
def kube_app_namespace(kube_admin) -> str:
    """The application's namespace (`socialnet`), created if absent, with mitigation/rbac.yaml
    applied, so `kube_controller` has exactly the controller's rights in it."""
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": APP_NAMESPACE}}
    apply_objects(kube_admin, [namespace, *load_manifest(RBAC_MANIFEST)])
    return APP_NAMESPACE


@pytest.fixture(scope="session")
def otelcol_binary() -> Path:
    """The OpenTelemetry Collector built by `scripts/otelcol.sh` (`BMEG_OTELCOL_BINARY` under make test)."""
    binary = os.environ.get("BMEG_OTELCOL_BINARY")
    if not binary:
        built = subprocess.run(["bash", str(ROOT / "scripts" / "otelcol.sh"), "path"], capture_output=True, text=True)
        if built.returncode != 0:
            pytest.fail(f"building the Collector failed:\n{built.stderr[-3000:]}", pytrace=False)
        binary = built.stdout.strip().splitlines()[-1]
    return Path(binary)


def free_port() -> int:
    """A TCP port free on loopback when asked (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Collector:
    """One Collector: OTLP in on its own ports, the batch processor, the `exporters` given."""

    def __init__(self, binary: Path, work: Path, exporters: dict):
        self.grpc_port, self.http_port = free_port(), free_port()
        config = {
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{self.grpc_port}"},
                                                 "http": {"endpoint": f"127.0.0.1:{self.http_port}"}}}},
            "processors": {"batch": {}},
            "exporters": exporters,
            "service": {"telemetry": {"metrics": {"level": "none"}},
                        "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"],
                                                 "exporters": list(exporters)}}},
        }
        self.config, self.log = work / f"otelcol-{self.http_port}.yaml", work / f"otelcol-{self.http_port}.log"
        self.config.write_text(yaml.safe_dump(config))
        self.process = subprocess.Popen([str(binary), "--config", str(self.config)], stdout=self.log.open("w"),
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{self.http_port}/", timeout=1)
                return
            except httpx.HTTPError:
                assert self.process.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, "the Collector did not start:\n" + self.log.read_text()
                time.sleep(0.3)

    def endpoint(self, protocol: str) -> str:
        return f"127.0.0.1:{self.grpc_port}" if protocol == "grpc" else f"http://127.0.0.1:{self.http_port}/v1/traces"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Broker:
    """A Kafka broker of one test's own (scripts/kafka.sh on free ports and its own run
    directory); `kill` and `restart` stop it and start it again on the same data."""

    def __init__(self, run_dir: Path, attempts: int = 3):
        self.run_dir = run_dir
        for _ in range(attempts):
            self.port = _port_pair_below_ephemeral()
            self.bootstrap = f"127.0.0.1:{self.port}"
            self.env = {**os.environ, "BMEG_KAFKA_PORT": str(self.port), "BMEG_KAFKA_RUN_DIR": str(run_dir),
                        "BMEG_PYTHON": sys.executable}
            started = subprocess.run(["bash", str(ROOT / "scripts" / "kafka.sh"), "start"], env=self.env,
                                     capture_output=True, text=True)
            if started.returncode == 0:
                return
        raise RuntimeError(f"kafka.sh start failed {attempts} times; the last said:\n{started.stderr[-3000:]}")

    @property
    def _pid_file(self) -> Path:
        return self.run_dir / "kafka.pid"

    def kill(self) -> None:
        pid = int(self._pid_file.read_text())
        self.argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        os.kill(pid, signal.SIGKILL)
        while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
            time.sleep(0.1)

    def restart(self) -> None:
        process = subprocess.Popen([arg.decode() for arg in self.argv], stdout=(self.run_dir / "kafka.log").open("a"),
                                   stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self._pid_file.write_text(str(process.pid))
        deadline = time.monotonic() + 90
        while not _kafka_answers(self.bootstrap):
            assert process.poll() is None and time.monotonic() < deadline, (self.run_dir / "kafka.log").read_text()[-3000:]
            time.sleep(1)

    def stop(self) -> None:
        subprocess.run(["bash", str(ROOT / "scripts" / "kafka.sh"), "stop"], env=self.env, capture_output=True)


def _port_pair_below_ephemeral() -> int:
    """A port P with P and P + 1 free, drawn below the kernel's ephemeral range: a port the
    kernel hands out (free_port) can be taken by any outgoing connection's local end before
    the broker binds it, and the broker needs two. The 4000 ports below that range lie above
    the testbed's (BMEG_TESTBED_PORT_BASE: 27100 by default, 23990 in its tests)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(max(1025, low - 4000), low - 1)
        if not _port_taken(port) and not _port_taken(port + 1):
            return port


def _port_taken(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def _kafka_answers(bootstrap: str) -> bool:
    from kafka import KafkaAdminClient  # the kafka extra: imported by the tests that start a broker
    from kafka.errors import KafkaError

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    except KafkaError:
        return False
    try:
        admin.list_topics()
        return True
    except KafkaError:
        return False
    finally:
        admin.close()
