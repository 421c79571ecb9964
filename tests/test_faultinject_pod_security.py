"""The pods the Kubernetes fault-injection campaign creates meet the restricted Pod Security
profile, and the one fault that needs privilege (network: `tc` needs NET_ADMIN as root) is an
explicit opt-in twice over: the campaign's `allow_privileged`, and a namespace labelled
`pod-security.kubernetes.io/enforce=privileged`, whose PodSecurity admission (the real API
server's) refuses it everywhere else."""

from __future__ import annotations

import pytest
from builders import assert_restricted
from conftest_infra import apply_objects
from kubernetes import client

from bmeg.faultinject import Fault, load_topology
from bmeg.faultinject.kubernetes import KubernetesCampaign, app_deployments, interference_pod, netem_arguments
from bmeg.mitigation import load_catalogue

CATALOGUE = load_catalogue()
TARGET = "user-service"
# Namespaces of these tests' own (others' tests share the API server).
RESTRICTED = "bmeg-faultinject-restricted"
PRIVILEGED = "bmeg-faultinject-privileged"


def test_the_interference_pod_meets_the_restricted_profile():
    pod = interference_pod("stress-1", TARGET, {"app": TARGET}, "stress-ng", ["--cpu", "3"], 10, cpu_cores=3)
    assert_restricted(pod["spec"])
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["cpu"] == "3"  # the stress asked for, and no more
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_the_netem_arguments_carry_the_faults_parameters():
    fault = Fault(TARGET, "network", "single", 0, 10, {"delay_ms": 50, "jitter_ms": 5, "bandwidth_kbit": 1024})
    assert netem_arguments(fault) == "netem delay 50ms 5ms rate 1024kbit"


def test_a_network_fault_is_refused_without_the_opt_in():
    campaign = KubernetesCampaign(client.ApiClient(), "nowhere", CATALOGUE, sleep=lambda s: None)
    with pytest.raises(ValueError, match="NET_ADMIN.*allow_privileged=True.*enforce=privileged"):
        campaign.run([Fault(TARGET, "network", "single", 0, 1, {"delay_ms": 50})])  # before any API call


def test_an_inbound_network_delay_is_refused_before_any_change():
    campaign = KubernetesCampaign(client.ApiClient(), "nowhere", CATALOGUE, allow_privileged=True, sleep=lambda s: None)
    with pytest.raises(ValueError, match="inbound network delay needs a proxy"):
        campaign.run([Fault(TARGET, "network", "single", 0, 1, {"delay_ms": 50, "inbound": 1})])


def _namespace(api, name: str, level: str) -> str:
    """`name` enforcing Pod Security `level`, with the target's Deployment and one of its pods (no
    controller-manager runs here to make pods from Deployments)."""
    (deployment,) = [d for d in app_deployments(load_topology("socialnet")) if d["metadata"]["name"] == TARGET]
    apply_objects(api, [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": level}}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": name}},
        {**deployment, "metadata": {**deployment["metadata"], "namespace": name}}])
    core = client.CoreV1Api(api)
    for pod in core.list_namespaced_pod(name).items:
        core.delete_namespaced_pod(pod.metadata.name, name, grace_period_seconds=0)
    template = interference_pod("x", TARGET, {}, "registry.invalid/bmeg/app:1", [], 60, cpu_cores=1)["spec"]
    core.create_namespaced_pod(name, {"apiVersion": "v1", "kind": "Pod",
                                      "metadata": {"name": f"{TARGET}-0", "labels": {"app": TARGET}},
                                      "spec": {**template, "affinity": None, "restartPolicy": "Always",
                                               "containers": [{**template["containers"][0], "name": TARGET}]}})
    return name


@pytest.mark.integration
def test_the_campaigns_pods_are_admitted_where_the_restricted_profile_is_enforced(kube_admin):
    namespace = _namespace(kube_admin, RESTRICTED, "restricted")
    core = client.CoreV1Api(kube_admin)
    campaign = KubernetesCampaign(kube_admin, namespace, CATALOGUE, sleep=lambda s: None)
    seen = []
    undo = campaign.undo
    campaign.undo = lambda injected: (seen.extend(core.read_namespaced_pod(p, namespace) for p in injected.pods),
                                      undo(injected))
    campaign.run([Fault(TARGET, "interference", "single", 0, 1, {"factor": 2})])  # really created, not a dry run
    (pod,) = seen
    assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    assert pod.spec.containers[0].security_context.capabilities.drop == ["ALL"]
    assert [p.metadata.name for p in core.list_namespaced_pod(namespace).items] == [f"{TARGET}-0"]  # cleaned up

    # the control: the pod as the campaign made it before, with no security context, is refused here
    loose = interference_pod("loose", TARGET, {"app": TARGET}, "stress-ng", ["--cpu", "1"], 1, cpu_cores=1)
    loose["spec"].pop("securityContext")
    loose["spec"]["containers"][0].pop("securityContext")
    with pytest.raises(client.ApiException) as refused:
        core.create_namespaced_pod(namespace, loose, dry_run="All")
    assert refused.value.status == 403 and "restricted" in refused.value.body


@pytest.mark.integration
def test_a_network_fault_is_refused_by_a_restricted_namespace_and_runs_in_a_privileged_one(kube_admin):
    fault = Fault(TARGET, "network", "single", 0, 1, {"delay_ms": 50, "jitter_ms": 5})
    core = client.CoreV1Api(kube_admin)

    restricted = _namespace(kube_admin, RESTRICTED, "restricted")
    with pytest.raises(client.ApiException) as refused:  # opted in, but the namespace has not
        KubernetesCampaign(kube_admin, restricted, CATALOGUE, allow_privileged=True, sleep=lambda s: None).run([fault])
    assert refused.value.status == 403 and "NET_ADMIN" in refused.value.body
    assert not core.read_namespaced_pod(f"{TARGET}-0", restricted).spec.ephemeral_containers

    privileged = _namespace(kube_admin, PRIVILEGED, "privileged")
    (done,) = KubernetesCampaign(kube_admin, privileged, CATALOGUE, allow_privileged=True,
                                 sleep=lambda s: None).run([fault])
    assert done.log == [f"tc netem in pods {TARGET}-0"]
    netem, undo = core.read_namespaced_pod(f"{TARGET}-0", privileged).spec.ephemeral_containers
    assert netem.name.startswith("bmeg-netem-") and undo.name.startswith("bmeg-netem-undo-")
    assert "tc qdisc replace dev eth0 root netem delay 50ms 5ms" in netem.command[-1]
    assert "tc qdisc del dev eth0 root" in undo.command[-1]
    assert netem.security_context.capabilities.add == ["NET_ADMIN"]
    assert netem.security_context.capabilities.drop == ["ALL"]
