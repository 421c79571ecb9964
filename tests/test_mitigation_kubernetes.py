"""The executor and the fault-injection campaign against a real API server with RBAC:
actions and rollbacks change the socialnet Deployments as intended, the controller's identity
can do only what mitigation/rbac.yaml allows, dry run changes nothing, campaigns clean up."""

from __future__ import annotations

import json

import pytest
from conftest_infra import apply_objects
from kubernetes import client

from bmeg.diagnosis import Diagnosis, ServiceScore, TraceDiagnosis
from bmeg.faultinject import Fault, load_topology
from bmeg.faultinject.kubernetes import KubernetesCampaign, app_deployments
from bmeg.mitigation import ActionForbidden, AuditLog, Controller, SafetyPolicy, ServiceTelemetry, load_catalogue
from bmeg.mitigation.kubernetes import ANNOTATION, KubernetesExecutor, cpu_cores

pytestmark = pytest.mark.integration

CATALOGUE = load_catalogue()


@pytest.fixture
def socialnet(kube_admin, kube_app_namespace: str) -> str:
    """Every socialnet service as a Deployment, (re)created as the topology says."""
    apps = client.AppsV1Api(kube_admin)
    deployments = app_deployments(load_topology("socialnet"))
    for body in deployments:
        try:
            apps.delete_namespaced_deployment(body["metadata"]["name"], kube_app_namespace)
        except client.ApiException as error:
            assert error.status == 404
    # no controller-manager runs here to create the namespace's default ServiceAccount, which
    # pod admission looks up (the campaign creates pods)
    default_account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": kube_app_namespace}}
    apply_objects(kube_admin, [default_account, *({**d, "metadata": {**d["metadata"], "namespace": kube_app_namespace}} for d in deployments)])
    return kube_app_namespace


def _stored(kube_admin, namespace: str, name: str):
    return client.AppsV1Api(kube_admin).read_namespaced_deployment(name, namespace)


def test_every_socialnet_service_is_a_deployment(kube_admin, socialnet: str) -> None:
    names = {d.metadata.name for d in client.AppsV1Api(kube_admin).list_namespaced_deployment(socialnet).items}
    assert set(load_topology("socialnet").services) <= names


def test_scale_out_and_rollback(kube_admin, kube_controller, socialnet: str) -> None:
    executor = KubernetesExecutor(kube_controller, socialnet, CATALOGUE)
    applied = executor.scale("post-storage-service", 5)
    stored = _stored(kube_admin, socialnet, "post-storage-service")
    assert stored.spec.replicas == 5
    record = json.loads(stored.metadata.annotations[ANNOTATION])
    assert record["previous"] == {"replicas": 2} and record["new"] == {"replicas": 5}
    executor.rollback(applied)
    assert _stored(kube_admin, socialnet, "post-storage-service").spec.replicas == 2


def test_scale_up_and_rollback(kube_admin, kube_controller, socialnet: str) -> None:
    executor = KubernetesExecutor(kube_controller, socialnet, CATALOGUE)
    applied = executor.set_resources("social-graph-redis", cpu_cores=2.5)
    limits = _stored(kube_admin, socialnet, "social-graph-redis").spec.template.spec.containers[0].resources.limits
    assert limits["cpu"] == "2500m" and limits["memory"] == "1Gi"
    executor.rollback(applied)
    assert executor.state("social-graph-redis").cpu_cores == pytest.approx(load_topology("socialnet").services["social-graph-redis"].cores)


def test_retune_env_parameter_and_rollback(kube_admin, kube_controller, socialnet: str) -> None:
    executor = KubernetesExecutor(kube_controller, socialnet, CATALOGUE)
    pool = CATALOGUE.parameter("social-graph-service", "io_threadpool_size")
    applied = executor.set_parameter("social-graph-service", pool, 24)
    env = _stored(kube_admin, socialnet, "social-graph-service").spec.template.spec.containers[0].env
    assert [(e.name, e.value) for e in env] == [("THRIFT_IO_THREADPOOL_SIZE", "24")]
    assert executor.state("social-graph-service").parameters == {"io_threadpool_size": 24.0}
    executor.rollback(applied)  # it was unset: rollback removes it
    assert not _stored(kube_admin, socialnet, "social-graph-service").spec.template.spec.containers[0].env


def test_retune_configmap_parameter_rolls_the_deployment(kube_admin, kube_controller, socialnet: str) -> None:
    client.CoreV1Api(kube_admin).create_namespaced_config_map(socialnet, {
        "metadata": {"name": "redis-conf"}, "data": {"hz": "10"}}) if not _configmap_exists(kube_admin, socialnet) else None
    client.CoreV1Api(kube_admin).patch_namespaced_config_map("redis-conf", socialnet, {"data": {"hz": "10"}})
    executor = KubernetesExecutor(kube_controller, socialnet, CATALOGUE)
    applied = executor.set_parameter("user-timeline-redis", CATALOGUE.parameter("user-timeline-redis", "hz"), 50)
    assert client.CoreV1Api(kube_admin).read_namespaced_config_map("redis-conf", socialnet).data["hz"] == "50"
    template = _stored(kube_admin, socialnet, "user-timeline-redis").spec.template.metadata.annotations
    assert template["bmeg.io/config-redis-conf-hz"] == "50"
    executor.rollback(applied)
    assert client.CoreV1Api(kube_admin).read_namespaced_config_map("redis-conf", socialnet).data["hz"] == "10"


