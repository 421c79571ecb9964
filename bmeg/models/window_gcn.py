"""A learned window ranker: a small GCN over a window's service graph (issue 12, session 14).

The window rankers of `bmeg.models.window` are rules over quantities measured against a normal
period. `WindowGCN` learns to rank from the same quantities: its nodes are the services of one
window, its edges the window's caller -> callee calls between services, and each service's input
(`service_features`) is what the window code already computes against the normal period, all
quantities that mean the same in every application (log2 time shifts, shares of spans, the
per-trace GNN's score shift): no service name, no application-specific scale. Its output is one
logit per service; a window's ranking is the services by logit (`rank_window`). It is trained
listwise (a softmax over the window's services, the faulty ones the targets) on windows
simulated from the application's twin, with no real label (`bmeg.training.window_gcn`).

A directed pair of convolutions reads a service's callers and its callees apart (a slow callee
lifts its callers' times, a starved caller stretches its callees' calls), and the inputs skip
past them to the output head, with a linear term of their own, so the network can at least
reproduce a rule such as the self-time shift.

Fits of the same windows with other seeds rank real windows differently (session 15: whole faults
apart on the testbed), so a saved model may be an ensemble (`WindowGCNEnsemble`, issue 12,
session 16): K members fitted apart, each member's logits standardised within the window, the
mean of those the score.

Saved as a dict of tensors and plain values (`WINDOW_GCN_FILE` in a run directory), loaded with
`weights_only=True`: never a pickle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn
from torch_geometric.nn import GCNConv

from bmeg.graphs import SpanForest, node_services
from bmeg.models.checkpoint import CheckpointError, load_tensor_dict
from bmeg.models.normal import NormalStats, Ranking

#: The file of a run directory that holds the window GCN.
WINDOW_GCN_FILE = "window_gcn.pt"
WINDOW_GCN_FORMAT = "bmeg-window-gcn"
#: Shifts (log2) are clipped to +- this: a service the normal period barely saw can move by 20.
CLIP = 8.0
#: Per service, in this order (`service_features`).
FEATURES = (
    "own", "caller", "callee", "has_own", "has_caller", "has_callee",  # service_shift_parts, log2
    "self_time",  # exclusive_increase: the self-time rule's score
    "calls", "errors", "calls_beyond_noise", "errors_beyond_noise",  # structure_parts against their noise
    "gnn_shift",  # the per-trace GNN's node_score_shift
    "visit_share", "span_share", "is_store",
    # the same shifts against the window's largest: scale-free, what ranks first in each rule
    "own_lead", "callee_lead", "self_time_lead", "gnn_lead",
    # service_shift_parts' start waits of the calls into a service (a spent CPU quota holds
    # requests before its server spans start; session 19), as the columns above read the others
    "wait", "has_wait", "wait_lead",
)


@dataclass(frozen=True)
class WindowGraph:
    """One window as the GCN reads it: services (node order), features [S, F], call edges [2, E]."""

    services: list[str]
    x: Tensor
    edges: Tensor


def service_features(normal: NormalStats, window: SpanForest, gnn_shift: pd.Series) -> WindowGraph:
    """The window's services, their `FEATURES` against `normal`, and their caller -> callee edges.
    `gnn_shift` is the per-trace GNN's `node_score_shift` of the window (stores split out)."""
    parts = normal.service_shift_parts(window)
    self_time = normal.exclusive_increase(window)
    structure = normal.structure_parts(window)
    nodes = node_services(window, storage_nodes=True).to_numpy(zero_copy_only=False)
    spans = pd.Series(nodes).value_counts()
    visits = pd.DataFrame({"service": nodes, "trace": window.trace_index}).drop_duplicates()["service"].value_counts()
    services = sorted(set(spans.index) | set(parts.index) | set(self_time.index) | set(gnn_shift.index))
    frame = pd.DataFrame(index=pd.Index(services, name="service"))
    for column in ("own", "caller", "callee", "wait"):
        values = parts[column].reindex(services) if column in parts else pd.Series(np.nan, index=services)
        frame[column] = values.fillna(0.0)
        frame[f"has_{column}"] = values.notna().astype(float)
    frame["self_time"] = self_time.reindex(services).fillna(0.0)
    calls = structure["calls"].reindex(services).fillna(0.0)
    errors = structure["errors"].reindex(services).fillna(0.0)
    frame["calls"], frame["errors"] = calls, errors
    noise = normal.structure_noise.reindex(services).fillna(0.0)
    error_noise = normal.error_noise.reindex(services).fillna(0.0)
    frame["calls_beyond_noise"] = calls + errors - noise
    frame["errors_beyond_noise"] = errors - error_noise
    frame["gnn_shift"] = gnn_shift.reindex(services).fillna(0.0)
    frame["visit_share"] = visits.reindex(services).fillna(0).to_numpy() / max(window.num_traces, 1)
    frame["span_share"] = spans.reindex(services).fillna(0).to_numpy() / max(window.num_spans, 1)
    own_spans = pd.Series(window.spans["service"].to_numpy(zero_copy_only=False)).unique()
    frame["is_store"] = (~frame.index.isin(own_spans)).astype(float)
    frame = frame.clip(-CLIP, CLIP)
    for column in ("own", "callee", "self_time", "gnn_shift", "wait"):
        frame[f"{column.removesuffix('_shift')}_lead"] = frame[column] - frame[column].max()
    x = torch.tensor(frame[list(FEATURES)].to_numpy(np.float32))
    return WindowGraph(services, x, _call_edges(window, nodes, {s: i for i, s in enumerate(services)}))


