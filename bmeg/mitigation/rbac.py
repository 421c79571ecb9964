"""The controller's RBAC, generated from the application's topology (`bmeg mitigate rbac`).

The Role grants exactly the calls `bmeg.cluster.kubernetes.KubernetesExecutor` makes, and
only on the application's own objects:

- Deployments named as the topology's services: `get` (state), `patch` (resources,
  parameters, anti-affinity, the `bmeg.io/last-action` annotation), and `patch` of their
  `scale` subresource;
- the ConfigMaps the parameter catalogue writes for those services: `get`, `patch`;
- HorizontalPodAutoscalers and KEDA ScaledObjects: `list` (to find the one that owns a
  Deployment's replicas; RBAC cannot limit a list by name) and `patch` of those named as the
  topology's services (as `kubectl autoscale` names them). An autoscaler named otherwise is
  found but not patched: the action fails as forbidden, and bmeg never fights it over replicas.

A second Role, in the controller's own namespace, holds the Lease of its leader election
(`get`, `update` on the Lease `bmeg-mitigation`; `create`, which RBAC cannot limit by name).
Nothing may be created or deleted in the application's namespace, and no Secret is read.
"""

from __future__ import annotations

from collections.abc import Iterable

import yaml

from bmeg.cluster.catalogue import Catalogue

CONTROLLER = "bmeg-mitigation"  # the ServiceAccount, the Roles and the Lease
CONTROLLER_NAMESPACE = "bmeg"
HEADER = """\
# What the B-MEG mitigation controller may do, and nothing more. GENERATED from the topology
# by `bmeg mitigate rbac --topology {application} --namespace {namespace} -o mitigation/rbac.yaml`
# (tests/test_mitigation_rbac.py checks that this file is what the command writes).
#
# The controller runs as ServiceAccount {controller_namespace}/{controller} (mitigation/controller.yaml). In the
# application's namespace `{namespace}` (which must exist) it may read and patch the application's
# Deployments (by name) and their scale, read and patch the ConfigMaps its parameters live in,
# list autoscalers (HPA, KEDA ScaledObject) and patch those named as the application's services.
# It may not create or delete anything there, nor read Secrets. In `{controller_namespace}` it holds the
# Lease of its leader election.
#
# The integration tests' API server authenticates the controller with a static token whose
# user name is the ServiceAccount's, system:serviceaccount:{controller_namespace}:{controller}, so the
# RoleBindings below bind that identity too (scripts/kube-apiserver.sh).
"""


def rule(group: str, resource: str, verbs: list[str], names: Iterable[str] | None = None) -> dict:
    body: dict = {"apiGroups": [group], "resources": [resource], "verbs": verbs}
    if names is not None:
        body["resourceNames"] = sorted(set(names))
    return body


def controller_rbac(services: Iterable[str], namespace: str, catalogue: Catalogue) -> list[dict]:
    """The Namespace, ServiceAccount, Roles and RoleBindings of the controller acting on `services`."""
    services = sorted(set(services))
    configmaps = sorted({parameter.configmap.name for service in services
                         for parameter in catalogue.parameters_for(service).values() if parameter.configmap})
    app_rules = [
        rule("apps", "deployments", ["get", "patch"], services),
        rule("apps", "deployments/scale", ["patch"], services),
        *([rule("", "configmaps", ["get", "patch"], configmaps)] if configmaps else []),
        rule("autoscaling", "horizontalpodautoscalers", ["list"]),
        rule("autoscaling", "horizontalpodautoscalers", ["patch"], services),
        rule("keda.sh", "scaledobjects", ["list"]),
        rule("keda.sh", "scaledobjects", ["patch"], services),
    ]
    lease_rules = [
        rule("coordination.k8s.io", "leases", ["get", "update"], [CONTROLLER]),
        rule("coordination.k8s.io", "leases", ["create"]),
    ]
    account = {"kind": "ServiceAccount", "name": CONTROLLER, "namespace": CONTROLLER_NAMESPACE}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CONTROLLER_NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": CONTROLLER, "namespace": CONTROLLER_NAMESPACE},
         "automountServiceAccountToken": True},
        *_role_and_binding(CONTROLLER, namespace, app_rules, account),
        *_role_and_binding(f"{CONTROLLER}-leader", CONTROLLER_NAMESPACE, lease_rules, account),
    ]


def _role_and_binding(name: str, namespace: str, rules: list[dict], account: dict) -> list[dict]:
    metadata = {"name": name, "namespace": namespace}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": metadata, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": metadata,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}, "subjects": [account]},
    ]


def render(objects: list[dict], application: str, namespace: str) -> str:
    """The manifest as committed: the header, then the objects as YAML documents."""
    header = HEADER.format(application=application, namespace=namespace, controller=CONTROLLER,
                           controller_namespace=CONTROLLER_NAMESPACE)
    return header + "---\n".join(yaml.safe_dump(obj, sort_keys=False, width=120, default_flow_style=None) for obj in objects)
