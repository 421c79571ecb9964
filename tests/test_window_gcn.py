"""The window GCN (issue 12, session 14): a learned ranker over a window's service graph."""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pytest
import torch

from bmeg.faultinject import Fault, parse_topology, simulate, spans_of
from bmeg.graphs.rpc import rpc_view
from bmeg.models.checkpoint import CheckpointError, refuse_pickles
from bmeg.models.normal import NormalStats
from bmeg.models.window_gcn import (FEATURES, WINDOW_GCN_FILE, WindowGCN, load_window_gcn, rank_window,
                                    save_window_gcn, service_features)
from bmeg.traces.schema import trace_starts
from bmeg.training.window_gcn import TrainingWindow, fit_window_gcn, listwise_loss, top1
from builders import chain_spec

SERVICES = ["front", "mid", "leaf"]


def _windows(count: int, seed: int) -> list[TrainingWindow]:
    """Chain windows, each with one service 6x slower from its middle on (no GNN shift)."""
    topology = parse_topology(chain_spec(rate=200))
    rng = np.random.default_rng(seed)
    windows = []
    for index in range(count):
        target = SERVICES[int(rng.integers(len(SERVICES)))]
        fault = Fault(target, "interference", "single", 1.5, 3.0, {"factor": 6.0})
        spans = spans_of(simulate(topology, [fault], 3.0, seed * 1000 + index))
        starts = trace_starts(spans)
        before = pc.less(starts["start_ns_min"], 1_500_000_000)
        normal = rpc_view(spans.filter(pc.is_in(spans["trace_id"], starts["trace_id"].filter(before))))
        window = rpc_view(spans.filter(pc.is_in(spans["trace_id"], starts["trace_id"].filter(pc.invert(before)))))
        graph = service_features(NormalStats.from_forest(normal), window, pd.Series(dtype=float))
        windows.append(TrainingWindow(graph, [graph.services.index(target)]))
    return windows


@pytest.fixture(scope="module")
def windows() -> list[TrainingWindow]:
    return _windows(16, 1)


def test_a_window_graph_holds_its_services_calls_and_features(windows):
    graph = windows[0].graph
    assert graph.x.shape == (len(graph.services), len(FEATURES))
    assert {"front", "mid", "leaf", "cache"} <= set(graph.services)
    calls = {(graph.services[a], graph.services[b]) for a, b in graph.edges.t().tolist()}
    assert {("front", "mid"), ("mid", "leaf"), ("mid", "cache")} <= calls
    assert ("mid", "front") not in calls  # caller -> callee only


def test_the_model_learns_to_put_the_slow_service_first(windows):
    train, held = windows[:12], windows[12:]
    untrained = WindowGCN()
    before = float(np.mean([listwise_loss(untrained(w.graph.x, w.graph.edges), w.targets).item() for w in train]))
    model = fit_window_gcn(train, epochs=30, seed=0)
    after = float(np.mean([listwise_loss(model(w.graph.x, w.graph.edges), w.targets).item() for w in train]))
    assert after < 0.5 * before
    assert top1(model, held) == 1.0


def test_saved_and_loaded_without_pickle_it_ranks_the_same(windows, tmp_path):
    model = fit_window_gcn(windows[:4], epochs=2, seed=0)
    path = tmp_path / WINDOW_GCN_FILE
    save_window_gcn(model, path, {"windows": 4})
    refuse_pickles(tmp_path)  # a run directory holding it is not refused as a pickle
    loaded = load_window_gcn(path)
    for window in windows[:4]:
        assert rank_window(loaded, window.graph) == rank_window(model, window.graph)
    state = torch.load(path, weights_only=True)
    torch.save({**state, "features": ["other"]}, path)
    with pytest.raises(ValueError, match="other features"):
        load_window_gcn(path)


@pytest.mark.parametrize("content", [b"", b"\x00garbage" * 100, pickle.dumps({"format": "x"}), b"PK\x03\x04truncated"])
def test_a_damaged_or_foreign_window_gcn_file_is_refused_with_its_path(content, tmp_path):
    path = tmp_path / WINDOW_GCN_FILE
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=str(path)):
        load_window_gcn(path)


def test_a_window_gcn_of_another_shape_is_refused(windows, tmp_path):
    path = tmp_path / WINDOW_GCN_FILE
    save_window_gcn(fit_window_gcn(windows[:2], epochs=1, seed=0), path)
    state = torch.load(path, weights_only=True)
    torch.save({**state, "config": {"unknown": 1}}, path)
    with pytest.raises(CheckpointError, match="not a bmeg window GCN"):
        load_window_gcn(path)
