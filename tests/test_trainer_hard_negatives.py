"""The node stage's emphasis on the client spans of a bottleneck (`FitConfig.hard_negatives`)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.models.graphset import GraphSet
from bmeg.training.config import FitConfig
from bmeg.training.trainer import _loss_function, callee_emphasis

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


@settings(max_examples=60, deadline=None)
@given(labelled_forests(), st.sampled_from([2.0, 4.0]))
def test_emphasis_falls_on_the_children_of_bottlenecks(forest, weight):
    parents, labels = forest
    emphasis = callee_emphasis(parents, labels, weight)
    assert emphasis is not None
    for node, parent in enumerate(parents):
        under_bottleneck = parent >= 0 and labels[parent] == 1 and labels[node] == 0
        assert emphasis[node] == (weight if under_bottleneck else 1.0)


def test_no_emphasis_at_weight_one():
    assert callee_emphasis(np.array([-1, 0, 0]), np.array([1, 0, 0]), 1.0) is None


def test_a_minibatch_carries_its_nodes_emphasis():
    graphs = GraphSet(x=np.zeros((5, 1), np.float32), edges=np.array([[0, 1, 3], [1, 0, 4]]),
                      node_offsets=np.array([0, 2, 5]), edge_offsets=np.array([0, 2, 3]),
                      node_y=np.array([1, 0, 0, 1, 0]), node_emphasis=np.arange(5, dtype=np.float32))
    batch = graphs.minibatch(np.array([1, 0]))
    np.testing.assert_array_equal(batch.node_emphasis.numpy(), [2, 3, 4, 0, 1])


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
