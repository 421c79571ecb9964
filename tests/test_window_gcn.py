"""The window GCN (issue 12, session 14): a learned ranker over a window's service graph."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.faultinject import Fault, parse_topology, simulate, spans_of
from bmeg.graphs.rpc import rpc_view
from bmeg.models.checkpoint import CheckpointError, refuse_pickles
from bmeg.models.normal import NormalStats
from bmeg.models.window_gcn import (FEATURES, WINDOW_GCN_FILE, WindowGCN, WindowGCNEnsemble, load_window_gcn,
                                    rank_window, save_window_gcn, service_features)
from bmeg.traces.schema import trace_starts
from bmeg.training import window_gcn as training
from bmeg.training.window_gcn import (MEMBER_SEED_STEP, FitSettings, TrainingWindow, WindowShape, _with_changed_traces,
                                      fit_ensemble, fit_window_gcn, listwise_loss, load_windows, save_windows,
                                      simulated_windows, top1)
from builders import bench_module, chain_spec, tiny_detector

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
    model = fit_window_gcn(train, seed=0, settings=FitSettings(epochs=30))
    after = float(np.mean([listwise_loss(model(w.graph.x, w.graph.edges), w.targets).item() for w in train]))
    assert after < 0.5 * before
    assert top1(model, held) == 1.0


def test_saved_and_loaded_without_pickle_it_ranks_the_same(windows, tmp_path):
    model = fit_window_gcn(windows[:4], seed=0, settings=FitSettings(epochs=2))
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
    save_window_gcn(fit_window_gcn(windows[:2], seed=0, settings=FitSettings(epochs=1)), path)
    state = torch.load(path, weights_only=True)
    torch.save({**state, "config": {"unknown": 1}}, path)
    with pytest.raises(CheckpointError, match="not a bmeg window GCN"):
        load_window_gcn(path)


def test_a_model_without_some_inputs_ignores_them_and_keeps_them_out_when_loaded(windows, tmp_path):
    kept = tuple(f for f in FEATURES if f not in ("gnn_shift", "gnn_lead"))
    model = fit_window_gcn(windows[:4], seed=0, settings=FitSettings(epochs=2, features=kept))
    graph = windows[0].graph
    noisy = graph.x.clone()
    noisy[:, [FEATURES.index("gnn_shift"), FEATURES.index("gnn_lead")]] = torch.randn(len(graph.services), 2) * 5
    assert torch.equal(model(graph.x, graph.edges), model(noisy, graph.edges))
    save_window_gcn(model, tmp_path / WINDOW_GCN_FILE)
    loaded = load_window_gcn(tmp_path / WINDOW_GCN_FILE)
    assert loaded.config["features"] == list(kept)
    assert torch.equal(loaded(noisy, graph.edges), model(noisy, graph.edges))
    with pytest.raises(ValueError, match="reads some of"):
        WindowGCN(features=("own", "unknown"))


def test_a_session_14_file_naming_only_its_input_count_still_loads(windows, tmp_path):
    model = fit_window_gcn(windows[:2], seed=0, settings=FitSettings(epochs=1, features=FEATURES))
    path = tmp_path / WINDOW_GCN_FILE
    save_window_gcn(model, path)
    state = torch.load(path, weights_only=True)
    torch.save({**state, "config": {"in_channels": len(FEATURES), "hidden_channels": 32, "layers": 2}}, path)
    graph = windows[0].graph
    assert torch.equal(load_window_gcn(path)(graph.x, graph.edges), model(graph.x, graph.edges))
    torch.save({**state, "config": {"in_channels": 3, "hidden_channels": 32, "layers": 2}}, path)
    with pytest.raises(CheckpointError, match="not a bmeg window GCN"):
        load_window_gcn(path)


def test_saved_training_windows_read_back_the_same_and_a_foreign_file_is_refused(windows, tmp_path):
    held = [replace(w, code_alone=bool(i % 2)) for i, w in enumerate(windows[:3])]
    save_windows(held, tmp_path / "windows.pt")
    back = load_windows(tmp_path / "windows.pt")
    assert [(w.graph.services, w.targets, w.code_alone) for w in back] == [(w.graph.services, w.targets, w.code_alone) for w in held]
    assert all(torch.equal(a.graph.x, b.graph.x) and torch.equal(a.graph.edges, b.graph.edges) for a, b in zip(back, held))
    save_window_gcn(fit_window_gcn(windows[:1], seed=0, settings=FitSettings(epochs=1)), tmp_path / WINDOW_GCN_FILE)
    with pytest.raises(CheckpointError, match="training windows"):
        load_windows(tmp_path / WINDOW_GCN_FILE)


@settings(max_examples=30, deadline=None)
@given(drawn=st.integers(1, 6).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1))))
def test_a_code_faults_changed_traces_replace_theirs_and_the_others_stay(drawn):
    traces, changed = drawn  # a code fault changes at least one trace (`_simulated_window` skips it otherwise)
    ids = [f"t{i}" for i in range(traces)]
    spans = pa.table({"trace_id": [t for t in ids for _ in range(2)], "duration_ns": list(range(2 * traces)),
                      "status": ["ok"] * 2 * traces})
    hit = [ids[i] for i in sorted(changed)]
    new = pa.table({"status": ["error"] * len(hit), "duration_ns": [-1] * len(hit), "trace_id": hit})
    merged = _with_changed_traces(spans, new).to_pylist()
    assert sorted({row["trace_id"] for row in merged}) == ids  # no trace lost, as in a real window
    assert sorted(r["trace_id"] for r in merged if r["status"] == "error") == sorted(hit)  # one span each, replaced
    assert len(merged) == 2 * traces - len(hit)


def test_code_alone_windows_hold_one_code_fault_its_service_the_target_and_every_trace():
    topology = parse_topology(chain_spec(rate=200))
    held = simulated_windows(topology, tiny_detector(), 1, seed=3, code_alone=1.0)
    assert held and all(w.code_alone and len(w.targets) == 1 for w in held)
    assert all({"front", "mid", "leaf"} <= set(w.graph.services) for w in held)  # the window kept every service


def _scaled(model: WindowGCN, factor: float) -> WindowGCN:
    """`model` with its logits `factor` times larger (its two output layers scaled)."""
    scaled = WindowGCN()
    scaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in (scaled.head[-1], scaled.linear):
            layer.weight.mul_(factor)
            layer.bias.mul_(factor)
    return scaled.eval()


def test_an_ensemble_ranks_by_its_members_logits_standardised_within_the_window(windows):
    first, second = fit_window_gcn(windows[:4], seed=0, settings=FitSettings(epochs=2, features=FEATURES)), _random_gcn(5)
    graph = windows[0].graph
    alone = rank_window(first, graph)
    assert [s for s, _ in rank_window(WindowGCNEnsemble([first]), graph)] == [s for s, _ in alone]
    # a member with 100x larger logits counts no more than its copy: the pair ranks as the member
    assert [s for s, _ in rank_window(WindowGCNEnsemble([first, _scaled(first, 100.0)]), graph)] == [s for s, _ in alone]
    mean = WindowGCNEnsemble([first, second])(graph.x, graph.edges)
    both = torch.stack([first(graph.x, graph.edges), second(graph.x, graph.edges)])
    standardised = (both - both.mean(1, keepdim=True)) / both.std(1, unbiased=False, keepdim=True)
    assert torch.allclose(mean, standardised.mean(0), atol=1e-4)
    with pytest.raises(ValueError, match="same inputs"):
        WindowGCNEnsemble([first, WindowGCN(features=("own", "self_time"))])


def _random_gcn(seed: int) -> WindowGCN:
    torch.manual_seed(seed)
    return WindowGCN().eval()


def test_an_ensemble_is_fitted_member_by_member_and_saved_and_loaded_without_pickle(windows, tmp_path):
    settings = FitSettings(epochs=2, members=3)
    ensemble = fit_ensemble(windows[:4], seed=7, settings=settings)
    assert isinstance(ensemble, WindowGCNEnsemble) and len(ensemble.members) == 3
    graph = windows[0].graph
    for index, member in enumerate(ensemble.members):  # member i: the model fitted with seed 7 + i * step
        alone = fit_window_gcn(windows[:4], seed=7 + MEMBER_SEED_STEP * index, settings=FitSettings(epochs=2))
        assert torch.equal(member(graph.x, graph.edges), alone(graph.x, graph.edges))
    one = fit_ensemble(windows[:4], seed=7, settings=FitSettings(epochs=2))
    assert isinstance(one, WindowGCN)
    assert torch.equal(one(graph.x, graph.edges), ensemble.members[0](graph.x, graph.edges))
    path = tmp_path / WINDOW_GCN_FILE
    save_window_gcn(ensemble, path)
    refuse_pickles(tmp_path)
    loaded = load_window_gcn(path)
    assert isinstance(loaded, WindowGCNEnsemble)
    assert torch.equal(loaded(graph.x, graph.edges), ensemble(graph.x, graph.edges))
    state = torch.load(path, weights_only=True)
    torch.save({**state, "members": [{"unknown": torch.zeros(1)}]}, path)
    with pytest.raises(CheckpointError, match="not a bmeg window GCN"):
        load_window_gcn(path)


def test_simulated_windows_hold_the_traces_their_shape_says(monkeypatch):
    held: list[tuple[int, int]] = []
    real = training.training_window

    def counting(detector, normal_spans, window_spans, faulty):  # the real one, its trace counts kept
        held.append((pc.count_distinct(normal_spans["trace_id"]).as_py(), pc.count_distinct(window_spans["trace_id"]).as_py()))
        return real(detector, normal_spans, window_spans, faulty)

    monkeypatch.setattr(training, "training_window", counting)
    shape = WindowShape(normal_traces=(100, 100), window_traces=(150, 200))
    simulated_windows(parse_topology(chain_spec(rate=200)), tiny_detector(), 3, seed=2, code_alone=0.0, shape=shape)
    assert len(held) == 3
    # traces begun in a span of time: the rate's count, give or take the arrivals' noise
    assert all(70 <= normal <= 130 and 110 <= window <= 250 for normal, window in held)


@pytest.mark.parametrize("held_out", [0.0, 0.25])
def test_a_run_is_trained_by_one_fit_on_every_window_and_a_second_only_for_the_held_out_check(
        windows, tmp_path, monkeypatch, held_out):
    fits = []

    def counted(train, *args, **kwargs):
        fits.append(len(train))
        return fit_window_gcn(train, *args, **kwargs)

    monkeypatch.setattr(training, "fit_window_gcn", counted)
    settings = FitSettings(epochs=2)
    model, metrics = training.train_window_gcn(tmp_path, windows[:8], seed=3, settings=settings, held_out=held_out)
    assert fits == ([8] if held_out == 0 else [8, 6])  # the saved model first, on all 8; the check's on 6
    graph = windows[0].graph
    alone = fit_window_gcn(windows[:8], seed=3, settings=settings)
    assert torch.equal(load_window_gcn(tmp_path / WINDOW_GCN_FILE)(graph.x, graph.edges), alone(graph.x, graph.edges))
    assert metrics["train_top1"] == top1(alone, windows[:8])
    if held_out:
        checked = fit_window_gcn(windows[2:8], seed=3, settings=settings)
        assert metrics["held_out"] == 2 and metrics["held_out_top1"] == top1(checked, windows[:2])
    else:
        assert "held_out_top1" not in metrics


def test_the_bench_trains_with_the_library_defaults():
    """One source of truth: `bench/window_gcn.py`'s defaults are `FitSettings()`'s and the
    library's window counts."""
    bench = bench_module("window_gcn")
    args = bench.argument_parser().parse_args(["RUN"])
    fit = FitSettings()
    assert bench.fit_settings(args) == fit
    assert (args.windows, args.code_alone, args.kernel_form) == (
        training.TRAINING_WINDOWS, training.CODE_ALONE_WINDOWS, training.KERNEL_FORM_FAULTS)


