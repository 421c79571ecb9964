"""One controller at a time: leader election through a Kubernetes Lease.

Replicas of the mitigation controller all run; only the one holding the Lease (default
`bmeg/bmeg-mitigation`, in coordination.k8s.io) consumes `bmeg.mitigations` and acts. The
election is the Kubernetes Python client's own helper (`kubernetes.leaderelection`: a
`LeaseLock`, with the lease renewed every `retry_s` seconds); this module only wires it to an
API client of our choosing and to a piece of work, and adds the two things the helper lacks:

- **the work ends leadership**: when the work returns (or raises), the candidate stops
  renewing and releases the Lease, instead of holding it with nothing running;
- **a stopped leader hands over at once**: on leaving (the work's end, SIGTERM) the leader
  clears the holder in the Lease, so a follower takes over on its next retry rather than
  after the lease duration. A leader that dies without that (SIGKILL, a lost node) is
  replaced once `lease_s` has passed without a renewal.

Safety rests on the helper's timing rule: a leader that cannot renew within `renew_s`
(< `lease_s`) stops leading (`stop` is set; the work must check it before each action), before
any follower may consider the lease expired. Updates carry the Lease's resourceVersion, so
two candidates never both win one round.

The Role that lets the controller do this (get, create, update on `leases` in its own
namespace) belongs beside its other rights in mitigation/rbac.yaml.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

LEASE_NAME = "bmeg-mitigation"
LEASE_NAMESPACE = "bmeg"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Election:
    """Which Lease, who this candidate is, and the timing (whole seconds, as the helper wants)."""

    identity: str
    name: str = LEASE_NAME
    namespace: str = LEASE_NAMESPACE
    lease_s: int = 15
    renew_s: int = 10
    retry_s: int = 2

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("a candidate needs a non-empty identity (e.g. the pod's name)")
        # the helper's own checks call sys.exit(); say what is wrong instead
        if not (1 <= self.retry_s and 1.2 * self.retry_s < self.renew_s < self.lease_s):
            raise ValueError(f"need 1 <= retry_s, 1.2 * retry_s < renew_s < lease_s (got retry {self.retry_s}, "
                             f"renew {self.renew_s}, lease {self.lease_s})")


def default_identity() -> str:
    """The pod's name where the Deployment passes it (POD_NAME), else host and process id."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


class _Candidate(leaderelection.LeaderElection):
    """The helper's election, where the work's end (return or exception) ends leadership."""

    def run_onstarted_leading(self, leading_failed: threading.Event) -> None:
        try:
            super().run_onstarted_leading(leading_failed)
        finally:
            leading_failed.set()


def lead(api: client.ApiClient, election: Election, work: Callable[[threading.Event], None]) -> None:
    """Block until this candidate holds the Lease, run `work(stop)` while it does, release it.

    Returns when the work has returned, or when leadership was lost (then `stop` is set and
    the work, still running on its thread, must not act again). KeyboardInterrupt and
    SystemExit (e.g. SIGTERM turned into one) also release the Lease if it is held."""
    lock = LeaseLock(election.name, election.namespace, election.identity)
    lock.api_instance = client.CoordinationV1Api(api)  # the helper would use the global default client
    stop, started, finished = threading.Event(), threading.Event(), threading.Event()

    def leading() -> None:
        started.set()
        log.info("%s leads (Lease %s/%s)", election.identity, election.namespace, election.name)
        try:
            work(stop)
        finally:
            finished.set()

    config = electionconfig.Config(lock, election.lease_s, election.renew_s, election.retry_s,
                                   onstarted_leading=leading, onstopped_leading=stop.set)
    try:
        _Candidate(config).run()
    finally:
        stop.set()
        if started.is_set():
            finished.wait(election.renew_s)  # let the work see `stop` before the Lease is free
        release(api, election)


def release(api: client.ApiClient, election: Election) -> bool:
    """Clear the holder of the Lease if this candidate holds it; True if it did."""
    leases = client.CoordinationV1Api(api)
    try:
        lease = leases.read_namespaced_lease(election.name, election.namespace)
        if lease.spec is None or lease.spec.holder_identity != election.identity:
            return False
        lease.spec.holder_identity = None
        leases.replace_namespaced_lease(election.name, election.namespace, lease)  # resourceVersion-checked
    except ApiException as error:
        log.warning("could not release Lease %s/%s: %s", election.namespace, election.name, error.reason)
        return False
    log.info("%s released Lease %s/%s", election.identity, election.namespace, election.name)
    return True


def holder(api: client.ApiClient, name: str = LEASE_NAME, namespace: str = LEASE_NAMESPACE) -> str | None:
    """Who holds the Lease now (None: nobody, or no Lease yet)."""
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return lease.spec.holder_identity if lease.spec else None
