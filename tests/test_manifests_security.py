"""Every pod bmeg ships runs under the restricted Pod Security profile; the controller's Role is
what `bmeg mitigate rbac` generates from the topology, and grants nothing beyond its calls."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from builders import assert_restricted

from bmeg.cli.mitigate import mitigate
from bmeg.faultinject import load_topology
from bmeg.mitigation import load_catalogue
from bmeg.mitigation.rbac import CONTROLLER, CONTROLLER_NAMESPACE, controller_rbac, render

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted([*ROOT.glob("serving/kubernetes/*.yaml"), *ROOT.glob("mitigation/*.yaml")])


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict) and "kind" in doc]


def pod_templates() -> dict[str, dict]:
    templates = {}
    for doc in documents():
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            templates[doc["metadata"]["name"]] = doc["spec"]["template"]
        elif doc["kind"] == "Pod":
            templates[doc["metadata"]["name"]] = doc
    return templates


def test_the_manifests_hold_the_three_pods():
    assert set(pod_templates()) == {"bmeg-server", "bmeg-consumer", "bmeg-mitigation"}


@pytest.mark.parametrize("name", sorted(pod_templates()))
def test_every_pod_meets_the_restricted_profile(name):
    assert_restricted(pod_templates()[name]["spec"])


def test_the_server_needs_its_api_key_secret():
    (server,) = pod_templates()["bmeg-server"]["spec"]["containers"]
    (key,) = [env for env in server["env"] if env["name"] == "BMEG_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "bmeg-api-key", "key": "api-key"}  # not optional


def test_the_committed_rbac_is_what_the_command_generates():
    result = CliRunner().invoke(mitigate, ["rbac", "--topology", "socialnet", "--namespace", "socialnet"])
    assert result.exit_code == 0, result.output
    assert (ROOT / "mitigation" / "rbac.yaml").read_text() == result.output


def test_the_role_names_only_the_topologys_objects_and_the_verbs_used():
    topology = load_topology("socialnet")
    objects = controller_rbac(topology.services, "socialnet", load_catalogue())
    (role,) = [o for o in objects if o["kind"] == "Role" and o["metadata"]["namespace"] == "socialnet"]
    granted = {(rule["apiGroups"][0], rule["resources"][0], verb): rule.get("resourceNames")
               for rule in role["rules"] for verb in rule["verbs"]}
    assert set(granted) == {  # what KubernetesExecutor calls, and nothing else
        ("apps", "deployments", "get"), ("apps", "deployments", "patch"), ("apps", "deployments/scale", "patch"),
        ("", "configmaps", "get"), ("", "configmaps", "patch"),
        ("autoscaling", "horizontalpodautoscalers", "list"), ("autoscaling", "horizontalpodautoscalers", "patch"),
        ("keda.sh", "scaledobjects", "list"), ("keda.sh", "scaledobjects", "patch")}
    for (group, resource, verb), names in granted.items():
        if verb != "list":  # RBAC cannot limit a list by name
            assert names, (resource, verb)
            assert resource == "configmaps" or set(names) == set(topology.services)
    (leases,) = [o for o in objects if o["kind"] == "Role" and o["metadata"]["namespace"] == CONTROLLER_NAMESPACE]
    assert {(verb, tuple(rule.get("resourceNames", ()))) for rule in leases["rules"] for verb in rule["verbs"]} == {
        ("get", (CONTROLLER,)), ("update", (CONTROLLER,)), ("create", ())}
    assert render(objects, "socialnet", "socialnet").count("secrets") == 0


def test_the_controller_deployment_runs_in_cluster_as_the_generated_account():
    (controller,) = [d for d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "bmeg-mitigation"]
    spec = controller["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == CONTROLLER and controller["metadata"]["namespace"] == CONTROLLER_NAMESPACE
    (container,) = spec["containers"]
    assert container["args"][0] == "mitigate" and "--in-cluster" in container["args"]
    options = {option for parameter in mitigate.params for option in parameter.opts}
    assert {arg.split("=")[0] for arg in container["args"][1:]} <= options
    assert "--apply" not in container["args"]  # dry run until an operator says otherwise


RESTRICTED_NAMESPACE = "bmeg-restricted-check"


@pytest.mark.integration
def test_the_api_servers_pod_security_admission_accepts_every_pod(kube_admin):
    """Each pod template, created (dry run) in a namespace that enforces the restricted profile:
    the API server's own PodSecurity admission judges it. A pod without seccomp is the control."""
    from kubernetes import client
    from conftest_infra import apply_objects

    apply_objects(kube_admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": RESTRICTED_NAMESPACE, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
        # no controller-manager here creates the namespace's default ServiceAccount, which admission looks up
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": RESTRICTED_NAMESPACE}}])
    core = client.CoreV1Api(kube_admin)
    for name, template in pod_templates().items():
        spec = {**template["spec"], "serviceAccountName": "default", "automountServiceAccountToken": False}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": template["metadata"]["labels"]}, "spec": spec}
        core.create_namespaced_pod(RESTRICTED_NAMESPACE, pod, dry_run="All")
    loose = {**spec, "securityContext": {"runAsNonRoot": True}}
    with pytest.raises(client.ApiException) as refused:
        core.create_namespaced_pod(RESTRICTED_NAMESPACE, {**pod, "spec": loose}, dry_run="All")
    assert refused.value.status == 403 and "seccompProfile" in refused.value.body
