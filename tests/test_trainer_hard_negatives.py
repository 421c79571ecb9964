"""The node stage's emphasis on the negatives next to a bottleneck (`FitConfig.hard_negatives`)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.models.adjacency import gcn_adjacency
from bmeg.training.config import FitConfig
from bmeg.training.trainer import _hard_negative_emphasis, _loss_function

LOSS_KINDS = ("weighted", "plain", "focal")


@st.composite
def labelled_forests(draw):
    """Parent arrays of a few call trees side by side (-1 at roots), with node labels."""
    parents: list[int] = []
    for _ in range(draw(st.integers(1, 4))):
        start = len(parents)
        size = draw(st.integers(1, 12))
        parents.append(-1)
        for node in range(1, size):
            parents.append(start + draw(st.integers(0, node - 1)))
    labels = draw(st.lists(st.integers(0, 1), min_size=len(parents), max_size=len(parents)))
    return np.array(parents), np.array(labels)


def _edge_index(parents: np.ndarray) -> torch.Tensor:
    child = np.flatnonzero(parents >= 0)
    directed = np.stack([parents[child], child])
    return torch.from_numpy(np.concatenate([directed, directed[::-1]], axis=1).astype(np.int64))


@settings(max_examples=60, deadline=None)
@given(labelled_forests(), st.sampled_from([2.0, 4.0]))
def test_emphasis_falls_on_the_callers_and_callees_of_bottlenecks(forest, weight):
    parents, labels = forest
    adj_t = gcn_adjacency(_edge_index(parents), len(parents))
    emphasis = _hard_negative_emphasis(adj_t, torch.from_numpy(labels), weight)
    # the reference, from the parent array: a negative whose parent or some child is a bottleneck
    beside = np.zeros(len(parents), dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            beside[node] |= labels[parent] == 1
            beside[parent] |= labels[node] == 1
    expected = np.where(beside & (labels == 0), weight, 1.0)
    assert emphasis is not None
    np.testing.assert_array_equal(emphasis.numpy(), expected)


def test_no_emphasis_at_weight_one():
    adj_t = gcn_adjacency(_edge_index(np.array([-1, 0, 0])), 3)
    assert _hard_negative_emphasis(adj_t, torch.tensor([0, 1, 0]), 1.0) is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 1), min_size=2, max_size=20), st.lists(st.integers(1, 4), min_size=20, max_size=20),
       st.sampled_from(LOSS_KINDS), st.integers(0, 2**16))
def test_an_emphasis_of_k_counts_a_node_k_times(labels, repeats, kind, seed):
    """A node weighted k counts as the same node repeated k times; an emphasis of ones changes nothing."""
    y = torch.tensor(labels)
    logits = torch.randn(len(labels), 2, generator=torch.Generator().manual_seed(seed))
    emphasis = torch.tensor(repeats[: len(labels)], dtype=torch.float32)
    loss = _loss_function(kind, np.asarray(labels), "cpu")
    repeated = torch.repeat_interleave(torch.arange(len(labels)), emphasis.long())
    torch.testing.assert_close(loss(logits, y, emphasis), loss(logits[repeated], y[repeated]))
    torch.testing.assert_close(loss(logits, y, torch.ones(len(labels))), loss(logits, y))


def test_fit_config_refuses_an_emphasis_below_one():
    with pytest.raises(ValueError, match="hard_negatives"):
        FitConfig(hard_negatives=0.5)
