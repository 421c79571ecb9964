"""Many call graphs as flat tensors, with fast mini-batches of any subset of traces.

PyG's `Batch.from_data_list` loops over graphs in Python; training draws thousands of random
mini-batches, so here a mini-batch is gathered from flat arrays with numpy index arithmetic.
Edges are made undirected (GCN layers then pass messages both up and down the call tree); a
mini-batch carries them as the GCN's normalised adjacency, built once for every model using it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from bmeg.graphs import SpanForest
from bmeg.graphs.callgraph import edge_index as call_edges
from bmeg.models.adjacency import gcn_adjacency


@dataclass(frozen=True)
class MiniBatch:
    x: Tensor  # [num_nodes, F]
    adj_t: Tensor  # sparse CSR [num_nodes, num_nodes]: `gcn_adjacency` of the batch's edges
    batch: Tensor  # [num_nodes]: graph of each node
    y: Tensor | None  # [num_graphs]
    node_y: Tensor | None  # [num_nodes]
    node_emphasis: Tensor | None = None  # float32 [num_nodes]: each node's weight in the node stage's loss

    def to(self, device: torch.device) -> MiniBatch:
        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=True)

        def maybe(t: Tensor | None) -> Tensor | None:
            return None if t is None else move(t)

        return MiniBatch(move(self.x), move(self.adj_t), move(self.batch), maybe(self.y), maybe(self.node_y),
                         maybe(self.node_emphasis))


@dataclass(frozen=True)
class GraphSet:
    x: np.ndarray  # float32 [N, F]
    edges: np.ndarray  # int64 [2, E], undirected, global rows, grouped by trace
    node_offsets: np.ndarray  # int64 [T + 1]
    edge_offsets: np.ndarray  # int64 [T + 1]
    y: np.ndarray | None = None  # int64 [T]
    node_y: np.ndarray | None = None  # int64 [N]
    node_emphasis: np.ndarray | None = None  # float32 [N] (`bmeg.training.trainer.callee_emphasis`)

    @classmethod
    def from_forest(cls, forest: SpanForest, x: np.ndarray, y=None, node_y=None) -> GraphSet:
        directed = call_edges(forest)
        both = np.concatenate([directed, directed[::-1]], axis=1)
        trace_of_edge = forest.trace_index[both[1]]
        order = np.argsort(trace_of_edge, kind="stable")
        edge_counts = np.bincount(trace_of_edge, minlength=forest.num_traces)
        return cls(
            x=np.ascontiguousarray(x, dtype=np.float32),
            edges=both[:, order],
            node_offsets=forest.trace_offsets,
            edge_offsets=np.r_[0, np.cumsum(edge_counts)].astype(np.int64),
            y=None if y is None else np.asarray(y, dtype=np.int64),
            node_y=None if node_y is None else np.asarray(node_y, dtype=np.int64),
        )

    @property
    def num_graphs(self) -> int:
        return len(self.node_offsets) - 1

    def node_rows(self, traces: np.ndarray) -> np.ndarray:
        """Rows of the nodes of `traces`, graph after graph."""
        return _gather(self.node_offsets, np.asarray(traces, dtype=np.int64))[0]

    def minibatch(self, traces: np.ndarray) -> MiniBatch:
        """The graphs `traces` (indices into this set), renumbered as one batch."""
        traces = np.asarray(traces, dtype=np.int64)
        node_rows, new_node_offsets = _gather(self.node_offsets, traces)
        edge_rows, _ = _gather(self.edge_offsets, traces)
        edge_counts = self.edge_offsets[traces + 1] - self.edge_offsets[traces]
        shift = np.repeat(new_node_offsets[:-1] - self.node_offsets[traces], edge_counts)
        graph_of_node = np.repeat(np.arange(len(traces)), np.diff(new_node_offsets))
        return MiniBatch(
            x=torch.from_numpy(self.x[node_rows]),
            adj_t=gcn_adjacency(torch.from_numpy(self.edges[:, edge_rows] + shift), len(node_rows)),
            batch=torch.from_numpy(graph_of_node),
            y=None if self.y is None else torch.from_numpy(self.y[traces]),
            node_y=None if self.node_y is None else torch.from_numpy(self.node_y[node_rows]),
            node_emphasis=None if self.node_emphasis is None else torch.from_numpy(self.node_emphasis[node_rows]),
        )

    def minibatches(
        self, traces: np.ndarray, batch_size: int, rng: np.random.Generator | None = None
    ) -> Iterator[MiniBatch]:
        """Mini-batches over `traces`, shuffled when `rng` is given."""
        order = rng.permutation(traces) if rng is not None else np.asarray(traces)
        for start in range(0, len(order), batch_size):
            yield self.minibatch(order[start : start + batch_size])


def _gather(offsets: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the chosen groups, concatenated, and the groups' new offsets."""
    counts = offsets[groups + 1] - offsets[groups]
    new_offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    rows = np.arange(new_offsets[-1]) + np.repeat(offsets[groups] - new_offsets[:-1], counts)
    return rows, new_offsets