def _call_edges(window: SpanForest, nodes: np.ndarray, index: dict[str, int]) -> Tensor:
    """Distinct caller -> callee service pairs of the window (a span's parent's service -> its own,
    stores split out), as edge indices."""
    child = np.flatnonzero(window.parent >= 0)
    pairs = pd.DataFrame({"caller": nodes[window.parent[child]], "callee": nodes[child]}).drop_duplicates()
    pairs = pairs[pairs["caller"] != pairs["callee"]]
    edges = np.array([[index[c] for c in pairs["caller"]], [index[c] for c in pairs["callee"]]], dtype=np.int64)
    return torch.from_numpy(edges.reshape(2, -1))


class WindowGCN(nn.Module):
    """Per-service logits of one window's service graph (`WindowGraph`)."""

    def __init__(self, hidden_channels: int = 32, layers: int = 2, features: tuple[str, ...] | list[str] = FEATURES,
                 in_channels: int | None = None):
        super().__init__()
        unknown = [name for name in features if name not in FEATURES]
        if unknown or not features:
            raise ValueError(f"a window GCN reads some of {FEATURES}, not {list(features)}")
        if in_channels is not None and in_channels != len(features):  # session 14's files name only the count
            raise ValueError(f"{in_channels} input channels for {len(features)} features")
        in_channels = len(features)
        # the columns of `service_features`' x it reads (an ablation drops some); not a weight
        self.columns = [FEATURES.index(name) for name in features]
        self.embed = nn.Linear(in_channels, hidden_channels)
        # callees' messages to their callers and callers' to their callees, apart
        self.up = nn.ModuleList([GCNConv(hidden_channels, hidden_channels) for _ in range(layers)])
        self.down = nn.ModuleList([GCNConv(hidden_channels, hidden_channels) for _ in range(layers)])
        self.head = nn.Sequential(nn.Linear(hidden_channels + in_channels, hidden_channels), nn.ReLU(),
                                  nn.Linear(hidden_channels, 1))
        self.linear = nn.Linear(in_channels, 1)  # the inputs straight to the output: a rule at least
        self.config = {"hidden_channels": hidden_channels, "layers": layers, "features": list(features)}

    def forward(self, x: Tensor, edges: Tensor) -> Tensor:
        """x [S, len(FEATURES)] (`service_features`), edges [2, E] (caller -> callee) -> logits [S]."""
        x = x[:, self.columns]
        h = torch.relu(self.embed(x))
        reverse = edges.flip(0)
        for up, down in zip(self.up, self.down, strict=True):
            h = torch.relu(h + up(h, reverse) + down(h, edges))
        return (self.head(torch.cat([h, x], dim=-1)) + self.linear(x)).squeeze(-1)


class WindowGCNEnsemble(nn.Module):
    """Window GCNs fitted apart (other seeds) on the same windows. A service's score is the mean
    over members of its logit standardised within the window (minus the window's mean, over its
    spread), so no member counts more for having larger logits; one member ranks as itself."""

    def __init__(self, members: list[WindowGCN]):
        super().__init__()
        if not members or len({tuple(m.columns) for m in members}) != 1:
            raise ValueError("an ensemble holds one or more window GCNs of the same inputs")
        self.members = nn.ModuleList(members)
        self.config = dict(members[0].config)

    def forward(self, x: Tensor, edges: Tensor) -> Tensor:
        logits = torch.stack([member(x, edges) for member in self.members])
        centred = logits - logits.mean(dim=1, keepdim=True)
        return (centred / (centred.std(dim=1, unbiased=False, keepdim=True) + 1e-6)).mean(dim=0)


#: What `load_window_gcn` returns and every ranker reads: one window GCN or an ensemble of them.
WindowModel = WindowGCN | WindowGCNEnsemble


def rank_window(model: WindowModel, graph: WindowGraph) -> Ranking:
    """The window's services by the model's logit, most suspicious first."""
    model.eval()
    with torch.no_grad():
        logits = model(graph.x, graph.edges).numpy()
    order = np.argsort(-logits, kind="stable")
    return [(graph.services[i], float(logits[i])) for i in order]


def save_window_gcn(model: WindowModel, path: Path, metrics: dict | None = None) -> None:
    """One model's weights as `weights` (as sessions 14-15 saved them), an ensemble's as a list
    `members`, with the config they share."""
    weights = ({"members": [member.state_dict() for member in model.members]} if isinstance(model, WindowGCNEnsemble)
               else {"weights": model.state_dict()})
    state = {"format": WINDOW_GCN_FORMAT, "features": list(FEATURES), "config": dict(model.config),
             **weights, "metrics": metrics or {}}
    torch.save(state, path)


def load_window_gcn(path: Path) -> WindowModel:
    """The model saved at `path` (`save_window_gcn`); CheckpointError (a ValueError) for a damaged
    or foreign file, another format or another feature list."""
    state = load_tensor_dict(path, WINDOW_GCN_FORMAT, "a bmeg window GCN")
    if state.get("features") != list(FEATURES):
        raise CheckpointError(f"{path} was trained on other features ({state.get('features')}): retrain it")
    try:
        if "members" in state:
            return WindowGCNEnsemble([_member(state["config"], weights) for weights in state["members"]]).eval()
        return _member(state["config"], state["weights"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:  # a config or weights of another shape
        raise CheckpointError(f"{path} is not a bmeg window GCN ({type(error).__name__}: {error})") from error


def _member(config: dict, weights: dict) -> WindowGCN:
    model = WindowGCN(**config)
    model.load_state_dict(weights)
    return model.eval()
