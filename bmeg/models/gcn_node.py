"""Stage 2: which nodes of an anomalous trace are the bottlenecks? A GCN node classifier.

Three GCN layers, a feed-forward layer, and a two-class output per node (not a bottleneck,
bottleneck). Inductive: each trace is a stand-alone graph.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch_geometric.nn import GCNConv

from bmeg.models.adjacency import as_gcn_adjacency


class GCNNodeClassifier(nn.Module):
    r"""A node classifier inside one anomalous trace: bottleneck or not.

    Three GCN layers :math:`\mathbf{H}^{(l+1)} = \mathrm{ReLU}(\hat{\mathbf{A}} \mathbf{H}^{(l)}
    \mathbf{W}^{(l)})` from :math:`\mathbf{H}^{(0)} = \mathbf{X}`, then a two-layer feed-forward
    network over :math:`[\mathbf{H}^{(3)}, \mathbf{X}]`.

    Args:
        in_channels (int): Width of a node's feature vector.
        hidden_channels (int): Width of the GCN layers and of the feed-forward layer.
        dropout (float): Dropout inside the feed-forward network.

    Shapes:
        - **input:** node features :math:`(|\mathcal{V}|, F_{in})`, edge indices
          :math:`(2, |\mathcal{E}|)` or their GCN adjacency
        - **output:** logits :math:`(|\mathcal{V}|, 2)`, one row per node
    """

    def __init__(self, in_channels: int, hidden_channels: int = 64, dropout: float = 0.2):
        super().__init__()
        self.convs = nn.ModuleList(
            [
                GCNConv(in_channels, hidden_channels, normalize=False),
                GCNConv(hidden_channels, hidden_channels, normalize=False),
                GCNConv(hidden_channels, hidden_channels, normalize=False),
            ]
        )
        # The node's own input features skip past the convolutions: a bottleneck is mostly a
        # node whose own latency is off, read in the context of its neighbours.
        self.feed_forward = nn.Sequential(
            nn.Linear(hidden_channels + in_channels, hidden_channels),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_channels, 2),
        )
        self.in_channels = in_channels
        self.hidden_channels = hidden_channels
        self.dropout = dropout

    def reset_parameters(self) -> None:
        """Resets all learnable parameters of the module."""
        for layer in self.modules():
            if isinstance(layer, (GCNConv, nn.Linear)):
                layer.reset_parameters()

    def forward(self, x: Tensor, edges: Tensor) -> Tensor:
        """x [num_nodes, in_channels], edges: edge_index [2, num_edges] or its `gcn_adjacency`
        [num_nodes, num_nodes] -> logits [num_nodes, 2]."""
        adj_t = as_gcn_adjacency(edges, x.size(0))  # normalised once for all layers
        h = x
        for conv in self.convs:
            h = torch.relu(conv(h, adj_t))
        return self.feed_forward(torch.cat([h, x], dim=-1))

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, hidden_channels={self.hidden_channels}, "
                f"dropout={self.dropout})")
