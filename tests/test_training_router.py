"""The router's decision data: faults on services the fitting part never saw faulted."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from builders import spans
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.graphs import assemble
from bmeg.training.labelled import Labelled
from bmeg.training.pipeline import decision_weights, held_out_service_split

TRACES = 40
SERVICES = ["a", "b", "c", "d", "e"]
#: 40 traces of a root and two children: 120 nodes whose services and bottleneck labels are drawn.
FOREST = assemble(pa.concat_tables([spans([("0", None, 0, 30), ("1", "0", 1, 10), ("2", "0", 12, 10)], f"t{t:02d}")
                                    for t in range(TRACES)]))


def _labelled(node_y: np.ndarray, in_val: np.ndarray) -> Labelled:
    y = np.zeros(TRACES, dtype=np.int64)
    y[FOREST.trace_index[node_y == 1]] = 1
    traces = np.arange(TRACES)
    return Labelled(FOREST, y, node_y, traces[~in_val], traces[in_val], np.array([], dtype=np.int64), pa.table({}))


def _faulted(data: Labelled, services: np.ndarray, traces: np.ndarray) -> set[str]:
    rows = (data.node_y == 1) & np.isin(FOREST.trace_index, traces)
    return set(services[rows].tolist())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(SERVICES), min_size=3 * TRACES, max_size=3 * TRACES),
       st.lists(st.booleans(), min_size=3 * TRACES, max_size=3 * TRACES),
       st.lists(st.booleans(), min_size=TRACES, max_size=TRACES), st.floats(0.01, 0.99), st.integers(0, 9))
def test_no_decision_trace_is_faulted_on_a_service_faulted_in_the_fitting_part(names, bottleneck, in_val, share, seed):
    services = np.array(names, dtype=object)
    data = _labelled(np.array(bottleneck, dtype=np.int64), np.array(in_val))
    split = held_out_service_split(data, services, share, seed)
    faulted = _faulted(data, services, np.union1d(data.train, data.val))
    if split is None:
        return
    fitting, decision, held = split
    assert 1 <= len(held) < len(faulted)
    seen = _faulted(data, services, np.union1d(fitting.train, fitting.val))
    assert not seen & set(held)
    assert not _faulted(data, services, decision) & seen
    assert _faulted(data, services, decision) <= set(held)
    assert set(decision) <= set(data.val) | set(data.train) and set(fitting.val) <= set(data.val)
    assert set(fitting.train) <= set(data.train)
    assert not set(decision) & (set(fitting.train) | set(fitting.val)) - set(data.val[data.y[data.val] == 0])
    assert np.any(data.y[decision] == 1)
    assert set(decision[data.y[decision] == 0]) == set(data.val[data.y[data.val] == 0])  # the normal validation traces
    weights = decision_weights(data.y[decision], data.y[data.val])
    y = data.y[decision]
    if np.any(y == 0) and np.any(data.y[data.val] == 0):  # weighted, the decision part has validation's share of faults
        share = np.sum(weights[y == 1]) / np.sum(weights[y == 0])
        assert share == pytest.approx(np.sum(data.y[data.val] == 1) / np.sum(data.y[data.val] == 0))


def test_no_split_without_two_faulted_services():
    services = np.array(["a"] * 3 * TRACES, dtype=object)
    node_y = np.zeros(3 * TRACES, dtype=np.int64)
    node_y[::7] = 1
    in_val = np.arange(TRACES) % 3 == 0
    assert held_out_service_split(_labelled(node_y, in_val), services, 0.34, 0) is None
    services[::14] = "b"
    fitting, decision, held = held_out_service_split(_labelled(node_y, in_val), services, 0.34, 0)
    assert len(held) == 1 and len(decision) and len(fitting.train)


#: A short scenario of three sources (episodes of 12 s: the test generates eight of them).
SHORT_SCENARIO = """
name: short
kind: single
duration_s: 12
warmup_s: 1
campaign:
  start_s: 1
  every_s: 5
  burst_s: 4
  faults_per_round: [1, 1]
  sources:
    interference: {factor: [4, 6]}
    saturation: {capacity: [0.1, 0.2]}
    background: {pause_ms: [150, 200], every_ms: [300, 400]}
