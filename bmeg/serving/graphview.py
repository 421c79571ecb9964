"""Call graphs for display: one node per RPC (service + operation), edges with call counts.

The web page draws these; a span-level graph would repeat a node for every call of the same
RPC, which hides the shape of the application behind fan-out.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
from pydantic import BaseModel


class GraphNode(BaseModel):
    id: int
    service: str
    operation: str
    calls: int
    total_us: float  # summed duration of its spans


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
    frame = spans.select(["trace_id", "span_id", "parent_id", "service", "operation", "duration_ns"]).to_pandas()
    frame = frame[frame["trace_id"].isin(trace_ids)]
    by_trace = dict(tuple(frame.groupby("trace_id", sort=False)))
    return [_graph(trace_id, by_trace[trace_id]) for trace_id in trace_ids if trace_id in by_trace]


def _graph(trace_id: str, spans: pd.DataFrame) -> TraceGraph:
    spans = spans.drop_duplicates("span_id")
    rpc = spans.groupby(["service", "operation"], sort=False).agg(
        calls=("span_id", "size"), total_ns=("duration_ns", "sum")).reset_index()
    rpc["id"] = range(len(rpc))
    spans = spans.merge(rpc[["service", "operation", "id"]], on=["service", "operation"])
    parents = spans[["span_id", "id"]].rename(columns={"span_id": "parent_id", "id": "source"})
    calls = spans.merge(parents, on="parent_id").rename(columns={"id": "target"})
    edges = calls.groupby(["source", "target"]).size().reset_index(name="calls")
    return TraceGraph(
        trace_id=trace_id,
        nodes=[GraphNode(id=int(row.id), service=row.service, operation=row.operation, calls=int(row.calls),
                         total_us=float(row.total_ns) / 1e3) for row in rpc.itertuples()],
        edges=[GraphEdge(source=int(row.source), target=int(row.target), calls=int(row.calls))
               for row in edges.itertuples()],
    )
