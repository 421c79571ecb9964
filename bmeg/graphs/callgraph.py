"""Traces as call graphs: one node per span (an RPC of a microservice), edges parent -> child.

A trace is a DAG of spans, so a call graph keeps one node per span and a map node -> service.
With `storage_nodes=True`, a storage call that appears as a client span of the calling service
(DeathStarBench names them like `post_storage_mongo_insert_client`) becomes a node of the store
itself, e.g. `post-storage-mongodb`:

1. the span's `peer_service` when present, else
2. `<caller without "-service">-<store>`, the store taken from `db_system` (mongodb, redis,
   memcached, ...) or else from a store word in the operation name (`mongo`, `redis`,
   `memcached`/`mmc`, `rabbitmq`).

`store_owners` overrides the caller part for callers that use another service's stores (in
socialnet, user-mention-service reads `user-memcached` and `user-mongodb`:
`{"user-mention-service": "user"}`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.graphs.assemble import SpanForest

#: word in an operation name -> store name used in node names.
STORE_WORDS = {
    "mongo": "mongodb",
    "redis": "redis",
    "memcached": "memcached",
    "mmc": "memcached",
    "rabbitmq": "rabbitmq",
}
_STORE_WORD = re.compile(r"(?:^|_)(" + "|".join(STORE_WORDS) + r")(?:_|$)")
_NORMAL_DB_SYSTEMS = {"mongo": "mongodb", "mongodb": "mongodb", "redis": "redis", "memcached": "memcached"}


def storage_service(
    service: str,
    operation: str,
    kind: str,
    peer_service: str | None,
    db_system: str | None,
    store_owners: Mapping[str, str] | None = None,
) -> str | None:
    """The store a client span calls, as a service name, or None when it is no storage call."""
    if kind != "client":
        return None
    if peer_service:
        return peer_service
    store = _NORMAL_DB_SYSTEMS.get(db_system.lower(), db_system.lower()) if db_system else None
    if store is None:
        match = _STORE_WORD.search(operation.lower())
        store = STORE_WORDS[match.group(1)] if match else None
    if store is None:
        return None
    owner = (store_owners or {}).get(service, service.removesuffix("-service"))
    return f"{owner}-{store}"


def operation_keys(forest: SpanForest, services: np.ndarray | None = None) -> np.ndarray:
    """`service\x1foperation` of each span: the key of per-operation baselines and history.

    `services` (one per span, e.g. `node_services(..., storage_nodes=True)`) replaces each span's
    own service: a store's client span is then keyed by the store. The separator is refused in
    names at the door (`bmeg.serving.payloads`), so keys never collide.
    """
    return operation_key_array(forest, services).to_numpy(zero_copy_only=False)


def operation_key_array(forest: SpanForest, services: np.ndarray | pa.Array | None = None) -> pa.Array:
    """`operation_keys` as one Arrow string array: looked up and grouped in Arrow, no Python strings made."""
    if services is None:
        service = forest.spans["service"]
    else:
        service = services if isinstance(services, pa.Array) else pa.array(services, pa.string())
    keys = pc.binary_join_element_wise(service, forest.spans["operation"], "\x1f")
    return keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys


def node_services(
    forest: SpanForest, *, storage_nodes: bool = False, store_owners: Mapping[str, str] | None = None
) -> pa.Array:
    """The service of each node (span) of the forest, stores split out with `storage_nodes`.

    The store rule runs once per distinct (service, operation, kind, peer, db) combination,
    not once per span.
    """
    spans = forest.spans
    services = spans["service"].combine_chunks()
    if not storage_nodes or forest.num_spans == 0:
        return services
    parts = [spans[name] for name in ("service", "operation", "kind")]
    parts += [pc.fill_null(spans[name], "") for name in ("peer_service", "db_system")]
    encoded = pc.dictionary_encode(pc.binary_join_element_wise(*parts, "\x1f")).combine_chunks()
    renamed = []
    for combination in encoded.dictionary.to_pylist():
        service, operation, kind, peer, db = combination.split("\x1f")
        store = storage_service(service, operation, kind, peer or None, db or None, store_owners)
        renamed.append(store or service)
    return pa.array(renamed, pa.string()).take(encoded.indices)


def store_callers(forest: SpanForest) -> dict[str, str]:
    """Each store node's calling service, for the stores one service alone calls.

    A store here is a node service (`node_services` with `storage_nodes`) with no span of its
    own: the traces know it only from its caller's client spans, so its time is measured by
    that caller's process (a starved caller or a wait for a pooled connection stretches the same
    spans). A store two services call is left out: no one caller stands for it.
    """
    services = node_services(forest, storage_nodes=True)
    callers = forest.spans["service"].combine_chunks() if forest.num_spans else pa.array([], pa.string())
    stores = pc.invert(pc.is_in(services, value_set=pc.unique(callers)))
    pairs = pa.table({"store": services, "caller": callers}).filter(stores).group_by(["store", "caller"]).aggregate([])
    found: dict[str, list[str]] = {}
    for store, caller in zip(pairs["store"].to_pylist(), pairs["caller"].to_pylist(), strict=True):
        found.setdefault(store, []).append(caller)
    return {store: names[0] for store, names in found.items() if len(names) == 1}


@dataclass(frozen=True)
class CallGraph:
    """One trace as a graph; node i is span `span_ids[i]`."""

    trace_id: str
    span_ids: list[str]
    services: list[str]
    operations: list[str]
    edge_index: np.ndarray  # int64 [2, E]: parent node -> child node
    root: int


def call_graph(
    forest: SpanForest,
    trace: int,
    *,
    storage_nodes: bool = False,
    store_owners: Mapping[str, str] | None = None,
    services: pa.Array | None = None,
) -> CallGraph:
    """Trace number `trace` of the forest as a call graph (pass `services` to reuse them)."""
    if services is None:
        services = node_services(forest, storage_nodes=storage_nodes, store_owners=store_owners)
    rows = forest.trace_slice(trace)
    offset = rows.start
    parent = forest.parent[rows]
    children = np.flatnonzero(parent >= 0)
    return CallGraph(
        trace_id=forest.trace_ids[trace],
        span_ids=forest.spans["span_id"][rows].to_pylist(),
        services=services[rows].to_pylist(),
        operations=forest.spans["operation"][rows].to_pylist(),
        edge_index=np.stack([parent[children] - offset, children]).astype(np.int64),
        root=int(forest.root[trace]) - offset,
    )


def call_graphs(forest: SpanForest, **options) -> list[CallGraph]:
    """Every trace of the forest as a call graph (options as for `call_graph`)."""
    services = node_services(forest, **options)
    return [call_graph(forest, trace, services=services) for trace in range(forest.num_traces)]


def edge_index(forest: SpanForest) -> np.ndarray:
    """All parent -> child edges of the forest, in global rows, grouped by trace: int64 [2, E]."""
    children = np.flatnonzero(forest.parent >= 0)
    return np.stack([forest.parent[children], children])
