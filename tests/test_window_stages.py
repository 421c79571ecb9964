"""Which stage of bmeg's window ranking placed each service (`bmeg.models.window.window_stages`),
and the call edges' shifts behind the time shift's parts (`NormalStats.call_edge_shifts`)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.models.normal import NormalStats
from bmeg.models.window import (GATES, STAGE_DECISIVE, STAGE_FUSION, STAGE_STRUCTURE, combined_ranking,
                                decisive_shift, errors_began, gnn_window_scores, rank_fusion, ranked_stages,
                                standardised_fusion, structure_changed, structure_significant, window_stages,
                                with_normal_baselines)
from builders import bench_module, front_calling, tiny_detector

SERVICES = [f"s{i}" for i in range(6)]
shift = st.one_of(st.none(), st.floats(-3.0, 12.0))


@st.composite
def stage_inputs(draw):
    """What `combined_ranking` reads of a window, drawn: parts (NaN where a service has none),
    learned scores, structure parts and tests, and the normal noise (on a grid of values, so
    that ties between services happen)."""
    services = draw(st.lists(st.sampled_from(SERVICES), min_size=1, max_size=6, unique=True))
    grid = st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.5, 1.0])
    parts = pd.DataFrame({column: [np.nan if (x := draw(shift)) is None else x for _ in services]
                          for column in ("own", "caller", "callee")}, index=services)
    learned = pd.Series([draw(st.floats(-1.0, 1.0)) for _ in services], index=services)
    shape = pd.DataFrame({"calls": [draw(grid) for _ in services], "errors": [draw(grid) for _ in services],
                          "error_spans": [draw(st.integers(0, 10)) for _ in services]}, index=services)
    tests = pd.DataFrame({"p": [draw(st.sampled_from([1.0, 1e-2, 1e-9])) for _ in services],
                          "tests": [draw(st.integers(1, 5)) for _ in services]}, index=services)
    noise = pd.Series([draw(grid) for _ in services], index=services)
    errors = pd.Series([draw(grid) for _ in services], index=services)
    return parts, learned, shape, tests, noise, errors


@pytest.mark.parametrize("fusion", [rank_fusion, standardised_fusion])
@settings(max_examples=200)
@given(inputs=stage_inputs())
def test_the_stages_are_the_order_the_ranking_gives(fusion, inputs):
    """The decisive call gap first, then the gated services (by structure shift, ties in the
    fusion's order), then the fusion's order; each labelled by the
    stage that placed it, with the scores the ranking has always had (`rank_fusion`'s by
    default; any fusion given orders the rest)."""
    parts, learned, shape, tests, noise, errors = inputs
    got = ranked_stages(parts, learned, shape, tests, noise, errors, None if fusion is rank_fusion else fusion)
    fused = fusion(parts.max(axis=1), learned)
    assert got.fused.equals(fused) and got.parts is parts and got.learned is learned
    structure = {s: float(shape.loc[s, "calls"] + shape.loc[s, "errors"]) for s in fused.index}
    fired = {"structure_changed": structure_changed(pd.Series(structure), noise),
             "errors_began": errors_began(shape, errors), "structure_significant": structure_significant(tests)}
    assert list(got.gates.columns) == list(GATES)
    for gate, expected in fired.items():
        assert got.gates[gate].to_dict() == expected.reindex(fused.index, fill_value=False).to_dict()
    gated = [s for s in fused.index if any(bool(fired[g].get(s, False)) for g in GATES)]
    decisive = decisive_shift(parts[["caller", "callee"]].max(axis=1))
    assert got.decisive == decisive
    top = float(fused.max())
    expected = [(s, structure[s] + 2.0 + top, STAGE_STRUCTURE) for s in sorted(gated, key=lambda s: -structure[s])
                if s != decisive]
    if decisive is not None:
        lead = max([score for _, score, _ in expected] + [top]) + 1.0
        expected.insert(0, (decisive, lead, STAGE_DECISIVE))
    placed = {s for s, _, _ in expected}
    expected += [(s, float(fused[s]), STAGE_FUSION) for s in fused.index if s not in placed]
    assert [s for s, _ in got.ranking] == [s for s, _, _ in expected] == list(got.stage.index)
    assert [score for _, score in got.ranking] == pytest.approx([score for _, score, _ in expected])
    assert list(got.stage) == [stage for _, _, stage in expected]
    scores = [score for _, score in got.ranking]
    assert all(a >= b for a, b in zip(scores, scores[1:]))


@pytest.fixture(scope="module")
def concurrent():
    """svc0 raises in a fifth of the requests and front's calls of svc2 are 16x slower."""
    normal = front_calling(300)
    window = front_calling(100, failed=set(range(0, 100, 5)), svc2_gap_us=3_200)
    detector = with_normal_baselines(tiny_detector(), normal)
    return NormalStats.from_forest(normal), window, gnn_window_scores(detector, window), gnn_window_scores(detector, normal)


def test_a_window_s_stages_give_combined_ranking_s_answer(concurrent):
    stats, window, window_scores, normal_scores = concurrent
    got = window_stages(stats, window, window_scores, normal_scores)
    assert got.ranking == combined_ranking(stats, window, window_scores, normal_scores)
    # both faults first: the decisive call gap, then the gate (a slow callee can move its callers' structure)
    assert list(got.stage[:2].items()) == [("svc2", STAGE_DECISIVE), ("svc0", STAGE_STRUCTURE)]
    assert set(got.stage[2:]) == {STAGE_FUSION} and got.decisive == "svc2"
    assert got.gates.loc["svc0"].any() and not got.gates.drop("svc0").to_numpy().any()


def test_the_call_edges_are_what_the_parts_split_between_caller_and_callee(concurrent):
    """front's calls of svc2 are 16x slower (log2 4), its others as before: front's caller part is
    the smallest of its edges, svc2's callee part its edge's shift beyond that."""
    stats, window, _, _ = concurrent
    edges = stats.call_edge_shifts(window)
    parts = stats.service_shift_parts(window)
    assert edges.index.names == ["service", "callee"] and set(edges.index.get_level_values("callee")) >= {"svc0", "svc2"}
    assert edges["front", "svc2"] == pytest.approx(4.0, abs=0.2)
    assert parts.loc["front", "caller"] == pytest.approx(edges["front"].min())
    assert parts.loc["svc2", "callee"] == pytest.approx(edges["front", "svc2"] - edges["front"].min())


def test_the_bench_keeps_the_stages_and_edges_in_compact_json_and_reads_them_back(concurrent):
    """`bench/window_stages.py`: what `record` keeps of a window is plain JSON (no NaN, 3 decimals)
    and `analyse` reads the stage that placed the first from it."""
    bench = bench_module("window_stages")
    stats, window, window_scores, normal_scores = concurrent
    got = window_stages(stats, window, window_scores, normal_scores)
    kept = json.loads(json.dumps(bench.recorded(got, stats.call_edge_shifts(window)), allow_nan=False))
    assert [s for s, _ in kept["ranking"]] == [s for s, _ in got.ranking]
    assert ["front", "svc2", pytest.approx(4.0, abs=0.2)] in kept["edges"]
    assert all(round(v, 3) == v for _, _, v in kept["edges"])
    assert set(kept["parts"]) == {"own", "caller", "callee", "wait"} and kept["gates"]["svc0"]
    fault = {"others": [], "stages": kept, "service": "svc0"}
    # the delayed calls' start waits lift svc2 as much as their gaps (`wait_parts`): either part is the callee's
    assert bench.stage_of(fault) in {("decisive call gap (its callee part)", "svc2"),
                                     ("decisive call gap (its wait part)", "svc2")}
    assert bench.stage_of({**fault, "others": ["svc2"]}) == (f"gate {'+'.join(kept['gates']['svc0'])}", "svc0")
    assert kept["votes"] is None  # no window GCN: bmeg fuses no votes
    # a fusion that put another first: which of the fused rankings had the fault first
    parts = {"own": {"a": 1.0, "b": 0.5}, "caller": {}, "callee": {}, "wait": {}}
    fused = {"ranking": [["a", STAGE_FUSION], ["b", STAGE_FUSION]], "gates": {}, "parts": parts,
             "learned": {"a": 1.0, "b": 0.0}, "votes": {"a": 0.0, "b": 1.0}}
    assert bench.stage_of({"others": [], "stages": fused, "service": "b"}) == (
        "fusion: outvoted, the GNN's votes had it first (the first by its own part)", "a")
    assert bench.stage_of({"others": [], "stages": {**fused, "votes": None}, "service": "b"})[0].startswith("fusion: none")


@settings(max_examples=50)
@given(inputs=stage_inputs())
def test_votes_given_are_fused_as_a_third_ranking_and_kept(inputs):
    parts, learned, shape, tests, noise, errors = inputs
    votes = learned.iloc[::-1].set_axis(learned.index)
    got = ranked_stages(parts, learned, shape, tests, noise, errors, standardised_fusion, votes)
    assert got.votes is votes and got.fused.equals(standardised_fusion(parts.max(axis=1), learned, votes))