"""


def test_fresh_decision_data_holds_every_fault_source_of_the_scenario(tmp_path, monkeypatch):
    """On a simulated application the router decides on other fault draws (seed + 7, parts at
    seed + 7 + 1000 i), the same scenario and imbalance, an equal part of bottlenecked traces
    for every source the scenario draws (one draw of the whole scenario missed some: `single`'s
    5,000 traces are four fault rounds), the normal traces of a draw of the whole scenario (seed
    + 507); a recorded dataset, `router_fresh` 0 or fixed cuts: none."""
    from bmeg.datasets.generate import SHARD_STRIDE_NS
    from bmeg.datasets.loader import SOURCE_SEED_STRIDE, load_dataset
    from bmeg.training.config import TrainConfig
    from bmeg.training.pipeline import FRESH_SEED_OFFSET, NATURAL_SEED_OFFSET, fresh_decision_data

    monkeypatch.setenv("BMEG_CACHE", str(tmp_path / "cache"))
    scenario = tmp_path / "short.yaml"
    scenario.write_text(SHORT_SCENARIO)
    config = TrainConfig(dataset="hotelreservation", traces=200, imbalance=0.3, seed=2, router_fresh=240,
                         scenario=str(scenario))
    fresh = fresh_decision_data(config)
    assert fresh is not None
    # the stratified parts (80 traces each) drawn at DECISION_IMBALANCE 0.3: 18 bottlenecked traces per source; the
    # normal traces of a whole-scenario draw at the training 0.3 of 240 traces (`decision_normal_draw`; the
    # simulator's counts are only near the asked)
    assert 45 <= int(np.sum(fresh.y == 1)) <= 60 and 150 <= int(np.sum(fresh.y == 0)) <= 200
    sources = fresh.traces["fault_source"].to_numpy(zero_copy_only=False)[fresh.y == 1]
    names, counts = np.unique(sources, return_counts=True)
    assert names.tolist() == ["background", "interference", "saturation"]
    assert counts.max() - counts.min() <= 2  # (bad traces dropped)
    # each part on its own stretch of time, its episodes its own: the history features of one part's
    # traces (read over kept + context in time order) never read another part's faults
    frame = pd.DataFrame({"episode": fresh.traces["episode"].to_numpy(), "start": fresh.traces["start_ns"].to_numpy(),
                          "source": fresh.traces["fault_source"].to_numpy(zero_copy_only=False), "y": fresh.y})
    assert (frame[frame["y"] == 1].groupby("episode")["source"].nunique() == 1).all()
    spans = frame.groupby("episode")["start"].agg(["min", "max"]).sort_values("min")
    assert (spans["min"].to_numpy()[1:] > spans["max"].to_numpy()[:-1]).all()
    context_starts = fresh.context.spans["start_ns"].to_numpy()
    assert context_starts.max() - context_starts.min() > 3 * SHARD_STRIDE_NS  # three parts and the whole draw
    natural = load_dataset("hotelreservation", 240, 0.3, seed=2 + NATURAL_SEED_OFFSET, scenario=scenario, progress=False)
    normal_ids = set(natural.traces.filter(pc.invert(natural.traces["anomalous"]))["trace_id"].to_pylist())
    assert set(np.asarray(fresh.forest.trace_ids, dtype=object)[fresh.y == 0].tolist()) == normal_ids
    training = load_dataset("hotelreservation", 200, 0.3, seed=2, scenario=scenario, progress=False)
    assert not set(fresh.forest.trace_ids) & set(training.traces["trace_id"].to_pylist())
    parts = sorted((tmp_path / "cache" / "datasets").glob("hotelreservation-short-only-*"))
    assert [part.name.rsplit("-s", 1)[1].split("-v")[0] for part in parts] == [
        str(2 + FRESH_SEED_OFFSET + SOURCE_SEED_STRIDE * i) for i in range(3)]
    assert fresh_decision_data(TrainConfig(dataset=str(training.path), router_fresh=300)) is None
    assert fresh_decision_data(TrainConfig(dataset="hotelreservation", router_fresh=0)) is None
    assert fresh_decision_data(TrainConfig(dataset="hotelreservation", router_fresh=300, svm_max_services=5)) is None


def test_the_decision_evidence_is_the_same_at_every_training_imbalance(tmp_path, monkeypatch):
    """The router's decision data hold the same bottlenecked traces at every training imbalance
    (the stratified parts at `DECISION_IMBALANCE`; until session 15 they were drawn at the
    training imbalance, at least 0.1: 91 per source at 0.01 and 0.1, 231 at 0.3), and as many
    normal traces as put them at the training imbalance: the bottlenecked weight beside the
    normal traces, which a false alarm is counted against, no longer shrinks with the imbalance
    (docs/issue-17.md, session 15)."""
    from bmeg.training.config import TrainConfig
    from bmeg.training.pipeline import fresh_decision_data

    monkeypatch.setenv("BMEG_CACHE", str(tmp_path / "cache"))
    scenario = tmp_path / "short.yaml"
    scenario.write_text(SHORT_SCENARIO)
    draws = {ratio: fresh_decision_data(TrainConfig(dataset="hotelreservation", traces=200, imbalance=ratio, seed=2,
                                                    router_fresh=240, scenario=str(scenario)))
             for ratio in (0.3, 0.1)}
    ids = {ratio: np.asarray(fresh.forest.trace_ids, dtype=object) for ratio, fresh in draws.items() if fresh is not None}
    bottlenecked = {ratio: set(ids[ratio][draws[ratio].y == 1].tolist()) for ratio in ids}
    assert bottlenecked[0.3] == bottlenecked[0.1]  # the very same traces
    for ratio, fresh in draws.items():
        assert fresh is not None
        positives, negatives = int(np.sum(fresh.y == 1)), int(np.sum(fresh.y == 0))
        # the simulator's counts are only near the asked; bad traces dropped
        assert negatives * ratio == pytest.approx(positives, rel=0.15)


@settings(max_examples=80, deadline=None)
@given(st.floats(0.001, 2.0), st.integers(5, 20_000))
def test_the_normal_draw_puts_the_stratified_bottlenecked_traces_at_the_training_imbalance(ratio, fresh):
    from bmeg.training.config import TrainConfig
    from bmeg.training.pipeline import DECISION_IMBALANCE, MAX_DECISION_NORMAL_DRAW, decision_normal_draw

    traces = decision_normal_draw(TrainConfig(imbalance=ratio, router_fresh=fresh))
    bottlenecked = fresh * DECISION_IMBALANCE / (1 + DECISION_IMBALANCE)  # the stratified parts' (nominal)
    normal = traces / (1 + ratio)  # the draw's normal traces at the training imbalance (nominal)
    if traces < MAX_DECISION_NORMAL_DRAW:
        assert normal * ratio == pytest.approx(bottlenecked, abs=ratio)  # (rounded to whole traces)
    else:
        assert normal * ratio <= bottlenecked + ratio
    assert decision_normal_draw(TrainConfig(imbalance=0.0, router_fresh=fresh)) == MAX_DECISION_NORMAL_DRAW


def test_only_source_keeps_one_source_and_refuses_one_the_scenario_lacks():
    from bmeg.faultinject.scenario import load_scenario, only_source, scenario_sources

    single = load_scenario("single")
    assert scenario_sources(single) == ["background", "interference", "misconfiguration", "network", "saturation"]
    network = only_source(single, "network")
    assert scenario_sources(network) == ["network"]
    assert network.campaign is not None and network.campaign.sources["network"] == single.campaign.sources["network"]
    assert (network.duration_s, network.campaign.every_s) == (single.duration_s, single.campaign.every_s)
    with pytest.raises(ValueError, match="draws no 'saturation' faults"):
        only_source(network, "saturation")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "none"]), min_size=1, max_size=60),
       st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=60))
def test_source_mix_weights_give_each_source_its_reference_share(sources, reference):
    """Each source's bottlenecked traces weigh its share in the reference (plus one pseudo-trace
    each); their total is their count; normal traces weigh 1."""
    from bmeg.training.pipeline import source_mix_weights

    sources_array = np.array(sources, dtype=object)
    y = (sources_array != "none").astype(np.int64)
    weights = source_mix_weights(y, sources_array, np.array(reference, dtype=object))
    assert np.all(weights[y == 0] == 1.0) and np.all(weights > 0)
    assert np.isclose(weights[y == 1].sum(), y.sum())
    present = sorted(set(sources_array[y == 1]))
    expected = np.array([reference.count(name) + 1.0 for name in present])
    expected /= expected.sum()
    got = np.array([weights[(y == 1) & (sources_array == name)].sum() for name in present]) / max(y.sum(), 1)
    assert np.allclose(got, expected)


def test_culprit_credit_counts_a_right_actionable_culprit_whatever_the_models_scale():
    """The router's culprit credit (docs/issue-17.md, session 8 second round): the GNN's node
    scores sit near 1, the SVM path's are a calibrated P(culprit); a right culprit named as a
    bottleneck earns 1 from either, a wrong one or one scored too low to act on earns 0."""
    from bmeg.mitigation.safety import SafetyPolicy
    from bmeg.training.pipeline import ACTIONABLE_SCORE, named_culprit

    assert ACTIONABLE_SCORE == SafetyPolicy().confidence_threshold  # a blame below it never moves an action
    present = np.array([[True, True, True]] * 4)
    truth = np.array([[True, False, False]] * 4)
    gnn = np.array([[0.99, 0.2, 0.1], [0.97, 0.98, 0.1], [0.6, 0.1, 0.0], [0.99, 0.0, 0.0]])
    svm = np.array([[0.55, 0.2, 0.1], [0.30, 0.35, 0.1], [0.13, 0.05, 0.0], [0.45, 0.0, 0.0]])
    assert named_culprit(gnn, present, truth, 0.5).tolist() == [1.0, 0.0, 1.0, 1.0]
    # the same verdicts on the SVM's scale: right and named (0.55), wrong top (0.35), right but
    # scored 0.13 (the closed loop's refused blame), right but under the model's threshold (0.5)
    assert named_culprit(svm, present, truth, 0.1).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert named_culprit(svm, present, truth, 0.5).tolist() == [1.0, 0.0, 0.0, 0.0]
    hidden = present.copy()
    hidden[:, 0] = False  # the culprit is not in the trace: its score is not read
    assert named_culprit(gnn, hidden, truth, 0.5).tolist() == [0.0] * 4


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=4, max_size=4), min_size=1, max_size=20),
       st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=20, max_size=20),
       st.integers(0, 12), st.floats(0.5, 2.0))
def test_culprit_credit_is_unchanged_by_a_monotone_rescaling_of_the_scores(steps, truth_rows, step, power):
    """Scale-free: a model whose scores (and node threshold) are an increasing function of
    another's, above the actionable floor, earns the same credit on every trace."""
    from bmeg.training.pipeline import ACTIONABLE_SCORE, named_culprit

    floor, span = ACTIONABLE_SCORE, 1.0 - ACTIONABLE_SCORE
    scores = floor + span * np.array(steps, dtype=np.float64) / 12
    truth = np.array(truth_rows[:len(steps)])
    present = np.ones_like(truth)
    # between two score steps: a score equal to the threshold is a tie that a rescaling computed
    # elementwise (numpy's vector pow) and on a scalar can round apart by an ulp (power 1.0625, step 11)
    threshold = floor + span * (step + 0.5) / 12

    def rescaled(x):
        return floor + span * ((np.asarray(x) - floor) / span) ** power

    credit = named_culprit(scores, present, truth, threshold)
    assert set(credit.tolist()) <= {0.0, 1.0}
    assert credit.tolist() == named_culprit(rescaled(scores), present, truth, float(rescaled(threshold))).tolist()


def test_labels_follow_the_forest_when_a_trace_has_no_spans(tmp_path):
    """A trace listed in the labels but with no span (the simulator writes some, 0 ns long) has
    no row in the forest; every other trace keeps its own label."""
    from bmeg.datasets.loader import Dataset
    from bmeg.training.pipeline import label

    names = [f"t{t:02d}" for t in range(12)]
    anomalous = [t % 3 == 0 for t in range(12)]
    table = pa.concat_tables([spans([("0", None, 0, 30 if flag else 10)], name)
                              for name, flag in zip(names, anomalous) if name != "t01"])
    traces = pa.table({"trace_id": names, "anomalous": anomalous})
    nodes = pa.table({"trace_id": table["trace_id"], "span_id": table["span_id"],
                      "bottleneck": pa.array([d == 30 for d in table["duration_ns"].to_pylist()])})
    data = label(Dataset(tmp_path, table, traces, nodes, [{}]), seed=0)
    assert data.forest.num_traces == 11 and len(data.y) == 11
    assert data.traces["trace_id"].to_pylist() == list(data.forest.trace_ids)
    by_id = dict(zip(names, anomalous))
    assert data.y.tolist() == [int(by_id[name]) for name in data.forest.trace_ids]
