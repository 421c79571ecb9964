"""The socialnet deployment on one machine: services, their call edges, stores, ports and CPUs.

Services and edges follow `../shared/reference/socialnet.md` (DeathStarBench's Social Network):
PostgreSQL stands in for MongoDB. Every service gets a *front proxy* (`socialnet proxy`) on
its own port, and every caller's `peers` point at the callee's front proxy, never at the
service itself: the network-delay fault then sets the proxy's delay without touching the
callers, and the proxies cost one loopback hop (~0.1 ms) when idle.

Ports are `base + offset` (base from `BMEG_TESTBED_PORT_BASE`, default 27100):
services at +0..+11, front proxies at +20..+31 (admin +40..+51), stores at +60 (Redis),
+61 (memcached), +62 (PostgreSQL), a bandwidth relay at +70..+81 while a fault uses it.

CPUs: a 2-core machine, services alternate between CPU 0 and CPU 1 (each in its own cgroup
with a CPU quota of `DEFAULT_QUOTA_CORES`), stores on CPU 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from bmeg.faultinject.cpu import CFS_PERIOD_US as CFS_PERIOD_US  # the testbed's cgroups use the kernel's default

DEFAULT_PORT_BASE = 27100
#: each service's CPU limit (cgroup v1 cfs_quota_us / cfs_period_us): the scale-up action raises it
DEFAULT_QUOTA_CORES = 0.5
DEFAULT_WORKERS = 64
DEFAULT_DB_POOL = 8
DEFAULT_CACHE_ITEMS = 10_000
#: the request mix of the papers (10% compose, 30% user timeline, 60% home timeline)
DEFAULT_MIX = "compose=0.1,user=0.3,home=0.6"

#: service -> the services it calls (reference's call edges; the social-graph <-> user cycle
#: exists at service level, not within one trace)
EDGES: dict[str, tuple[str, ...]] = {
    "nginx-web-server": ("compose-post-service", "home-timeline-service", "user-timeline-service",
                         "user-service", "social-graph-service"),
    "compose-post-service": ("text-service", "user-service", "media-service", "unique-id-service",
                             "post-storage-service", "user-timeline-service", "home-timeline-service"),
    "text-service": ("url-shorten-service", "user-mention-service"),
    "url-shorten-service": (),
    "user-mention-service": (),
    "unique-id-service": (),
    "media-service": (),
    "user-service": ("social-graph-service",),
    "social-graph-service": ("user-service",),
    "post-storage-service": (),
    "home-timeline-service": ("social-graph-service", "post-storage-service"),
    "user-timeline-service": ("post-storage-service",),
}
SERVICES: tuple[str, ...] = tuple(EDGES)
ENTRY = "nginx-web-server"
#: service -> the stores it uses (redis value: its database number)
REDIS_DB = {"social-graph-service": 1, "home-timeline-service": 2, "user-timeline-service": 3}
MEMCACHED = {"post-storage-service", "user-service", "user-mention-service"}
POSTGRES = {"social-graph-service", "post-storage-service", "user-timeline-service", "url-shorten-service",
            "user-service", "user-mention-service"}
#: services with a store connection pool (`db_pool`)
STORE_USERS = set(REDIS_DB) | MEMCACHED | POSTGRES
#: the services with an in-process cache whose size `cache_items` sets (only post-storage has one)
CACHES = {"post-storage-service"}
STORES = ("redis", "memcached", "postgres")
#: the operations a drawn code fault may break, per service (the routes the load's mix reaches)
CODE_OPERATIONS: dict[str, tuple[str, ...]] = {
    "compose-post-service": ("/compose_post",),
    "text-service": ("/compose_text",),
    "url-shorten-service": ("/compose_urls",),
    "user-mention-service": ("/compose_user_mentions",),
    "unique-id-service": ("/compose_unique_id",),
    "media-service": ("/compose_media",),
    "user-service": ("/compose_creator",),
    "social-graph-service": ("/get_followers",),
    "post-storage-service": ("/read_posts", "/store_post"),
    "home-timeline-service": ("/read_home_timeline", "/write_home_timeline"),
    "user-timeline-service": ("/read_user_timeline", "/write_user_timeline"),
}
POSTGRES_USER = "bmeg"
POSTGRES_DB = "socialnet"


def port_base() -> int:
    text = os.environ.get("BMEG_TESTBED_PORT_BASE", str(DEFAULT_PORT_BASE))
    try:
        base = int(text)
    except ValueError:
        raise ValueError(f"BMEG_TESTBED_PORT_BASE={text!r} is not a port number") from None
    if not 1024 <= base <= 65535 - 100:
        raise ValueError(f"BMEG_TESTBED_PORT_BASE={base} must lie in [1024, {65535 - 100}]")
    return base


@dataclass(frozen=True)
class Ports:
    base: int = DEFAULT_PORT_BASE

    def service(self, service: str) -> int:
        return self.base + SERVICES.index(service)

    def proxy(self, service: str) -> int:
        return self.base + 20 + SERVICES.index(service)

    def proxy_admin(self, service: str) -> int:
        return self.base + 40 + SERVICES.index(service)

    def relay(self, service: str) -> int:
        return self.base + 70 + SERVICES.index(service)

    @property
    def redis(self) -> int:
        return self.base + 60

    @property
    def memcached(self) -> int:
        return self.base + 61

    @property
    def postgres(self) -> int:
        return self.base + 62


def service_cpu(service: str) -> int:
    """The CPU a service is pinned to (alternating over the two cores)."""
    return SERVICES.index(service) % 2


STORE_CPU = 1


@dataclass
class ServiceConfig:
    """What `socialnet service --config FILE` reads (TESTBED_CONTRACT.md)."""

    service: str
    listen: str
    peers: dict[str, str]
    otlp_endpoint: str
    workers: int = DEFAULT_WORKERS
    db_pool: int = DEFAULT_DB_POOL
    cache_items: int = DEFAULT_CACHE_ITEMS
    stores: dict[str, str | int] = field(default_factory=dict)

    def to_json(self) -> dict:
        document: dict = {"service": self.service, "listen": self.listen, "peers": self.peers, **self.stores,
                          "workers": self.workers, "db_pool": self.db_pool, "cache_items": self.cache_items,
                          "otlp_endpoint": self.otlp_endpoint}
        return document


def service_config(service: str, ports: Ports, otlp_endpoint: str, instance: int = 0) -> ServiceConfig:
    """The normal configuration of `service` (replica `instance` > 0 listens on a port of its own)."""
    if service not in EDGES:
        raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    stores: dict[str, str | int] = {}
    if service in REDIS_DB:
        stores.update({"redis": f"127.0.0.1:{ports.redis}", "redis_db": REDIS_DB[service]})
    if service in MEMCACHED:
        stores["memcached"] = f"127.0.0.1:{ports.memcached}"
    if service in POSTGRES:
        stores["postgres"] = f"postgres://{POSTGRES_USER}@127.0.0.1:{ports.postgres}/{POSTGRES_DB}?sslmode=disable"
    port = ports.service(service) if instance == 0 else replica_port(ports, service, instance)
    return ServiceConfig(
        service=service, listen=f"127.0.0.1:{port}",
        peers={callee: f"http://127.0.0.1:{ports.proxy(callee)}" for callee in EDGES[service]},
        otlp_endpoint=otlp_endpoint, stores=stores)


def replica_port(ports: Ports, service: str, instance: int) -> int:
    """Replicas started by the scale-out action: base + 100 + 12 * instance + index."""
    return ports.base + 100 + len(SERVICES) * instance + SERVICES.index(service)
