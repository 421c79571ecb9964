"""Stage 2: which nodes of an anomalous trace are the bottlenecks? A GCN node classifier.

Three GCN layers, a feed-forward layer, and a two-class output per node (not a bottleneck,
bottleneck). Inductive: each trace is a stand-alone graph. A bootstrapped run may hold several,
each trained on its own draw of the twin's faults (`GCNNodeEnsemble`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch_geometric.nn import GCNConv

from bmeg.models.adjacency import as_gcn_adjacency
from bmeg.models.features import NODE_INPUTS


class GCNNodeClassifier(nn.Module):
    r"""A node classifier inside one anomalous trace: bottleneck or not.

    Three GCN layers :math:`\mathbf{H}^{(l+1)} = \mathrm{ReLU}(\hat{\mathbf{A}} \mathbf{H}^{(l)}
    \mathbf{W}^{(l)})` from :math:`\mathbf{H}^{(0)} = \mathbf{X}`, then a two-layer feed-forward
    network over :math:`[\mathbf{H}^{(3)}, \mathbf{X}]`; with `inputs="asinh"`,
    :math:`\mathbf{X}` is :math:`\operatorname{asinh}` of the features.

    asinh keeps a real application's deviations from leaving the range the model was trained
    in: a twin's hogged service stretches its store calls to z 10, the testbed's to z 28, and a
    ReLU network extrapolates linearly, so the largest raw deviation wins whatever moved it. On
    the testbed it lifted the GNN alone's latency AC@1 0.732 -> 0.821 (12 paired bootstraps), on
    the twins' own simulated faults it lost 0.870 -> 0.805, so it is not the default (docs/issue-12.md,
    session 31).

    Args:
        in_channels (int): Width of a node's feature vector.
        hidden_channels (int): Width of the GCN layers and of the feed-forward layer.
        dropout (float): Dropout inside the feed-forward network.
        inputs (str): How the features are read, one of `NODE_INPUTS`: "raw" or "asinh".

    Shapes:
        - **input:** node features :math:`(|\mathcal{V}|, F_{in})`, edge indices
          :math:`(2, |\mathcal{E}|)` or their GCN adjacency
        - **output:** logits :math:`(|\mathcal{V}|, 2)`, one row per node
    """

    def __init__(self, in_channels: int, hidden_channels: int = 64, dropout: float = 0.2, inputs: str = "raw"):
        super().__init__()
        if inputs not in NODE_INPUTS:
            raise ValueError(f"inputs must be one of {NODE_INPUTS}, not {inputs!r}")
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
        self.inputs = inputs

    def reset_parameters(self) -> None:
        """Resets all learnable parameters of the module."""
        for layer in self.modules():
            if isinstance(layer, (GCNConv, nn.Linear)):
                layer.reset_parameters()

    def forward(self, x: Tensor, edges: Tensor) -> Tensor:
        """x [num_nodes, in_channels], edges: edge_index [2, num_edges] or its `gcn_adjacency`
        [num_nodes, num_nodes] -> logits [num_nodes, 2]."""
        adj_t = as_gcn_adjacency(edges, x.size(0))  # normalised once for all layers
        if self.inputs == "asinh":
            x = torch.asinh(x)
        h = x
        for conv in self.convs:
            h = torch.relu(conv(h, adj_t))
        return self.feed_forward(torch.cat([h, x], dim=-1))

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, hidden_channels={self.hidden_channels}, "
                f"dropout={self.dropout}, inputs={self.inputs!r})")


class GCNNodeEnsemble(nn.Module):
    r"""Node classifiers trained on separate draws of training faults, read as one: a node's
    P(bottleneck) is the mean of theirs (bagging). A twin simulates a few dozen faults a draw, and
    which services drew them moved one classifier's testbed ranking 0.60-0.98 between seeds.
    Measured with three draws (docs/issue-12.md, session 28): the spread between seeds narrowed
    a little, the mean did not rise, so `bmeg bootstrap` keeps one unless told (`--node-draws`).

    Shapes as `GCNNodeClassifier`; the output is the log of the members' mean probabilities,
    so that a softmax of it (as every caller takes) gives that mean.
    """

    def __init__(self, members: Sequence[GCNNodeClassifier]):
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one node classifier")
        self.members = nn.ModuleList(members)

    def forward(self, x: Tensor, edges: Tensor) -> Tensor:
        adj_t = as_gcn_adjacency(edges, x.size(0))
        # in float64: a member's logit gap above ~17 would round its P to 1.0 in float32
        probabilities = torch.stack([torch.softmax(member(x, adj_t).double(), dim=-1) for member in self.members])
        return probabilities.mean(dim=0).log()

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({len(self.members)} x {self.members[0]!r})"


#: The most node classifiers a saved run may hold: its hyperparameters are read before its
#: weights, and an untrusted run claiming millions would be built before it failed to load.
MAX_MEMBERS = 32


def node_classifier(in_channels: int, members: int = 1, **hparams) -> GCNNodeClassifier | GCNNodeEnsemble:
    """The node stage of a saved run's hyperparameters: one classifier, or an ensemble of `members`."""
    if not 1 <= members <= MAX_MEMBERS:
        raise ValueError(f"a node stage has 1 to {MAX_MEMBERS} classifiers, not {members}")
    if members == 1:
        return GCNNodeClassifier(in_channels, **hparams)
    return GCNNodeEnsemble([GCNNodeClassifier(in_channels, **hparams) for _ in range(members)])
