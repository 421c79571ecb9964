"""Fixtures for the real parts the integration tests talk to: a Kafka broker and a Kubernetes
API server with RBAC.

`scripts/test.sh` (that is, `make test`) starts both and exports the variables read here.
Run by hand, start them yourself (`scripts/kafka.sh start`, `scripts/kube-apiserver.sh start`);
a fixture whose part is not running skips its tests, except under CI (`CI=true`), where a
missing part is a failure: CI always starts them, so their absence there is a bug.
"""

from __future__ import annotations

import getpass
import os
import socket
import tempfile
from pathlib import Path

import pytest
import yaml

RBAC_MANIFEST = Path(__file__).resolve().parents[1] / "mitigation" / "rbac.yaml"
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
