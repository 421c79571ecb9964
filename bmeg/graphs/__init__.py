"""Traces -> call graphs: assembly and repair, critical paths, node features, PyG batches.

`bmeg.graphs.batch` (PyG batches) is not imported here, so using the rest stays free of torch.
"""

from bmeg.graphs.assemble import DroppedSpan, SpanForest, assemble
from bmeg.graphs.callgraph import CallGraph, call_graph, call_graphs, node_services, storage_service
from bmeg.graphs.critical_path import CriticalPaths, TracePath, critical_paths, trace_paths
from bmeg.graphs.features import (
    DEFAULT_FEATURES,
    SERVICE_TIME_ONLY,
    FeatureSpec,
    base_columns,
    node_features,
    operation_baseline_ratio,
)

__all__ = [
    "DEFAULT_FEATURES",
    "SERVICE_TIME_ONLY",
    "CallGraph",
    "CriticalPaths",
    "DroppedSpan",
    "FeatureSpec",
    "SpanForest",
    "TracePath",
    "assemble",
    "base_columns",
    "call_graph",
    "call_graphs",
    "critical_paths",
    "node_features",
    "node_services",
    "operation_baseline_ratio",
    "storage_service",
    "trace_paths",
]
