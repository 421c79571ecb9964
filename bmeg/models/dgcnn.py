"""Stage 1: is this trace anomalous? A DGCNN graph classifier (Zhang et al., AAAI'18).

Four GCN layers whose outputs are concatenated; SortPooling keeps the k nodes ranked highest by
the last layer's channel; Conv1D -> MaxPool -> Conv1D read the sorted nodes as a sequence; one
dense layer and a two-class output (normal, anomalous).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch_geometric.nn import GCNConv
from torch_geometric.nn.aggr import SortAggregation

from bmeg.models.adjacency import as_gcn_adjacency


class DGCNN(nn.Module):
    r"""A graph classifier over whole traces: normal or anomalous.

    With :math:`\mathbf{Z}^{(0)} = \mathbf{X}` and :math:`\hat{\mathbf{A}}` the GCN-normalised
    adjacency with self loops, each GCN layer is
    :math:`\mathbf{Z}^{(l+1)} = \tanh(\hat{\mathbf{A}} \mathbf{Z}^{(l)} \mathbf{W}^{(l)})`; the
    concatenation :math:`[\mathbf{Z}^{(1)}, \dots, \mathbf{Z}^{(4)}]` is sorted by the one channel
    of :math:`\mathbf{Z}^{(4)}` and cut or padded to :math:`k` nodes.

    Args:
        in_channels (int): Width of a node's feature vector.
        hidden_channels (int): Width of the first three GCN layers.
        k (int): Nodes kept by SortPooling per graph; at least 10, for the Conv1D stack.
        dense_channels (int): Width of the dense layer before the output.
        dropout (float): Dropout before the output layer.

    Shapes:
        - **input:** node features :math:`(|\mathcal{V}|, F_{in})`, edge indices
          :math:`(2, |\mathcal{E}|)` or their GCN adjacency, batch vector :math:`(|\mathcal{V}|)`
        - **output:** logits :math:`(B, 2)`, one row per graph
    """

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int = 32,
        k: int = 30,
        dense_channels: int = 128,
        dropout: float = 0.3,
    ):
        super().__init__()
        # The last GCN layer has one channel: the sort key of SortPooling.
        widths = [hidden_channels, hidden_channels, hidden_channels, 1]
        self.convs = nn.ModuleList()
        for width_in, width_out in zip([in_channels, *widths[:-1]], widths):
            self.convs.append(GCNConv(width_in, width_out, normalize=False))
        total = sum(widths)
        self.sort_pool = SortAggregation(k)
        # The first Conv1D has kernel = stride = one node's width: it is a per-node linear map,
        # written as one (CPU backends are slow at the backward of such a Conv1D).
        self.conv1 = nn.Linear(total, 16)
        self.pool = nn.MaxPool1d(2, 2)
        self.conv2 = nn.Conv1d(16, 32, kernel_size=5, stride=1)
        conv2_len = (k // 2) - 5 + 1
        if conv2_len < 1:
            raise ValueError(f"k={k} is too small for the Conv1D stack: use k >= 10")
        self.dense = nn.Linear(32 * conv2_len, dense_channels)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(dense_channels, 2)
        self.in_channels = in_channels
        self.hidden_channels = hidden_channels
        self.k = k
        self.dense_channels = dense_channels

    def reset_parameters(self) -> None:
        """Resets all learnable parameters of the module."""
        for layer in self.modules():
            if isinstance(layer, (GCNConv, nn.Linear, nn.Conv1d)):
                layer.reset_parameters()

    def forward(self, x: Tensor, edges: Tensor, batch: Tensor) -> Tensor:
        """x [num_nodes, in_channels], edges: edge_index [2, num_edges] or its `gcn_adjacency`
        [num_nodes, num_nodes] -> logits [num_graphs, 2]."""
        adj_t = as_gcn_adjacency(edges, x.size(0))  # normalised once for all layers
        layers = []
        h = x
        for conv in self.convs:
            h = torch.tanh(conv(h, adj_t))
            layers.append(h)
        h = torch.cat(layers, dim=-1)  # [num_nodes, total]
        h = self.sort_pool(h, batch)  # [num_graphs, k * total]
        h = h.view(h.size(0), self.k, -1)  # [num_graphs, k, total]
        h = torch.relu(self.conv1(h)).transpose(1, 2)  # [num_graphs, 16, k]
        h = self.pool(h)  # [num_graphs, 16, k // 2]
        h = torch.relu(self.conv2(h))  # [num_graphs, 32, k // 2 - 4]
        h = self.dropout(torch.relu(self.dense(h.flatten(1))))
        return self.out(h)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, hidden_channels={self.hidden_channels}, "
                f"k={self.k}, dense_channels={self.dense_channels}, dropout={self.dropout.p})")
