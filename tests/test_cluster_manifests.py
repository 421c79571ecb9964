"""Every Kubernetes manifest of the scale-out paths passes the real API server's validation:
each object is created with server-side dry run and strict field validation (what
`kubectl apply --dry-run=server --validate=strict` sends), in a namespace of the test's own,
so a misspelled field, a wrong type or an invalid combination fails here and not on a cluster.
The namespace enforces the restricted Pod Security profile, and each Job's pod template is also
created there as a Pod (dry run), so the API server's PodSecurity admission judges it.

KEDA's ScaledObject is not a built-in kind: the API server is first given
tests/manifests/keda-scaledobject-crd.yaml, a minimal structural CRD written for these tests
(not KEDA's own CRD, which cannot be downloaded here) that declares ScaledObject's fields
with KEDA's names and types."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from conftest_infra import apply_objects, load_manifest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted([*(ROOT / "datasets" / "kubernetes").glob("*.yaml"),
                    *(ROOT / "training" / "kubernetes").glob("*.yaml"),
                    *(ROOT / "serving" / "kubernetes").glob("*.yaml")])
CRDS = [ROOT / "tests" / "manifests" / "keda-scaledobject-crd.yaml"]


@pytest.fixture(scope="module")
def cluster(kube_admin):
    """A dynamic client that knows the test CRDs (installed and established first)."""
    from kubernetes import client, dynamic

    crds = [body for path in CRDS for body in load_manifest(path)]
    apply_objects(kube_admin, crds)
    extensions = client.ApiextensionsV1Api(kube_admin)
    deadline = time.monotonic() + 60
    for crd in crds:
        while not any(condition.type == "Established" and condition.status == "True"
                      for condition in extensions.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions or []):
            assert time.monotonic() < deadline, f"CRD {crd['metadata']['name']} not established"
            time.sleep(0.5)
    return dynamic.DynamicClient(kube_admin)


@pytest.fixture(scope="module")
def namespace(kube_admin):
    from kubernetes import client

    name = f"bmeg-manifests-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(kube_admin)
    core.create_namespace({"metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    # no controller-manager here makes the namespace's default ServiceAccount, which admission looks up
    core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})
    yield name
    core.delete_namespace(name)


def dry_run_create(cluster, namespace: str, body: dict) -> dict:
    """POST with dryRun=All and fieldValidation=Strict; the server's answer (nothing is stored)."""
    resource = cluster.resources.get(api_version=body["apiVersion"], kind=body["kind"])
    if resource.namespaced:
        body = {**body, "metadata": {**body["metadata"], "namespace": namespace}}
    stored = cluster.create(resource, body=body, namespace=namespace if resource.namespaced else None,
                            dry_run="All", query_params=[("fieldValidation", "Strict")])
    return stored.to_dict()


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_manifest_passes_the_api_servers_validation(cluster, namespace, manifest):
    objects = load_manifest(manifest)
    assert objects, manifest
    for body in objects:
        stored = dry_run_create(cluster, namespace, body)
        assert (stored["kind"], stored["metadata"]["name"]) == (body["kind"], body["metadata"]["name"])
        if body["kind"] == "Job":  # admission enforces the profile on pods, not on the Job itself
            template = body["spec"]["template"]
            dry_run_create(cluster, namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": body["metadata"]["name"], "labels": template["metadata"]["labels"]}, "spec": template["spec"]})


def test_dry_run_stores_nothing(cluster, namespace):
    from kubernetes.dynamic.exceptions import NotFoundError

    (job,) = [body for body in load_manifest(ROOT / "datasets" / "kubernetes" / "merge.yaml")]
    dry_run_create(cluster, namespace, job)
    with pytest.raises(NotFoundError):
        cluster.resources.get(api_version="batch/v1", kind="Job").get(name=job["metadata"]["name"], namespace=namespace)


@pytest.mark.parametrize("manifest, path, value, error", [
    ("serving/kubernetes/consumer.yaml", ["spec", "replica"], 2, 'unknown field "spec.replica"'),
    ("serving/kubernetes/consumer-scaling.yaml", ["spec", "maxReplicaCount"], "12", "spec.maxReplicaCount"),
    ("serving/kubernetes/consumer-scaling.yaml", ["spec", "minReplicas"], 1, 'unknown field "spec.minReplicas"'),
    ("datasets/kubernetes/generate.yaml", ["spec", "completionMode"], "Sharded", "spec.completionMode"),
    ("training/kubernetes/torchrun.yaml", ["spec", "template", "spec", "restartPolicy"], "Always",
     "spec.template.spec.restartPolicy"),
])
def test_a_broken_manifest_fails(cluster, namespace, manifest, path, value, error):
    """The check has teeth: one wrong field in a real manifest is refused, naming the field."""
    from kubernetes.dynamic.exceptions import DynamicApiError

    objects = load_manifest(ROOT / manifest)
    kind = {"consumer.yaml": "Deployment", "consumer-scaling.yaml": "ScaledObject"}.get(Path(manifest).name, "Job")
    (body,) = [body for body in objects if body["kind"] == kind]
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(DynamicApiError) as refused:
        dry_run_create(cluster, namespace, body)
    assert refused.value.status in (400, 422) and error in json.loads(refused.value.body)["message"]