def _configmap_exists(api, namespace: str) -> bool:
    return any(c.metadata.name == "redis-conf" for c in client.CoreV1Api(api).list_namespaced_config_map(namespace).items)


def test_migrate_adds_anti_affinity_and_rollback_removes_it(kube_admin, kube_controller, socialnet: str) -> None:
    executor = KubernetesExecutor(kube_controller, socialnet, CATALOGUE)
    applied = executor.migrate("user-service")
    affinity = _stored(kube_admin, socialnet, "user-service").spec.template.spec.affinity
    term = affinity.pod_anti_affinity.required_during_scheduling_ignored_during_execution[0]
    assert term.label_selector.match_labels == {"bmeg.io/role": "interference"}
    assert executor.state("user-service").migrated
    executor.rollback(applied)
    assert _stored(kube_admin, socialnet, "user-service").spec.template.spec.affinity is None
    assert not executor.state("user-service").migrated


def test_forbidden_action_fails_cleanly_and_is_logged(kube_controller, socialnet: str) -> None:
    # the Role grants nothing in the namespace `default`
    executor = KubernetesExecutor(kube_controller, "default", CATALOGUE)
    with pytest.raises(ActionForbidden, match="forbidden"):
        executor.scale("post-storage-service", 3)
    audit = AuditLog()
    controller = Controller(executor, CATALOGUE, SafetyPolicy(dry_run=False, confidence_threshold=0.1), audit)
    outcomes = controller.handle(_diagnosis("post-storage-service"), now=0.0,
                                 telemetry={"post-storage-service": ServiceTelemetry(cpu_utilization=0.95, replicas=2)})
    assert [o.status for o in outcomes] == ["failed"]
    errors = audit.records(kind="error")
    assert len(errors) == 1 and errors[0].outcome.startswith("forbidden")


def test_dry_run_changes_nothing(kube_admin, kube_controller, socialnet: str) -> None:
    before = _stored(kube_admin, socialnet, "post-storage-service")
    controller = Controller(KubernetesExecutor(kube_controller, socialnet, CATALOGUE), CATALOGUE,
                            SafetyPolicy(dry_run=True, confidence_threshold=0.1), AuditLog())
    outcomes = controller.handle(_diagnosis("post-storage-service"), now=0.0,
                                 telemetry={"post-storage-service": ServiceTelemetry(cpu_utilization=0.95, replicas=2)})
    assert [o.status for o in outcomes] == ["dry-run"]
    after = _stored(kube_admin, socialnet, "post-storage-service")
    assert after.metadata.resource_version == before.metadata.resource_version


def test_campaign_cleans_up(kube_admin, socialnet: str) -> None:
    pods_before = _interference_pods(kube_admin, socialnet)
    campaign = KubernetesCampaign(kube_admin, socialnet, CATALOGUE, sleep=lambda s: None)
    faults = [
        Fault("user-service", "interference", "single", 0, 1, {"factor": 3}),
        Fault("post-storage-service", "saturation", "single", 0, 1, {"capacity": 0.25}),
        Fault("social-graph-service", "misconfiguration", "single", 0, 1, {"pool_size": 1}),
    ]
    seen = {}
    original_undo = campaign.undo

    def undo(injected):  # look at the cluster while the faults are in place
        seen[injected.fault.service] = _stored(kube_admin, socialnet, injected.fault.service)
        seen.setdefault("pods", _interference_pods(kube_admin, socialnet))
        original_undo(injected)

    campaign.undo = undo
    campaign.run(faults)
    assert len(seen["pods"]) == len(pods_before) + 1
    assert seen["post-storage-service"].spec.template.spec.containers[0].resources.limits["cpu"] == "250m"
    assert seen["social-graph-service"].spec.template.spec.containers[0].env[0].value == "1"
    assert _interference_pods(kube_admin, socialnet) == pods_before
    assert cpu_cores(_stored(kube_admin, socialnet, "post-storage-service").spec.template.spec.containers[0].resources.limits["cpu"]) == 1.0
    assert not _stored(kube_admin, socialnet, "social-graph-service").spec.template.spec.containers[0].env


def test_interrupted_campaign_cleans_up(kube_admin, socialnet: str) -> None:
    pods_before = _interference_pods(kube_admin, socialnet)
    calls = []

    def sleep(seconds: float) -> None:  # the operator presses Ctrl-C while the fault is in place
        calls.append(seconds)
        if len(calls) == 2:
            raise KeyboardInterrupt

    campaign = KubernetesCampaign(kube_admin, socialnet, CATALOGUE, sleep=sleep)
    with pytest.raises(KeyboardInterrupt):
        campaign.run([Fault("user-service", "interference", "single", 0, 60, {"factor": 2}),
                      Fault("post-storage-service", "saturation", "single", 0, 60, {"replicas": 1})])
    assert _interference_pods(kube_admin, socialnet) == pods_before
    assert _stored(kube_admin, socialnet, "post-storage-service").spec.replicas == 2


def _interference_pods(api, namespace: str) -> list[str]:
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector="bmeg.io/role=interference").items
    return sorted(p.metadata.name for p in pods if p.metadata.deletion_timestamp is None)


def _diagnosis(service: str) -> Diagnosis:
    trace = TraceDiagnosis(trace_id="t1", spans=10, total_us=50_000, anomalous=True, anomaly_score=0.95,
                           threshold=0.5, model="gnn", bottlenecks=[ServiceScore(service=service, score=0.9, bottleneck=True)])
    return Diagnosis(model_version="test", application="socialnet", traces=[trace])
