"""Call graphs, node features and PyG batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_graphs_assemble import spans
from torch_geometric.data import Batch

from bmeg.graphs import (
    SERVICE_TIME_ONLY,
    FeatureSpec,
    assemble,
    base_columns,
    call_graphs,
    node_features,
    node_services,
    operation_baseline_ratio,
    storage_service,
)
from bmeg.graphs.batch import ServiceVocabulary, to_batch
from bmeg.graphs.features import self_time_ns
from bmeg.traces import empty_span_table, span_table


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


def test_feature_spec_and_baseline_hook():
    forest = assemble(socialnet_store_post())
    ratio = operation_baseline_ratio({("post-storage-service", "store_post_server"): 300.0})
    spec = FeatureSpec(("duration_us", "log_baseline_ratio"), extra=(ratio,))
    matrix = node_features(forest, spec)
    assert matrix.dtype == np.float32 and matrix.shape == (4, 2)
    assert np.allclose(matrix[:, 1], [0, np.log(2), 0, 0])
    assert node_features(forest, SERVICE_TIME_ONLY).shape == (4, 1)
    with pytest.raises(KeyError, match="unknown feature columns"):
        node_features(forest, FeatureSpec(("nope",)))


def two_traces():
    one = spans([("a", None, 0, 100), ("b", "a", 10, 50), ("c", "b", 20, 10)], trace_id="one")
    two = spans([("x", None, 5, 7)], trace_id="two")
    both = {name: one[name].to_pylist() + two[name].to_pylist() for name in one.column_names}
    return assemble(span_table(both))


def test_batch_equals_collating_its_graphs():
    forest = two_traces()
    batch = to_batch(forest, y=[1, 0], node_y=[0, 1, 0, 0])
    graphs = batch.to_data_list()
    assert [g.trace_id for g in graphs] == ["one", "two"]
    assert graphs[0].edge_index.tolist() == [[0, 1], [1, 2]]
    assert graphs[1].edge_index.shape == (2, 0)
    assert graphs[0].node_y.tolist() == [0, 1, 0] and graphs[1].y.tolist() == [0]
    again = Batch.from_data_list(graphs)
    for key in ("x", "edge_index", "service", "y", "node_y", "batch", "ptr"):
        assert torch.equal(batch[key], again[key]), key
    assert batch.x.dtype == torch.float32 and batch.edge_index.dtype == torch.long
    assert batch.num_graphs == 2


def test_unknown_services_map_to_index_zero():
    vocabulary = ServiceVocabulary.build(["svc-a", "svc-b"])
    batch = to_batch(two_traces(), vocabulary=vocabulary)
    assert batch.service.tolist() == [1, 2, 0, 0]


def test_label_lengths_are_checked():
    with pytest.raises(ValueError, match="one label per trace"):
        to_batch(two_traces(), y=[1])


def test_empty_table_gives_an_empty_batch():
    batch = to_batch(assemble(empty_span_table()))
    assert batch.num_graphs == 0 and batch.x.shape == (0, 7) and batch.edge_index.shape == (2, 0)