@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=50, deadline=None)
def test_cpu_faults_take_the_kernels_form_when_asked_and_no_draw_of_it_otherwise(seed):
    """kernel_form 1: a saturation is a CFS quota (no smaller core), an interference a hog's
    slices; 0: the faults and the random stream after them are those before session 19."""
    def drawn(kernel_form: float) -> tuple[Fault, float]:
        rng = np.random.default_rng(seed)
        return training._latency_fault("mid", rng, 1.0, 2.0, kernel_form), rng.random()

    kernel, _ = drawn(1.0)
    plain, after = drawn(0.0)
    if kernel.source == "saturation":
        low, high = training.SCHEDULER_PARAMETERS["saturation"]["quota"]
        assert "capacity" not in kernel.parameters and low <= kernel.parameters["quota"] <= high
    elif kernel.source == "interference":
        assert kernel.parameters["slice_ms"] == 3.0 and 2.0 <= kernel.parameters["factor"] <= 6.0
    else:
        assert kernel == plain
    rng = np.random.default_rng(seed)  # before session 19: a source, then its parameters
    source = str(rng.choice(training.SOURCES))
    assert plain.source == source and "quota" not in plain.parameters and "slice_ms" not in plain.parameters
    assert set(plain.parameters) <= set(training.SOURCE_PARAMETERS[source])
    [rng.uniform() for _ in training.SOURCE_PARAMETERS[source]]
    assert after == rng.random()


