"""Many traces -> one PyTorch Geometric `Batch` of call graphs, built without per-graph loops.

A forest already holds all spans in flat arrays grouped by trace, which is exactly the layout
of a PyG `Batch`: node features stack as they are, edges are global rows, `ptr` is the forest's
trace offsets. So the batch is filled directly, with the slicing bookkeeping that
`Batch.from_data_list` would have made, and `batch.to_data_list()` / `batch[i]` give the
per-trace `Data` objects (x, edge_index, service, trace_id, and y / node_y when given).

Service names map to indices through a `ServiceVocabulary`; index 0 stands for services the
vocabulary does not know (a documented repair for unseen services, not an error).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch_geometric.data import Batch, Data

from bmeg.graphs.assemble import SpanForest, assemble
from bmeg.graphs.callgraph import edge_index, node_services
from bmeg.graphs.critical_path import CriticalPaths
from bmeg.graphs.features import DEFAULT_FEATURES, FeatureSpec, node_features

UNKNOWN_SERVICE = "<unknown>"


@dataclass(frozen=True)
class ServiceVocabulary:
    """Service name <-> index; index 0 is `UNKNOWN_SERVICE`."""

    names: tuple[str, ...]

    @classmethod
    def build(cls, services: Iterable[str]) -> ServiceVocabulary:
        return cls((UNKNOWN_SERVICE, *sorted(set(services) - {UNKNOWN_SERVICE})))

    def __len__(self) -> int:
        return len(self.names)

    def indices(self, services: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Index of each service name, 0 for names not in the vocabulary."""
        where = pc.index_in(services, value_set=pa.array(self.names, pa.string()))
        return pc.fill_null(where, 0).to_numpy(zero_copy_only=False).astype(np.int64)


def to_batch(
    forest: SpanForest,
    *,
    spec: FeatureSpec = DEFAULT_FEATURES,
    vocabulary: ServiceVocabulary | None = None,
    storage_nodes: bool = False,
    store_owners: Mapping[str, str] | None = None,
    y: Sequence[int] | np.ndarray | None = None,
    node_y: Sequence[int] | np.ndarray | None = None,
    paths: CriticalPaths | None = None,
) -> Batch:
    """All traces of the forest as one `Batch`, one graph per trace in `forest.trace_ids` order.

    `vocabulary` defaults to the forest's own services (then indices only mean something
    within this batch; pass the model's vocabulary for anything else). `y` holds one graph
    label per trace, `node_y` one node label per span (forest row order).
    """
    services = node_services(forest, storage_nodes=storage_nodes, store_owners=store_owners)
    if vocabulary is None:
        vocabulary = ServiceVocabulary.build(pc.unique(services).to_pylist())
    num_traces = forest.num_traces
    ptr = torch.from_numpy(forest.trace_offsets)
    edges = edge_index(forest)
    edges_per_trace = np.bincount(forest.trace_index[edges[1]], minlength=num_traces)
    graph_slices = torch.arange(num_traces + 1)
    no_increment = torch.zeros(num_traces, dtype=torch.long)

    batch = Batch(_base_cls=Data)
    batch.x = torch.from_numpy(node_features(forest, spec, paths))
    batch.edge_index = torch.from_numpy(edges)
    batch.service = torch.from_numpy(vocabulary.indices(services))
    batch.trace_id = list(forest.trace_ids)
    slices = {"x": ptr, "edge_index": _cumsum(edges_per_trace), "service": ptr, "trace_id": graph_slices}
    increments = {"x": no_increment, "edge_index": ptr[:-1], "service": no_increment, "trace_id": None}
    if y is not None:
        batch.y = torch.as_tensor(_check_length(y, num_traces, "y (one label per trace)"), dtype=torch.long)
        slices["y"], increments["y"] = graph_slices, no_increment
    if node_y is not None:
        node_labels = _check_length(node_y, forest.num_spans, "node_y (one label per span)")
        batch.node_y = torch.as_tensor(node_labels, dtype=torch.long)
        slices["node_y"], increments["node_y"] = ptr, no_increment
    batch.batch = torch.from_numpy(forest.trace_index)
    batch.ptr = ptr
    batch._num_graphs = num_traces
    batch._slice_dict = slices
    batch._inc_dict = increments
    return batch


def spans_to_batch(table: pa.Table, **options) -> tuple[Batch, SpanForest]:
    """Span table -> (Batch, the assembled forest with its repair warnings)."""
    forest = assemble(table)
    return to_batch(forest, **options), forest


def to_data_list(forest: SpanForest, **options) -> list[Data]:
    """One `Data` per trace (options as for `to_batch`)."""
    return to_batch(forest, **options).to_data_list()


def _cumsum(counts: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.r_[0, np.cumsum(counts)].astype(np.int64))


def _check_length(values, expected: int, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.shape != (expected,):
        raise ValueError(f"{what}: expected shape ({expected},), got {array.shape}")
    return array
