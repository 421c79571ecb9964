"""The test Kubernetes API server enforces RBAC, and mitigation/rbac.yaml grants the mitigation
controller exactly what it needs: scaling is allowed, deleting is forbidden."""

from __future__ import annotations


import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.integration


def _deployment(name: str, replicas: int) -> client.V1Deployment:
    labels = {"app": name}
    container = client.V1Container(name="app", image="registry.invalid/bmeg/app:1")
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[container]),
            ),
        ),
    )


@pytest.fixture
def deployment(kube_admin, kube_app_namespace: str):
    """A fresh one-replica Deployment of a service of the topology (the controller's Role names
    them: `bmeg mitigate rbac`), created by the admin and removed afterwards."""
    apps = client.AppsV1Api(kube_admin)
    name = "media-frontend"
    try:  # left by an interrupted run
        apps.delete_namespaced_deployment(name, kube_app_namespace)
    except ApiException as error:
        if error.status != 404:
            raise
    apps.create_namespaced_deployment(kube_app_namespace, _deployment(name, replicas=1))
    yield name
    apps.delete_namespaced_deployment(name, kube_app_namespace)


def test_rbac_manifest_is_stored(kube_admin, kube_app_namespace: str) -> None:
    role = client.RbacAuthorizationV1Api(kube_admin).read_namespaced_role(
        "bmeg-mitigation", kube_app_namespace)
    verbs = {verb for rule in role.rules for verb in rule.verbs}
    assert "delete" not in verbs
    assert not any("secrets" in rule.resources for rule in role.rules)
    account = client.CoreV1Api(kube_admin).read_namespaced_service_account("bmeg-mitigation", "bmeg")
    assert account.metadata.name == "bmeg-mitigation"


def test_controller_scales_through_the_scale_subresource(
    kube_admin, kube_controller, kube_app_namespace: str, deployment: str
) -> None:
    client.AppsV1Api(kube_controller).patch_namespaced_deployment_scale(
        deployment, kube_app_namespace, {"spec": {"replicas": 3}})
    stored = client.AppsV1Api(kube_admin).read_namespaced_deployment(deployment, kube_app_namespace)
    assert stored.spec.replicas == 3


def test_controller_may_not_delete_deployments(
    kube_controller, kube_app_namespace: str, deployment: str
) -> None:
    with pytest.raises(ApiException) as refused:
        client.AppsV1Api(kube_controller).delete_namespaced_deployment(deployment, kube_app_namespace)
    assert refused.value.status == 403


def test_controller_may_not_read_secrets(kube_controller, kube_app_namespace: str) -> None:
    with pytest.raises(ApiException) as refused:
        client.CoreV1Api(kube_controller).list_namespaced_secret(kube_app_namespace)
    assert refused.value.status == 403


def test_controller_has_no_rights_outside_the_app_namespace(
    kube_controller, kube_app_namespace: str
) -> None:
    with pytest.raises(ApiException) as refused:
        client.AppsV1Api(kube_controller).list_namespaced_deployment("default")
    assert refused.value.status == 403