def test_the_start_waits_of_calls_into_a_throttled_service_are_its_inputs():
    """A CFS quota on `leaf` holds mid's calls before leaf's server spans start: leaf's `wait`
    input grows; `front`, which nobody calls, has none."""
    topology = parse_topology(chain_spec(rate=200))
    fault = Fault("leaf", "saturation", "single", 1.5, 3.0, {"quota": 0.3})
    spans = spans_of(simulate(topology, [fault], 3.0, 7))
    starts = trace_starts(spans)
    before = pc.less(starts["start_ns_min"], 1_500_000_000)
    normal = rpc_view(spans.filter(pc.is_in(spans["trace_id"], starts["trace_id"].filter(before))))
    window = rpc_view(spans.filter(pc.is_in(spans["trace_id"], starts["trace_id"].filter(pc.invert(before)))))
    graph = service_features(NormalStats.from_forest(normal), window, pd.Series(dtype=float))
    x = pd.DataFrame(graph.x.numpy(), index=graph.services, columns=FEATURES)
    assert x.loc["leaf", "wait"] > 3 and x.loc["leaf", "has_wait"] == 1  # log2: more than 8x normal
    assert x.loc["front", "wait"] == 0 and x.loc["front", "has_wait"] == 0
    assert x["wait_lead"].max() == 0 and x.loc["leaf", "wait_lead"] == x.loc["leaf", "wait"] - x["wait"].max()
