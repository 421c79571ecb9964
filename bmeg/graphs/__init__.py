"""Traces -> call graphs: assembly and repair, critical paths, per-node columns, the RPC view.

Free of torch: the models' features and batches are in `bmeg.models`.
"""

from bmeg.graphs.assemble import DroppedSpan, SpanForest, assemble
from bmeg.graphs.callgraph import (
    CallGraph,
    call_graph,
    call_graphs,
    node_services,
    operation_key_array,
    operation_keys,
    storage_service,
    store_callers,
)
from bmeg.graphs.critical_path import CriticalPaths, TracePath, critical_paths, trace_paths
from bmeg.graphs.features import DEFAULT_FEATURES, SERVICE_TIME_ONLY, base_columns

__all__ = [
    "DEFAULT_FEATURES",
    "SERVICE_TIME_ONLY",
    "CallGraph",
    "CriticalPaths",
    "DroppedSpan",
    "SpanForest",
    "TracePath",
    "assemble",
    "base_columns",
    "call_graph",
    "call_graphs",
    "critical_paths",
    "node_services",
    "operation_key_array",
    "operation_keys",
    "storage_service",
    "store_callers",
    "trace_paths",
]
