"""The deployment manifests agree with the code: probe paths are routes, settings are
settings, container arguments are CLI options, and every container has probes and requests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from bmeg.cli.serving import consume, serve
from bmeg.serving.app import create_app
from bmeg.serving.consumer import ConsumerConfig
from bmeg.serving.settings import ServingSettings
from serving_fixtures import StandInDetector, keyed_settings

KUBERNETES = Path(__file__).resolve().parents[1] / "serving" / "kubernetes"
#: The consumer's memory at its limits, as `python bench/consumer_limits.py --record` wrote it.
CONSUMER_MEMORY = Path(__file__).resolve().parents[1] / "bench" / "measured" / "consumer-memory.json"
#: The consumer's memory limit stays this far above its measured peak (README, Security).
MEMORY_MARGIN = 1.25


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    documents = [doc for path in sorted(KUBERNETES.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents}


def containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def test_the_expected_objects_are_there(objects):
    assert set(objects) == {("ConfigMap", "bmeg-serving"), ("ConfigMap", "bmeg-consumer"),
                            ("PersistentVolumeClaim", "bmeg-models"), ("Deployment", "bmeg-server"),
                            ("Service", "bmeg-server"), ("Deployment", "bmeg-consumer"),
                            ("Service", "bmeg-consumer-metrics"), ("ScaledObject", "bmeg-consumer")}


def test_every_container_has_probes_and_resource_requests(objects):
    for name in ("bmeg-server", "bmeg-consumer"):
        for container in containers(objects["Deployment", name]):
            assert {"startupProbe", "livenessProbe"} <= set(container), name
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name


def test_server_probes_are_routes_of_the_app(objects):
    routes = {getattr(route, "path", None) for route in create_app(StandInDetector(), keyed_settings()).routes}
    (server,) = containers(objects["Deployment", "bmeg-server"])
    probed = {server[probe]["httpGet"]["path"] for probe in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probed == {"/healthz", "/readyz"} and probed <= routes


def test_server_settings_are_settings_fields(objects):
    fields = {f"BMEG_{name.upper()}" for name in ServingSettings.model_fields}
    assert set(objects["ConfigMap", "bmeg-serving"]["data"]) <= fields
    (server,) = containers(objects["Deployment", "bmeg-server"])
    assert {env["name"] for env in server["env"]} <= fields


def test_container_arguments_are_options_of_the_commands(objects):
    for name, command in (("bmeg-server", serve), ("bmeg-consumer", consume)):
        (container,) = containers(objects["Deployment", name])
        options = {option for parameter in command.params for option in parameter.opts}
        assert container["args"][0] == command.name
        given = {re.split("=", arg)[0] for arg in container["args"][1:] if arg.startswith("--")}
        assert given <= options, name


def test_consumer_arguments_refer_to_its_config_map(objects):
    (container,) = containers(objects["Deployment", "bmeg-consumer"])
    referenced = {match for arg in container["args"] for match in re.findall(r"\$\((\w+)\)", arg)}
    assert referenced and referenced <= set(objects["ConfigMap", "bmeg-consumer"]["data"])


def test_services_target_named_container_ports(objects):
    for name, deployment in (("bmeg-server", "bmeg-server"), ("bmeg-consumer-metrics", "bmeg-consumer")):
        ports = {port["name"] for c in containers(objects["Deployment", deployment]) for port in c["ports"]}
        assert {port["targetPort"] for port in objects["Service", name]["spec"]["ports"]} <= ports


def test_consumer_scales_on_its_groups_lag_within_the_partitions(objects):
    scaled, deployment = objects["ScaledObject", "bmeg-consumer"], objects["Deployment", "bmeg-consumer"]
    config = objects["ConfigMap", "bmeg-consumer"]["data"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"]  # KEDA's HPA owns it
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["consumerGroup"] == config["CONSUMER_GROUP"]
    assert trigger["metadata"]["topic"] == config["SPANS_TOPIC"]
    assert trigger["metadata"]["bootstrapServers"] == config["KAFKA_BOOTSTRAP"]
    partitions = int(scaled["metadata"]["annotations"]["bmeg.io/topic-partitions"])
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"] <= partitions
    assert trigger["metadata"]["allowIdleConsumers"] == "false"


def mebibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(Mi|Gi)", quantity).groups()  # the manifests' units
    return float(number) * (1024 if unit == "Gi" else 1)


def test_the_consumers_memory_covers_its_measured_peak_at_the_limits_it_runs_with(objects):
    measured = json.loads(CONSUMER_MEMORY.read_text())
    (consumer,) = containers(objects["Deployment", "bmeg-consumer"])
    memory = {kind: mebibytes(consumer["resources"][kind]["memory"]) for kind in ("requests", "limits")}
    assert memory["limits"] >= MEMORY_MARGIN * measured["peak_mib"]
    assert memory["requests"] >= measured["idle_mib"]
    # measured at the defaults, and the pod runs with them: no option raises a limit
    defaults = ConsumerConfig(bootstrap="-")
    assert measured["limits"] == {name: getattr(defaults, name) for name in measured["limits"]}
    assert not [arg for arg in consumer["args"] if arg.startswith(("--max-", "--batch-"))]


def test_the_servers_configured_limits_are_not_above_those_it_was_measured_at(objects):
    """The server's memory figures (README, Security) are at the settings' defaults."""
    defaults = ServingSettings(no_auth=True)
    for key, value in objects["ConfigMap", "bmeg-serving"]["data"].items():
        name = key.removeprefix("BMEG_").lower()
        if name.startswith("max_") or name.startswith("recent_"):
            assert float(value) <= getattr(defaults, name), key
