"""The OpenTelemetry semantic-convention keys the readers take a span's peer, store and replica
from, current keys beside the deprecated ones that older SDKs and Jaeger clients still send.

- **peer service** (`peer_service`): `service.peer.name` (current), else `peer.service`
  (deprecated). A *database* call that names neither (OpenTelemetry's database
  instrumentations set `db.system.name` and `server.address`, not the peer) takes the first
  DNS label of `server.address` (else of the deprecated `net.peer.name`) when it is a host
  name: in Kubernetes that is the store's Service (`user-mongodb.socialnet.svc` ->
  `user-mongodb`). An IP address names no service and is ignored. Other client calls never
  take `server.address`: `peer_service` renames a call's node in the call graph, and an HTTP
  client's host is not a store.
- **database system** (`db_system`): `db.system.name` (current), else `db.system`.
- **status**: `otel.status_code` (`status_of_code`) where the format has no status field.
- **replica** (`instance`): `service.instance.id`, `k8s.pod.name`, `host.name`, most specific
  first (resource attributes; Jaeger process tags and Zipkin tags add their own keys).

Writers keep the deprecated `peer.service` and `db.system`, which every reader understands.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

SERVICE_NAME = "service.name"
#: What OpenTelemetry SDKs report when no service name is configured.
UNKNOWN_SERVICE = "unknown_service"
PEER_SERVICE = "peer.service"  # deprecated; what the writers write
DB_SYSTEM = "db.system"  # deprecated; what the writers write
PEER_SERVICE_KEYS = ("service.peer.name", PEER_SERVICE)
DB_SYSTEM_KEYS = ("db.system.name", DB_SYSTEM)
SERVER_ADDRESS_KEYS = ("server.address", "net.peer.name")
#: Resource attributes naming the replica that ran a span, most specific first.
INSTANCE_KEYS = ("service.instance.id", "k8s.pod.name", "host.name")


def status_of_code(code: object) -> str | None:
    """`otel.status_code` as Jaeger and Zipkin carry it ("OK", "ERROR"; the Collector's zipkinv2
    translator writes "STATUS_CODE_OK", "STATUS_CODE_ERROR") as "ok"/"error", else None."""
    text = str(code).upper().removeprefix("STATUS_CODE_") if code is not None else ""
    return {"OK": "ok", "ERROR": "error"}.get(text)


def peer_and_db_system(value: Callable[[str], str | None]) -> tuple[str | None, str | None]:
    """`(peer_service, db_system)` of a span, given its attribute lookup (None when absent)."""
    db_system = first_value(value, DB_SYSTEM_KEYS)
    peer = first_value(value, PEER_SERVICE_KEYS)
    if peer is None and db_system is not None:
        peer = service_of_host(first_value(value, SERVER_ADDRESS_KEYS))
    return peer, db_system


def first_value(value: Callable[[str], str | None], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        found = value(key)
        if found is not None:
            return found
    return None


def service_of_host(host: str | None) -> str | None:
    """The first label of a host name; None for an IP address or an empty name."""
    if not host:
        return None
    try:
        ipaddress.ip_address(host.strip("[]"))
        return None
    except ValueError:
        return host.split(".", 1)[0] or None
