"""Call graphs, store nodes and the per-node columns the models start from."""

from __future__ import annotations

import numpy as np
import pytest
from builders import spans

from bmeg.graphs import assemble, base_columns, call_graphs, node_services, storage_service, store_callers
from bmeg.graphs.features import self_time_ns
from bmeg.traces import span_table


def socialnet_store_post():
    """compose-post -> post-storage, which calls memcached and MongoDB (times in us)."""
    return span_table(
        {
            "trace_id": ["p"] * 4,
            "span_id": ["1", "2", "3", "4"],
            "parent_id": [None, "1", "2", "2"],
            "service": ["compose-post-service"] + ["post-storage-service"] * 3,
            "operation": [
                "compose_post_server",
                "store_post_server",
                "post_storage_mmc_mget_client",
                "post_storage_mongo_insert_client",
            ],
            "start_ns": [0, 100_000, 150_000, 400_000],
            "duration_ns": [1_000_000, 600_000, 200_000, 250_000],
            "kind": ["server", "server", "client", "client"],
        }
    )


def test_call_graph_nodes_and_edges():
    (graph,) = call_graphs(assemble(socialnet_store_post()))
    assert graph.trace_id == "p" and graph.root == 0
    assert graph.services == ["compose-post-service"] + ["post-storage-service"] * 3
    assert graph.edge_index.tolist() == [[0, 1, 1], [1, 2, 3]]


def test_storage_calls_become_store_nodes():
    (graph,) = call_graphs(assemble(socialnet_store_post()), storage_nodes=True)
    assert graph.services == [
        "compose-post-service",
        "post-storage-service",
        "post-storage-memcached",
        "post-storage-mongodb",
    ]


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (("user-mention-service", "compose_user_mentions_mongo_find_client", "client", None, None),
         "user-mention-mongodb"),
        (("social-graph-service", "social_graph_redis_get_client", "client", None, None),
         "social-graph-redis"),
        (("svc", "query", "client", "orders-db", "postgresql"), "orders-db"),  # peer.service first
        (("svc", "query", "client", None, "postgresql"), "svc-postgresql"),
        (("svc", "get_mongo_thing", "server", None, None), None),  # only client spans call stores
        (("svc", "compose_post_client", "client", None, None), None),  # an RPC, not a store
    ],
)
def test_storage_service_rule(call, expected):
    assert storage_service(*call) == expected


def test_store_owner_override():
    call = ("user-mention-service", "compose_user_mentions_memcached_get_client", "client", None, None)
    assert storage_service(*call, store_owners={"user-mention-service": "user"}) == "user-memcached"


def test_node_services_match_the_per_span_rule():
    forest = assemble(socialnet_store_post())
    assert node_services(forest, storage_nodes=True).to_pylist()[2:] == [
        "post-storage-memcached",
        "post-storage-mongodb",
    ]


def test_store_callers_name_the_one_service_whose_client_spans_stand_for_a_store():
    post = socialnet_store_post()
    assert store_callers(assemble(post)) == {"post-storage-memcached": "post-storage-service",
                                             "post-storage-mongodb": "post-storage-service"}
    # a second caller of the same memcached (peer.service names it): no one caller stands for it
    shared = span_table({
        "trace_id": ["p"] * 4 + ["q"] * 2, "span_id": ["1", "2", "3", "4", "5", "6"],
        "parent_id": [None, "1", "2", "2", None, "5"],
        "service": ["compose-post-service"] + ["post-storage-service"] * 3 + ["compose-post-service"] * 2,
        "operation": ["compose_post_server", "store_post_server", "mget", "post_storage_mongo_insert_client",
                      "compose_post_server", "mget"],
        "start_ns": [0, 100_000, 150_000, 400_000, 0, 10_000],
        "duration_ns": [1_000_000, 600_000, 200_000, 250_000, 100_000, 50_000],
        "kind": ["server", "server", "client", "client", "server", "client"],
        "peer_service": [None, None, "post-cache", None, None, "post-cache"],
    })
    assert store_callers(assemble(shared)) == {"post-storage-mongodb": "post-storage-service"}
    # an RPC callee named by peer.service has spans of its own: not a store
    rpc = socialnet_store_post().to_pydict()
    client = {"trace_id": "p", "span_id": "1c", "parent_id": "1", "service": "compose-post-service",
              "operation": "store_post_client", "start_ns": 90_000, "duration_ns": 620_000, "kind": "client",
              "peer_service": "post-storage-service"}
    rpc = {name: [*values, client.get(name, values[0])] for name, values in rpc.items()}
    rpc["parent_id"][1] = "1c"
    callers = store_callers(assemble(span_table(rpc)))
    assert "post-storage-service" not in callers and callers["post-storage-mongodb"] == "post-storage-service"
    assert store_callers(assemble(post.slice(0, 0))) == {}


def test_base_columns_worked_by_hand():
    columns = base_columns(assemble(socialnet_store_post()))
    assert columns["duration_us"].tolist() == [1000, 600, 200, 250]
    # store_post [100, 700] has children [150, 350] and [400, 650]: 450 covered.
    assert columns["self_time_us"].tolist() == [400, 150, 200, 250]
    # Path: compose (400) > store (150 of its own) > mongo (250) and mmc (200).
    assert columns["cp_exclusive_us"].tolist() == [400, 150, 200, 250]
    assert columns["on_critical_path"].tolist() == [1, 1, 1, 1]
    assert columns["start_offset_us"].tolist() == [0, 100, 150, 400]
    assert columns["depth"].tolist() == [0, 1, 2, 2]
    assert columns["fan_out"].tolist() == [1, 2, 0, 0]
    assert np.allclose(columns["log_duration_us"], np.log1p([1000, 600, 200, 250]))


def test_self_time_counts_overlapping_children_once():
    forest = assemble(
        spans([("a", None, 0, 100), ("b", "a", 10, 40), ("c", "a", 20, 10), ("d", "a", 30, 40)])
    )
    assert self_time_ns(forest).tolist() == [40, 40, 10, 40]  # union of children is [10, 70]
