"""Call graphs for display: one node per RPC (service + operation), edges with call counts.

The web page draws these; a span-level graph would repeat a node for every call of the same
RPC, which hides the shape of the application behind fan-out. Graphs are built from the
assembled, repaired forest, the same one the detector sees, and a storage call is the node of
its store (`memcached-rate`), as the model names it, while `span_service` keeps the service
that emitted the span (the name the critical path uses).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, Field

from bmeg.graphs import assemble, node_services


class GraphNode(BaseModel):
    id: int
    service: str = Field(description="The node's service as the model names it (a store for storage calls).")
    span_service: str = Field(description="The service that emitted the spans.")
    operation: str
    calls: int
    total_us: float = Field(description="Summed duration of its spans.")


class GraphEdge(BaseModel):
    source: int
    target: int
    calls: int


class TraceGraph(BaseModel):
    trace_id: str
    nodes: list[GraphNode]
    edges: list[GraphEdge]


def trace_graphs(spans: pa.Table, trace_ids: list[str]) -> list[TraceGraph]:
    """The RPC graph of each trace in `trace_ids` (spans of other traces are ignored)."""
    forest = assemble(spans.filter(pc.is_in(spans["trace_id"], pa.array(trace_ids, pa.string()))), on_bad_trace="drop")
    frame = pd.DataFrame({
        "trace": forest.trace_index, "row": np.arange(forest.num_spans), "parent": forest.parent,
        "service": node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False),
        "span_service": forest.spans["service"].to_numpy(zero_copy_only=False),
        "operation": forest.spans["operation"].to_numpy(zero_copy_only=False),
        "duration_ns": forest.duration_ns,
    })
    return [_graph(forest.trace_ids[t], spans) for t, spans in frame.groupby("trace", sort=True)]


def _graph(trace_id: str, spans: pd.DataFrame) -> TraceGraph:
    key = ["service", "span_service", "operation"]
    rpc = spans.groupby(key, sort=False).agg(calls=("row", "size"), total_ns=("duration_ns", "sum")).reset_index()
    rpc["id"] = range(len(rpc))
    spans = spans.merge(rpc[[*key, "id"]], on=key)
    node_of_row = spans.set_index("row")["id"]
    calls = spans[spans["parent"] >= 0]
    edges = pd.DataFrame({"source": node_of_row.loc[calls["parent"]].to_numpy(), "target": calls["id"].to_numpy()})
    edges = edges.groupby(["source", "target"]).size().reset_index(name="calls")
    return TraceGraph(
        trace_id=trace_id,
        nodes=[GraphNode(id=int(row.id), service=row.service, span_service=row.span_service, operation=row.operation,
                         calls=int(row.calls), total_us=float(row.total_ns) / 1e3) for row in rpc.itertuples()],
        edges=[GraphEdge(source=int(row.source), target=int(row.target), calls=int(row.calls))
               for row in edges.itertuples()],
    )
