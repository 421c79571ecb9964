"""The executor and the fault-injection campaign against a real API server with RBAC:
actions and rollbacks change the socialnet Deployments as intended, the controller's identity
can do only what mitigation/rbac.yaml allows, dry run changes nothing, campaigns clean up."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest_infra import apply_objects, load_manifest
from kubernetes import client

from bmeg.diagnosis import Diagnosis, ServiceScore, TraceDiagnosis
from bmeg.faultinject import Fault, load_topology
from bmeg.faultinject.kubernetes import KubernetesCampaign, app_deployments
from bmeg.mitigation import ActionForbidden, AuditLog, Controller, SafetyPolicy, ServiceTelemetry, load_catalogue
from bmeg.cluster.kubernetes import ANNOTATION, KubernetesExecutor, cpu_cores

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


# -- autoscalers, the Role's names, in-cluster configuration, the topology allowlist -----------
# A namespace of these tests' own (others' tests share the API server and `socialnet`), with the
# Role generated for it, as `bmeg mitigate rbac --namespace` writes it.
OWN_NAMESPACE = "bmeg-hardening-tests"
# A minimal structural CRD of our own for KEDA's ScaledObject (not KEDA's: it cannot be
# downloaded here), shared with tests/test_cluster_manifests.py: both tests apply the same
# object to the shared API server, so neither changes the schema under the other.
KEDA_CRD = load_manifest(Path(__file__).resolve().parent / "manifests" / "keda-scaledobject-crd.yaml")[0]


@pytest.fixture
def own_namespace(kube_admin) -> str:
    from bmeg.mitigation.rbac import controller_rbac

    topology = load_topology("socialnet")
    deployments = [{**d, "metadata": {**d["metadata"], "namespace": OWN_NAMESPACE}} for d in app_deployments(topology)]
    apply_objects(kube_admin, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OWN_NAMESPACE}},
                               *controller_rbac(topology.services, OWN_NAMESPACE, CATALOGUE), *deployments,
                               _deployment("intruder")])
    apps = client.AppsV1Api(kube_admin)
    for name in ("post-storage-service", "user-service", "intruder"):  # replicas as the topology says
        apps.patch_namespaced_deployment_scale(name, OWN_NAMESPACE, {"spec": {"replicas": 2}})
    yield OWN_NAMESPACE
    autoscaling = client.AutoscalingV2Api(kube_admin)
    for hpa in autoscaling.list_namespaced_horizontal_pod_autoscaler(OWN_NAMESPACE).items:
        autoscaling.delete_namespaced_horizontal_pod_autoscaler(hpa.metadata.name, OWN_NAMESPACE)
    custom = client.CustomObjectsApi(kube_admin)
    try:
        for item in custom.list_namespaced_custom_object("keda.sh", "v1alpha1", OWN_NAMESPACE, "scaledobjects")["items"]:
            custom.delete_namespaced_custom_object("keda.sh", "v1alpha1", OWN_NAMESPACE, "scaledobjects", item["metadata"]["name"])
    except client.ApiException as error:
        assert error.status == 404  # the CRD is not installed


def _deployment(name: str) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": OWN_NAMESPACE},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels},
                     "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}}}


def _hpa(name: str, target: str, low: int, high: int) -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": name, "namespace": OWN_NAMESPACE},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
                     "minReplicas": low, "maxReplicas": high,
                     "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}]}}


def test_a_deployment_outside_the_roles_names_is_forbidden(kube_admin, kube_controller, own_namespace) -> None:
    executor = KubernetesExecutor(kube_controller, own_namespace, CATALOGUE)
    assert executor.state("user-service").replicas == 2  # the application's: allowed
    for action in (lambda: executor.state("intruder"), lambda: executor.scale("intruder", 3),
                   lambda: executor.set_resources("intruder", cpu_cores=4)):
        with pytest.raises(ActionForbidden, match="forbidden"):
            action()
    assert _stored(kube_admin, own_namespace, "intruder").spec.replicas == 2


def test_an_hpa_owned_deployment_gets_new_bounds_not_new_replicas(kube_admin, kube_controller, own_namespace) -> None:
    apply_objects(kube_admin, [_hpa("post-storage-service", "post-storage-service", 2, 4)])
    executor = KubernetesExecutor(kube_controller, own_namespace, CATALOGUE)
    autoscaling = client.AutoscalingV2Api(kube_admin)

    applied = executor.scale("post-storage-service", 6)
    hpa = autoscaling.read_namespaced_horizontal_pod_autoscaler("post-storage-service", own_namespace)
    assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (6, 6)
    assert _stored(kube_admin, own_namespace, "post-storage-service").spec.replicas == 2  # left to the HPA
    assert applied.previous["autoscaler"] == "HorizontalPodAutoscaler/post-storage-service"
    executor.rollback(applied)
    hpa = autoscaling.read_namespaced_horizontal_pod_autoscaler("post-storage-service", own_namespace)
    assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (2, 4)


def test_an_autoscaler_the_role_does_not_name_is_never_fought(kube_admin, kube_controller, own_namespace) -> None:
    apply_objects(kube_admin, [_hpa("someone-elses-hpa", "user-service", 1, 3)])
    executor = KubernetesExecutor(kube_controller, own_namespace, CATALOGUE)
    with pytest.raises(ActionForbidden, match="HorizontalPodAutoscaler someone-elses-hpa"):
        executor.scale("user-service", 5)
    assert _stored(kube_admin, own_namespace, "user-service").spec.replicas == 2


def test_a_keda_scaled_object_gets_new_bounds(kube_admin, kube_controller, own_namespace) -> None:
    from kubernetes import dynamic

    apply_objects(kube_admin, [KEDA_CRD])
    crds = client.ApiextensionsV1Api(kube_admin)
    deadline = time.monotonic() + 30
    while not any(c.type == "Established" and c.status == "True"
                  for c in crds.read_custom_resource_definition("scaledobjects.keda.sh").status.conditions or []):
        assert time.monotonic() < deadline, "the ScaledObject CRD was not established"
        time.sleep(0.2)
    scaled = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "user-service", "namespace": own_namespace},
              "spec": {"scaleTargetRef": {"name": "user-service"}, "minReplicaCount": 1, "maxReplicaCount": 3,
                       "triggers": [{"type": "cpu", "metricType": "Utilization", "metadata": {"value": "60"}}]}}
    deadline = time.monotonic() + 30
    while True:  # the new resource reaches the dynamic client's discovery a moment after "Established"
        try:
            apply_objects(kube_admin, [scaled])
            break
        except (dynamic.exceptions.ResourceNotFoundError, client.ApiException):
            assert time.monotonic() < deadline
            time.sleep(0.5)
    executor = KubernetesExecutor(kube_controller, own_namespace, CATALOGUE)
    custom = client.CustomObjectsApi(kube_admin)

    applied = executor.scale("user-service", 5)
    spec = custom.get_namespaced_custom_object("keda.sh", "v1alpha1", own_namespace, "scaledobjects", "user-service")["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (5, 5)
    assert _stored(kube_admin, own_namespace, "user-service").spec.replicas == 2
    executor.rollback(applied)
    spec = custom.get_namespaced_custom_object("keda.sh", "v1alpha1", own_namespace, "scaledobjects", "user-service")["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 3)


def test_in_cluster_configuration_acts_as_the_pods_service_account(kube_run_dir, kube_controller_kubeconfig, own_namespace, tmp_path) -> None:
    import yaml

    from bmeg.cluster.kubernetes import api_client

    kubeconfig = yaml.safe_load(kube_controller_kubeconfig.read_text())
    (tmp_path / "token").write_text(kubeconfig["users"][0]["user"]["token"])
    host, _, port = kubeconfig["clusters"][0]["cluster"]["server"].removeprefix("https://").rpartition(":")
    api = api_client(environ={"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port},
                     token_file=str(tmp_path / "token"), ca_file=str(kube_run_dir / "ca.crt"))
    executor = KubernetesExecutor(api, own_namespace, CATALOGUE)
    assert executor.state("user-service").replicas == 2
    with pytest.raises(ActionForbidden):
        executor.state("intruder")


def test_the_controller_acts_only_on_the_topologys_services(kube_admin, kube_controller, own_namespace) -> None:
    """`intruder` is a Deployment here, and a span named it: the controller refuses it unasked."""
    audit = AuditLog()
    controller = Controller(KubernetesExecutor(kube_controller, own_namespace, CATALOGUE), CATALOGUE,
                            SafetyPolicy(dry_run=False, confidence_threshold=0.1), audit,
                            services=load_topology("socialnet").services)
    outcomes = controller.handle(_diagnosis("intruder"), now=0.0,
                                 telemetry={"intruder": ServiceTelemetry(cpu_utilization=0.95, replicas=2)})
    assert [(o.status, o.detail) for o in outcomes] == [("refused", "not a service of the application's topology: bmeg acts only on those")]
    assert _stored(kube_admin, own_namespace, "intruder").spec.replicas == 2
    assert controller.handle(_diagnosis("post-storage-service"), now=0.0, telemetry={
        "post-storage-service": ServiceTelemetry(cpu_utilization=0.95, replicas=2)})[0].status == "applied"
