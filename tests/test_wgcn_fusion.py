"""bmeg's rank fusion with the window GCN in place of the per-trace GNN (issue 12, sessions 15 and 20)."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bmeg.evaluation.rankers import WindowGcnRanker, _DetectorScores, default_rankers
from bmeg.graphs.rpc import rpc_view
from bmeg.models.checkpoint import CheckpointError
from bmeg.models.normal import NormalStats
from bmeg.models.window import (WindowRanker, combined_ranking, culprit_vote_shift, gnn_window_scores,
                                learned_scores,
                                node_score_shift, rank_fusion, standardised_fusion, window_gcn_of, window_gcn_scores,
                                window_stages, with_normal_baselines)
from bmeg.models.window_gcn import FEATURES, WINDOW_GCN_FILE, WindowGCN, rank_window, save_window_gcn, service_features
from bmeg.traces import span_table
from builders import many_traces, star_trace, tiny_detector

LEAVES = ["svc0", "svc1", "svc2"]


def _window(slow: int, factor: float, extra_call: bool = False):
    """30 star traces, leaf `slow` `factor` times its usual time; `extra_call`: the root also
    calls a fourth leaf (its calls changed: a code fault's structure shift)."""
    merged: dict[str, list] = {}
    for t in range(30):
        leaf = [100 + t % 7, 200 + t % 5, 50] + ([80] if extra_call else [])
        leaf[slow] = int(leaf[slow] * factor)
        for key, values in star_trace(f"w{t:04d}", leaf).items():
            merged.setdefault(key, []).extend(values)
    return rpc_view(span_table(merged))


@pytest.fixture(scope="module")
def scored():
    """The tiny detector's normal period and windows (each leaf slowed), scored once."""
    normal = rpc_view(span_table(many_traces(60)))
    detector = with_normal_baselines(tiny_detector(), normal)
    stats = NormalStats.from_forest(normal)
    windows = [_window(slow, 8.0) for slow in range(3)] + [_window(0, 8.0, extra_call=True)]
    return stats, gnn_window_scores(detector, normal), [(w, gnn_window_scores(detector, w)) for w in windows]


def _reading(feature: str) -> WindowGCN:
    """A window GCN whose logit is one of its input features, nothing else."""
    model = WindowGCN()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.linear.weight[0, FEATURES.index(feature)] = 1.0
    return model.eval()


def _random(seed: int) -> WindowGCN:
    torch.manual_seed(seed)
    return WindowGCN().eval()


def test_a_window_gcn_reading_only_the_gnn_shift_ranks_as_bmeg_without_one_by_the_same_fusion(scored):
    """The window GCN's path reads the GNN's shift as the GNN's path does: fused by ranks, as bmeg
    fuses the GNN's shift, the two rank alike (bmeg fuses a window GCN by standardised scores)."""
    stats, normal_scores, windows = scored
    for window, scores in windows:
        before = [service for service, _ in combined_ranking(stats, window, scores, normal_scores)]
        after = [service for service, _ in combined_ranking(stats, window, scores, normal_scores, _reading("gnn_shift"),
                                                            rank_fusion)]
        assert after == before


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(window=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_any_window_gcn_keeps_the_services_the_gates_and_the_agreed_first(scored, window, seed):
    stats, normal_scores, windows = scored
    forest, scores = windows[window]
    model = _random(seed)
    fused = [service for service, _ in combined_ranking(stats, forest, scores, normal_scores, model)]
    plain = [service for service, _ in combined_ranking(stats, forest, scores, normal_scores)]
    assert sorted(fused) == sorted(plain) and len(set(fused)) == len(fused)
    if window == 3:  # the root's calls changed: the structure gate puts it first whatever the model says
        assert fused[0] == plain[0] == "front"
        return
    learned = window_gcn_scores(model, stats, forest, node_score_shift(scores, normal_scores))
    shift = stats.service_shift_parts(forest).max(axis=1)
    if learned.idxmax() == shift.idxmax():  # both rankings put one service first: so does the fusion
        assert fused[0] == shift.idxmax()


def test_a_window_gcn_reading_the_slow_leaf_puts_it_first(scored):
    stats, normal_scores, windows = scored
    for slow, (window, scores) in enumerate(windows[:3]):
        ranking = combined_ranking(stats, window, scores, normal_scores, _reading("self_time"))
        assert ranking[0][0] == LEAVES[slow]


def test_bmeg_fuses_the_window_gcn_only_where_the_run_holds_one(tmp_path):
    detector = replace(tiny_detector(), run_dir=tmp_path)
    rankers = {ranker.name: ranker for ranker in default_rankers(detector, published=False)}
    assert "bmeg-gnn-fusion" not in rankers and window_gcn_of(detector) is None
    assert rankers["bmeg"].window_gcn is None  # type: ignore[attr-defined]
    save_window_gcn(_reading("self_time"), tmp_path / WINDOW_GCN_FILE)
    rankers = {ranker.name: ranker for ranker in default_rankers(detector, published=False)}
    assert {"bmeg", "bmeg-without-votes", "bmeg-rank-fusion", "bmeg-gnn-fusion", "bmeg-window-gcn"} <= set(rankers)
    assert rankers["bmeg"].window_gcn is not None and rankers["bmeg-gnn-fusion"].window_gcn is None  # type: ignore[attr-defined]
    assert rankers["bmeg"].fusion is None  # type: ignore[attr-defined]
    assert rankers["bmeg-rank-fusion"].fusion is rank_fusion  # type: ignore[attr-defined]
    assert rankers["bmeg-without-votes"].fusion is standardised_fusion  # type: ignore[attr-defined]
    normal = rpc_view(span_table(many_traces(60)))
    assert WindowRanker(detector, normal).window_gcn is not None  # every door's ranker reads it too
    (tmp_path / WINDOW_GCN_FILE).write_bytes(b"not a checkpoint")  # damaged: said, not passed over
    with pytest.raises(CheckpointError, match=WINDOW_GCN_FILE):
        WindowRanker(detector, normal)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_the_window_gcn_ranker_ranks_by_the_scores_the_fusion_reads(seed):
    normal = rpc_view(span_table(many_traces(60)))
    detector = with_normal_baselines(tiny_detector(), normal)
    stats, model = NormalStats.from_forest(normal), _random(seed)
    ranker = WindowGcnRanker(_DetectorScores(detector), model)
    for window in (_window(1, 8.0), _window(0, 8.0, extra_call=True)):
        gnn = node_score_shift(gnn_window_scores(detector, window), gnn_window_scores(detector, normal))
        ranked = ranker.rank(window, stats)
        assert ranked == rank_window(model, service_features(stats, window, gnn))
        assert dict(ranked) == window_gcn_scores(model, stats, window, gnn).to_dict()


def test_the_harness_runs_the_window_gcn_once_a_window_and_ranks_as_the_library(tmp_path, monkeypatch):
    """bmeg, bmeg-rank-fusion and bmeg-window-gcn read one computation of the window GCN's
    scores per window, bmeg and bmeg-gnn one of the GNN's votes, and bmeg's ranking is
    `combined_ranking`'s computed afresh."""
    import bmeg.evaluation.rankers as rankers_module

    normal = rpc_view(span_table(many_traces(60)))
    detector = replace(tiny_detector(), run_dir=tmp_path)
    model = _random(7)
    save_window_gcn(model, tmp_path / WINDOW_GCN_FILE)
    calls, vote_calls = [], []
    counted, counted_votes = rankers_module.learned_scores, rankers_module.culprit_vote_shift
    monkeypatch.setattr(rankers_module, "learned_scores", lambda *args: calls.append(1) or counted(*args))
    monkeypatch.setattr(rankers_module, "culprit_vote_shift", lambda *args: vote_calls.append(1) or counted_votes(*args))
    rankers = {r.name: r for r in default_rankers(detector, normal, published=False)}
    stats = NormalStats.from_forest(normal)
    baselined = with_normal_baselines(detector, normal)
    for count, window in enumerate((_window(1, 8.0), _window(0, 8.0, extra_call=True)), start=1):
        got = {name: rankers[name].rank(window, stats)
               for name in ("bmeg", "bmeg-gnn", "bmeg-rank-fusion", "bmeg-window-gcn")}
        assert len(calls) == len(vote_calls) == count
        fresh = combined_ranking(stats, window, gnn_window_scores(baselined, window),
                                 gnn_window_scores(baselined, normal), window_gcn_of(detector))
        assert [s for s, _ in got["bmeg"]] == [s for s, _ in fresh]


def test_with_a_window_gcn_bmeg_fuses_the_gnns_culprit_votes_as_a_third_ranking(tmp_path):
    """Given a window GCN, bmeg's fusion is the standardised sum of the time shift, the window
    GCN's scores and the GNN's culprit votes (issue 12, session 26); without the votes it is
    `bmeg-without-votes`."""
    normal = rpc_view(span_table(many_traces(60)))
    detector = with_normal_baselines(tiny_detector(), normal)
    stats, model, normal_scores = NormalStats.from_forest(normal), _random(3), gnn_window_scores(detector, normal)
    for window in (_window(1, 8.0), _window(2, 3.0)):
        scores = gnn_window_scores(detector, window)
        stages = window_stages(stats, window, scores, normal_scores, model)
        learned = learned_scores(stats, window, scores, normal_scores, model)
        votes = culprit_vote_shift(scores, normal_scores)
        time = stats.service_shift_parts(window).max(axis=1)
        assert stages.fused.equals(standardised_fusion(time, learned, votes))
        assert stages.votes is not None and stages.votes.equals(votes)  # what it fused, to explain it
        two_way = window_stages(stats, window, scores, normal_scores, model, standardised_fusion)
        assert two_way.fused.equals(standardised_fusion(time, learned)) and two_way.votes is None
        held = window_stages(stats, window, scores, normal_scores, model, votes=votes * 0)  # the caller's votes
        assert held.fused.equals(standardised_fusion(time, learned, votes * 0))
    assert window_stages(stats, window, scores, normal_scores).votes is None  # no window GCN: no votes


def test_the_gnns_votes_put_first_a_service_the_other_two_rankings_put_a_close_second():
    time = pd.Series({"caller": 1.0, "callee": 0.9, "other": 0.0})
    votes = pd.Series({"caller": 0.0, "callee": 0.6, "other": 0.0})
    assert standardised_fusion(time, time).index[0] == "caller"
    assert standardised_fusion(time, time, votes).index[0] == "callee"
    no_votes = pd.Series(dtype=float)
    assert standardised_fusion(time, time, no_votes).index.tolist() == ["caller", "callee", "other"]  # no change
