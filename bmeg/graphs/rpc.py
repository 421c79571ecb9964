"""The RPC view of a trace: its spans as server and client spans of RPCs, internal work folded in.

- A *server span* is a trace's root, or a span whose parent runs in another service.
- A *client span* is a span with exactly one child, in another service (the RPC it made), or
  a childless span naming a `peer_service`/`db_system` (a call to a store). OpenTelemetry
  `kind`s say so directly where they are set.
- Every other span is *internal* (work inside a service, e.g. `sql.rows` or a helper method)
  and is folded into its parent by `rpc_view`: its children move up to the parent, and its time
  becomes the parent's self time.

Real instrumentation adds internal spans that a topology's simulator does not make; the twin
fitter (`bmeg.faultinject.twin`) and every root-cause ranker (`bmeg.evaluation`) read traces
in this view, so they compare like with like.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from bmeg.graphs.assemble import SpanForest, assemble


def span_roles(forest: SpanForest) -> tuple[np.ndarray, np.ndarray]:
    """(is_server, is_client) per span of a forest, by `kind` where set, else by structure."""
    spans = forest.spans
    service = spans["service"].to_numpy(zero_copy_only=False)
    kind = spans["kind"].to_numpy(zero_copy_only=False)
    peer = spans["peer_service"].is_valid().to_numpy(zero_copy_only=False)
    peer |= spans["db_system"].is_valid().to_numpy(zero_copy_only=False)
    parent = forest.parent
    has_parent = parent >= 0
    cross = np.zeros(forest.num_spans, dtype=bool)  # parent in another service
    cross[has_parent] = service[has_parent] != service[parent[has_parent]]
    children = np.bincount(parent[has_parent], minlength=forest.num_spans)
    cross_children = np.bincount(parent[cross], minlength=forest.num_spans)
    structural_client = ((children == 1) & (cross_children == 1)) | ((children == 0) & peer)
    is_client = np.where(kind == "client", True, np.where(kind == "server", False, structural_client))
    is_client &= has_parent
    is_server = ~has_parent | (~is_client & (cross | (kind == "server")))
    return is_server, is_client


def called_spans(forest: SpanForest, is_client: np.ndarray) -> np.ndarray:
    """The spans a client span called (each child of a client span, `span_roles`'s `is_client`),
    ascending; `forest.parent` of them is their client spans. What a client span adds around its
    callee (network, queues) is the callee's."""
    child = np.flatnonzero(forest.parent >= 0)
    return child[is_client[forest.parent[child]]]


def rpc_view(spans: pa.Table | SpanForest) -> SpanForest:
    """The forest without internal spans: each kept span's parent is its nearest kept ancestor."""
    forest = spans if isinstance(spans, SpanForest) else assemble(spans, on_bad_trace="drop")
    is_server, is_client = span_roles(forest)
    keep = is_server | is_client
    if keep.all():
        return forest
    parent = forest.parent.copy()
    folded = (parent >= 0) & ~keep[np.maximum(parent, 0)]
    while folded.any():  # climb past internal ancestors, one level per round
        parent[folded] = forest.parent[parent[folded]]
        folded = (parent >= 0) & ~keep[np.maximum(parent, 0)]
    rows = np.flatnonzero(keep)
    new_row = np.full(forest.num_spans, -1)
    new_row[rows] = np.arange(len(rows))
    table = forest.spans.take(pa.array(rows))
    span_ids = table["span_id"]
    parent_rows = parent[rows]
    parent_ids = span_ids.take(pa.array(np.maximum(new_row[parent_rows], 0), mask=parent_rows < 0))
    table = table.set_column(table.schema.get_field_index("parent_id"), "parent_id", parent_ids)
    # the repaired times of the forest, so that folding never brings clock skew back
    table = table.set_column(table.schema.get_field_index("start_ns"), "start_ns", pa.array(forest.start_ns[rows]))
    return assemble(table, on_bad_trace="drop")
