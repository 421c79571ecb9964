"""Models, features, checkpoints and metrics on small hand-made and generated inputs."""

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GCNConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm

from builders import many_traces, star_trace, tiny_detector

from bmeg.graphs import assemble
from bmeg.models.adjacency import gcn_adjacency
from bmeg.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from bmeg.models.dgcnn import DGCNN
from bmeg.graphs.critical_path import critical_paths
from bmeg.models import features
from bmeg.models.features import FeatureEncoder
from bmeg.models.gcn_node import GCNNodeClassifier, GCNNodeEnsemble, node_classifier
from bmeg.models.graphset import GraphSet
from bmeg.models.inference import predict_proba
from bmeg.models.history import StreamHistory
from bmeg.models.router import Router, choose, distinct_paths
from bmeg.models.svm import (
    CONFIRMED,
    DEVIATIONS,
    PATH,
    START,
    CulpritScorer,
    FirmSVM,
    TraceSVM,
    TraceVectorizer,
    firm_features,
    node_deviations,
    service_deviations,
)
from bmeg.traces import span_table
from bmeg.training.metrics import (
    accuracy_at_k,
    average_at_k,
    classification_table,
    threshold_for_precision,
)


def test_dgcnn_and_gcn_shapes():
    graphs = [Data(x=torch.randn(n, 6), edge_index=torch.tensor([[0] * (n - 1), list(range(1, n))])) for n in (2, 12, 40)]
    batch = Batch.from_data_list(graphs)
    assert DGCNN(6, k=10)(batch.x, batch.edge_index, batch.batch).shape == (3, 2)
    assert GCNNodeClassifier(6)(batch.x, batch.edge_index).shape == (54, 2)
    with pytest.raises(ValueError, match="too small"):
        DGCNN(6, k=4)


@pytest.mark.parametrize("make", [lambda: DGCNN(6, k=10), lambda: GCNNodeClassifier(6)], ids=["dgcnn", "gcn"])
def test_reset_parameters_resets_every_weight_reproducibly(make):
    model = make()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(7.0)
    torch.manual_seed(3)
    model.reset_parameters()
    # every learnable tensor was reset (none still holds the 7s), not only some layers
    assert all(not torch.all(parameter == 7.0) for parameter in model.parameters())
    again = make()
    torch.manual_seed(3)
    again.reset_parameters()

    def same_weights() -> bool:
        return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))

    assert same_weights()
    torch.manual_seed(4)
    again.reset_parameters()
    assert not same_weights()


def test_repr_names_the_sizes():
    assert repr(DGCNN(6, hidden_channels=16, k=12, dense_channels=64, dropout=0.5)) == (
        "DGCNN(6, hidden_channels=16, k=12, dense_channels=64, dropout=0.5)")
    assert repr(GCNNodeClassifier(6, hidden_channels=32, dropout=0.1, inputs="asinh")) == (
        "GCNNodeClassifier(6, hidden_channels=32, dropout=0.1, inputs='asinh')")


def test_a_node_ensemble_gives_the_mean_of_its_members_probabilities():
    """Bagged over draws, the node stage's P(bottleneck) is its members' mean: the ensemble's
    output is the log of that mean, so the softmax every caller takes gives it back."""
    graphs = [Data(x=torch.randn(n, 6), edge_index=torch.tensor([[0] * (n - 1), list(range(1, n))])) for n in (3, 9)]
    batch = Batch.from_data_list(graphs)
    torch.manual_seed(5)
    members = [GCNNodeClassifier(6).eval() for _ in range(3)]
    ensemble = GCNNodeEnsemble(members).eval()
    with torch.no_grad():
        expected = torch.stack([torch.softmax(m(batch.x, batch.edge_index).double(), -1) for m in members]).mean(0)
        got = torch.softmax(ensemble(batch.x, batch.edge_index).double(), -1)
        alone = torch.softmax(GCNNodeEnsemble(members[:1])(batch.x, batch.edge_index), -1)
        first = torch.softmax(members[0](batch.x, batch.edge_index).double(), -1)
    assert got.shape == (12, 2) and torch.allclose(got, expected, atol=1e-12)
    assert torch.allclose(alone, first, atol=1e-12)  # one member reads as itself
    assert repr(ensemble) == "GCNNodeEnsemble(3 x GCNNodeClassifier(6, hidden_channels=64, dropout=0.2, inputs='raw'))"


def test_a_saved_runs_node_stage_is_built_from_its_hyperparameters():
    assert type(node_classifier(6)) is GCNNodeClassifier and node_classifier(6, hidden_channels=8).hidden_channels == 8
    ensemble = node_classifier(6, members=3, hidden_channels=8)
    assert isinstance(ensemble, GCNNodeEnsemble) and [m.hidden_channels for m in ensemble.members] == [8, 8, 8]
    with pytest.raises(ValueError, match="1 to 32 classifiers, not 0"):
        node_classifier(6, members=0)
    with pytest.raises(ValueError, match="not 1000000"):  # a hostile run's hparams: refused before any is built
        node_classifier(6, members=10**6)
    with pytest.raises(ValueError, match="at least one"):
        GCNNodeEnsemble([])


def test_a_detector_with_a_node_ensemble_saves_and_loads_with_the_same_scores(tmp_path):
    from dataclasses import replace

    from bmeg.models.detector import Detector

    torch.manual_seed(2)
    tiny = tiny_detector()
    members = [GCNNodeClassifier(tiny.encoder.num_features).eval() for _ in range(3)]
    bagged = replace(tiny, gcn=GCNNodeEnsemble(members).eval(), hparams={**tiny.hparams, "gcn": {"members": 3}})
    bagged.save(tmp_path)
    loaded = Detector.load(tmp_path, device="cpu")
    assert isinstance(loaded.gcn, GCNNodeEnsemble) and len(loaded.gcn.members) == 3
    forest = assemble(span_table(many_traces(6)))
    before, after = bagged.score(forest), loaded.score(forest)
    np.testing.assert_allclose(after.gnn_node, before.gnn_node)
    assert not np.allclose(before.gnn_node, tiny.score(forest).gnn_node)  # the members, not the first alone


def test_minibatch_matches_the_forest_graphs():
    forest = assemble(span_table(many_traces(5)))
    x = np.arange(forest.num_spans, dtype=np.float32)[:, None]
    graphs = GraphSet.from_forest(forest, x, y=[0, 1, 0, 1, 0], node_y=np.arange(forest.num_spans) % 2)
    batch = graphs.minibatch(np.array([3, 1]))
    rows = np.r_[np.arange(*forest.trace_slice(3).indices(forest.num_spans)), np.arange(*forest.trace_slice(1).indices(forest.num_spans))]
    assert batch.x[:, 0].tolist() == rows.tolist()
    assert batch.y.tolist() == [1, 1]
    assert batch.batch.tolist() == [0] * 4 + [1] * 4
    # 3 parent-child edges per trace, both directions, and self-loops, renumbered within the batch
    linked = batch.adj_t.to_dense() != 0
    assert linked.sum() == 2 * (6 + 4)
    assert torch.equal(linked, linked.T) and linked.diagonal().all()
    assert not linked[:4, 4:].any() and not linked[4:, :4].any()


class _MeanLogit(torch.nn.Module):
    """A graph classifier whose positive-class logit is its graph's mean feature (negative: 0)."""

    def forward(self, x, adj_t, batch):
        mean = torch.zeros(int(batch.max()) + 1, dtype=x.dtype).index_reduce_(0, batch, x[:, 0], "mean", include_self=False)
        return torch.stack([torch.zeros_like(mean), mean], dim=1)


def test_probabilities_of_confident_traces_keep_their_order():
    # Logit gaps of 17-33: in float32 every one of these rounds to P = 1.0, and a threshold set
    # on healthy traces that score 1.0 can only go above 1 (stage 1 then flags nothing).
    forest = assemble(span_table(many_traces(5)))
    gaps = np.array([17.0, 21.0, 25.0, 29.0, 33.0], dtype=np.float32)
    graphs = GraphSet.from_forest(forest, gaps[forest.trace_index][:, None])
    scores = predict_proba({"graph": _MeanLogit()}, graphs, np.arange(5), torch.device("cpu"))["graph"]
    assert np.all(np.diff(scores) > 0) and scores[-1] < 1.0
    assert np.allclose(1.0 - scores, np.exp(-gaps.astype(np.float64)), rtol=1e-6)


def test_graph_sets_of_a_one_span_trace_and_of_no_trace():
    forest = assemble(span_table(star_trace("solo", [])))
    graphs = GraphSet.from_forest(forest, FeatureEncoder("thesis").transform(forest), y=[1], node_y=[1])
    batch = graphs.minibatch(np.array([0]))
    assert graphs.edges.shape == (2, 0) and batch.adj_t.to_dense().tolist() == [[1.0]]  # its self-loop only
    assert batch.y.tolist() == [1] and batch.node_y.tolist() == [1]
    empty = assemble(span_table({key: [] for key in star_trace("none", [])}))
    nothing = GraphSet.from_forest(empty, FeatureEncoder("thesis").transform(empty))
    assert nothing.num_graphs == 0 and nothing.minibatch(np.array([], dtype=np.int64)).x.shape == (0, 1)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=30))))
def test_gcn_adjacency_propagates_as_pyg_message_passing(graph):
    # Any directed edges, self-loops and duplicates included: the sparse product equals PyG's edge-wise GCNConv.
    num_nodes, edges = graph
    edge_index = torch.tensor(edges, dtype=torch.long).reshape(-1, 2).T
    conv = GCNConv(3, 4, normalize=False)
    x = torch.randn(num_nodes, 3)
    expected = conv(x, *gcn_norm(edge_index, None, num_nodes, add_self_loops=True))
    assert torch.allclose(conv(x, gcn_adjacency(edge_index, num_nodes)), expected, atol=1e-5)


def test_models_take_an_edge_index_or_its_adjacency():
    graphs = [Data(x=torch.randn(n, 6), edge_index=torch.tensor([[0] * (n - 1), list(range(1, n))])) for n in (3, 15)]
    batch = Batch.from_data_list(graphs)
    adj_t = gcn_adjacency(batch.edge_index, batch.num_nodes)
    dgcnn, gcn = DGCNN(6, k=10).eval(), GCNNodeClassifier(6).eval()
    assert torch.equal(dgcnn(batch.x, batch.edge_index, batch.batch), dgcnn(batch.x, adj_t, batch.batch))
    assert torch.equal(gcn(batch.x, batch.edge_index), gcn(batch.x, adj_t))


def test_feature_encoder_baselines_flag_the_slow_span():
    normal = assemble(span_table(many_traces(40)))
    encoder = FeatureEncoder().fit(normal)
    test = assemble(span_table(many_traces(3, slow=1)))
    x = encoder.transform(test)
    assert x.shape == (test.num_spans, encoder.num_features)
    z_self = x[:, encoder.names.index("z_log_self_time_us")]
    slow_row = int(np.argmax(z_self))
    assert test.spans["service"][slow_row].as_py() == "svc1" and test.trace_index[slow_row] == 1
    assert z_self[slow_row] > 10
    assert np.abs(np.delete(z_self, slow_row)).max() < 5


def test_feature_encoder_flags_unknown_operations_and_needs_fit():
    encoder = FeatureEncoder().fit(assemble(span_table(many_traces(5))))
    other = assemble(span_table(star_trace("x", [10], operation="never-seen")))
    x = encoder.transform(other)
    assert x[:, encoder.names.index("unknown_operation")].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="not fitted"):
        FeatureEncoder().transform(other)
    assert FeatureEncoder("thesis").transform(other).shape == (2, 1)
    with pytest.raises(ValueError, match="unknown feature variant"):
        FeatureEncoder("fancy")


def test_firm_features_relative_importance_and_congestion():
    rng = np.random.default_rng(0)
    a = rng.uniform(100, 200, 300)
    b = np.full(300, 50.0)
    frame = pd.DataFrame({"a": a, "b": b, PATH: a + b, START: np.arange(300)})
    features = firm_features(frame, window=100)
    assert features.shape == (300, 2, 2)
    assert features[-1, 0, 0] == pytest.approx(1.0)  # a drives the path
    assert features[-1, 1, 0] == 0.0  # constant b: no correlation, neutral
    assert features[-1, 1, 1] == pytest.approx(1.0)  # p99 / p50 of a constant
    assert features[-1, 0, 1] > 1.0


def test_firm_svm_learns_separable_pairs_and_validates_input():
    rng = np.random.default_rng(1)
    X = np.r_[rng.normal([0.1, 1.2], 0.05, (200, 2)), rng.normal([0.9, 4.0], 0.05, (20, 2))]
    y = np.r_[np.zeros(200), np.ones(20)]
    svm = FirmSVM().fit(X, y)
    assert (svm.predict(X) == y).mean() > 0.98
    proba = svm.predict_proba(X)
    assert np.all((proba > 0) & (proba < 1)) and np.allclose(proba.sum(axis=1), 1.0)
    with pytest.raises(ValueError, match="both classes"):
        FirmSVM().fit(X, np.zeros(len(X)))
    with pytest.raises(ValueError, match="features"):
        svm.predict(X[:, :1])


def test_checkpoint_errors_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="no model"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "model.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a bmeg checkpoint"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, {"application": "socialnet", "svm": {"coef_": [0.5, 1.5]}})
    state = load_checkpoint(tmp_path, application="socialnet")
    assert state["application"] == "socialnet" and state["svm"] == {"coef_": [0.5, 1.5]}
    with pytest.raises(CheckpointError, match="trained on 'socialnet', not 'hotelreservation'"):
        load_checkpoint(tmp_path, application="hotelreservation")
    stale = torch.load(tmp_path / "model.pt", weights_only=True)
    stale["format_version"] = 0
    torch.save(stale, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="format 0.*retrain"):
        load_checkpoint(tmp_path)


def test_thesis_table_and_rankings():
    table = classification_table(np.array([0, 0, 1, 1]), np.array([0, 1, 1, 1]))
    assert table == {"accuracy": 0.75, "nbp": 1.0, "bp": pytest.approx(2 / 3), "nbr": 0.5, "br": 1.0}
    rankings = [["a", "b", "c"], ["b", "a", "c"], ["c", "b", "a"]]
    truths = [{"a"}, {"a"}, {"a"}]
    assert accuracy_at_k(rankings, truths, 1) == pytest.approx(1 / 3)
    assert accuracy_at_k(rankings, truths, 2) == pytest.approx(2 / 3)
    assert average_at_k(rankings, truths, 3) == pytest.approx((1 / 3 + 2 / 3 + 1) / 3)


def test_threshold_for_precision_prefers_recall_at_the_precision():
    y = np.array([0, 0, 0, 1, 1, 0, 1])
    scores = np.array([0.1, 0.2, 0.3, 0.4, 0.6, 0.65, 0.9])
    threshold = threshold_for_precision(y, scores, 0.6)
    predicted = scores >= threshold
    assert (y[predicted] == 1).mean() >= 0.6
    assert predicted[y == 1].all()


def test_detector_round_trip_and_diagnosis(tmp_path):
    from bmeg.models.detector import Detector

    tiny_detector().save(tmp_path)
    detector = Detector.load(tmp_path, device="cpu", application="toy")
    diagnosis = detector.diagnose(span_table(many_traces(3, slow=1)), window=True)
    assert [t.trace_id for t in diagnosis.traces] == ["t0000", "t0001", "t0002"]
    trace = diagnosis.traces[1]
    assert trace.spans == 4 and trace.model == "gnn" and 0 <= trace.anomaly_score <= 1
    assert trace.route.startswith("gnn: every trace goes to the GNN")
    assert {s.service for s in trace.bottlenecks} == {"front", "svc0", "svc1", "svc2"}
    assert trace.latencies[0].service == "svc1" and trace.latencies[0].ratio == pytest.approx(25.0)
    assert sum(step.exclusive_us for step in trace.critical_path) == pytest.approx(trace.total_us)
    assert diagnosis.ranking is not None


def test_detector_warns_about_unknown_services_and_repairs(tmp_path):
    spans = star_trace("u", [100, 200])
    spans["service"][2] = "brand-new-service"
    spans["parent_id"][1] = "missing-parent"
    diagnosis = tiny_detector().diagnose(span_table(spans))
    warnings = " ".join(diagnosis.traces[0].warnings)
    assert "brand-new-service" in warnings and "parent" in warnings


def test_checkpoint_with_other_features_is_rejected(tmp_path):
    from bmeg.models.detector import Detector

    tiny_detector().save(tmp_path)
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    state["encoder"]["names"] = state["encoder"]["names"][:-1]
    torch.save(state, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="differ from this bmeg"):
        Detector.load(tmp_path)


@pytest.mark.parametrize("make", [lambda: TraceSVM(), lambda: FirmSVM(max_samples=200), lambda: CulpritScorer()],
                         ids=["TraceSVM", "FirmSVM", "CulpritScorer"])
def test_svms_follow_the_scikit_learn_contract(make):
    from sklearn.utils.estimator_checks import check_estimator

    failed = [(r["check_name"], str(r["exception"])[:200]) for r in check_estimator(make(), on_fail=None)
              if r["status"] == "failed"]
    assert failed == []


def test_svm_state_is_plain_values_and_gives_the_same_answers():
    import json

    from sklearn.svm import SVC

    rng = np.random.default_rng(3)
    X = rng.normal(size=(300, 2))
    y = (X[:, 0] ** 2 + X[:, 1] > 1).astype(int)
    firm = FirmSVM(random_state=0).fit(X, y)
    # the numpy kernel expansion is libsvm's margin on the same standardised data
    reference = SVC(class_weight="balanced").fit((X - firm.mean_) / firm.scale_, y)
    assert np.allclose(reference.decision_function((X - firm.mean_) / firm.scale_), firm.decision_function(X))
    trace = TraceSVM(random_state=0).fit(X, y)
    for model in (firm, trace):
        state = json.loads(json.dumps(model.to_state()))  # JSON-able: no objects, no pickle
        again = type(model).from_state(state)
        assert np.allclose(again.predict_proba(X), model.predict_proba(X))
        assert again.get_params() == model.get_params()


def test_trace_vectorizer_log_times_and_the_traces_largest_deviations():
    vectorizer = TraceVectorizer(deviations=("z",), top=2).fit(np.array(["a\x1fop", "b\x1fop"], dtype=object))
    keys = np.array(["a\x1fop", "a\x1fop", "b\x1fop", "new\x1fop"], dtype=object)
    args = (np.array([0, 0, 1, 1]), 3, keys, np.array([10.0, 20.0, 5.0, 7.0]), np.array([[1.0], [4.0], [-2.0], [9.0]]))
    rows = vectorizer.transform(*args)
    assert rows.shape == (3, vectorizer.num_columns) == (3, 4)
    assert rows[0].tolist() == pytest.approx([np.log1p(30.0), 0.0, 4.0, 1.0])  # sum of times; largest first
    # an unknown key has no time column, but its deviation is the trace's largest
    assert rows[1].tolist() == pytest.approx([0.0, np.log1p(5.0), 9.0, -2.0])
    assert rows[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # a trace without nodes: missing = 0
    per_key = TraceVectorizer(deviations=("z",), per_key_deviations=True).fit(keys[:3]).transform(*args)
    assert per_key[0].tolist() == pytest.approx([np.log1p(30.0), 0.0, 4.0, 0.0])  # largest per key
    assert per_key[1].tolist() == pytest.approx([0.0, np.log1p(5.0), 0.0, -2.0])  # unknown key left out
    with pytest.raises(ValueError, match="top must be at least 1"):
        TraceVectorizer(top=0)


def test_trace_vectorizer_state_round_trips_and_reads_the_earlier_per_key_layout():
    vectorizer = TraceVectorizer(deviations=("z",), top=2).fit(np.array(["a\x1fop", "b\x1fop"], dtype=object))
    again = TraceVectorizer.from_state(vectorizer.to_state())
    assert (again.keys, again.deviations, again.top, again.per_key_deviations) == (vectorizer.keys, ("z",), 2, False)
    earlier = TraceVectorizer.from_state({"keys": ["a\x1fop", "b\x1fop"], "deviations": ["z"]})  # no `top`
    assert earlier.per_key_deviations and earlier.num_columns == 4


def test_trace_vectorizer_services_deviations_without_times():
    """`bmeg train`'s layout: no per-key times; the trace's largest deviations, then each
    culprit feature's largest values over the trace's services (0 past its services)."""
    vectorizer = TraceVectorizer(deviations=("z",), top=1, times=False, culprit_top=2).fit(
        np.array(["a\x1fop", "b\x1fop"], dtype=object))
    keys = np.array(["a\x1fop", "b\x1fop", "a\x1fop"], dtype=object)
    services = np.array([[[1.0, 5.0, 0.5], [3.0, -1.0, 2.0]], [[0.2, 0.1, 7.0], [0.0, 0.0, 0.0]]])
    rows = vectorizer.transform(np.array([0, 0, 1]), 2, keys, np.ones(3), np.array([[2.0], [6.0], [1.0]]), services)
    assert rows.shape == (2, vectorizer.num_columns) == (2, 1 + 3 * 2)
    assert rows[0].tolist() == pytest.approx([6.0, 3.0, 1.0, 5.0, -1.0, 2.0, 0.5])  # own time, queue, gap: largest first
    assert rows[1].tolist() == pytest.approx([1.0, 0.2, 0.0, 0.1, 0.0, 7.0, 0.0])
    one_service = vectorizer.transform(np.array([0]), 1, keys[:1], np.ones(1), np.array([[2.0]]), services[:1, :1])
    assert one_service[0].tolist() == pytest.approx([2.0, 1.0, 0.0, 5.0, 0.0, 0.5, 0.0])  # padded with the baseline
    with pytest.raises(ValueError, match="services' deviations"):
        vectorizer.transform(np.array([0]), 1, keys[:1], np.ones(1), np.array([[2.0]]))
    with pytest.raises(ValueError, match="culprit_top must be at least 0"):
        TraceVectorizer(culprit_top=-1)
    again = TraceVectorizer.from_state(vectorizer.to_state())
    assert (again.times, again.culprit_top, again.num_columns) == (False, 2, 7)
    before = {key: value for key, value in vectorizer.to_state().items() if key not in ("times", "culprit_top")}
    assert (TraceVectorizer.from_state(before).times, TraceVectorizer.from_state(before).culprit_top) == (True, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-50, 50)), max_size=40), st.integers(1, 4))
def test_trace_vectorizer_largest_deviations_are_each_traces_sorted_top(nodes, top):
    trace_index = np.array([t for t, _ in nodes], dtype=np.int64)
    values = np.array([[v] for _, v in nodes], dtype=np.float64).reshape(-1, 1)
    keys = np.array(["k"] * len(nodes), dtype=object)
    rows = TraceVectorizer(deviations=("z",), top=top).fit(np.array(["k"], dtype=object)).transform(
        trace_index, 5, keys, np.ones(len(nodes)), values)
    for trace in range(5):
        expected = sorted(values[trace_index == trace, 0].tolist(), reverse=True)[:top]
        assert rows[trace, 1:].tolist() == pytest.approx(expected + [0.0] * (top - len(expected)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-50, 50), st.floats(-50, 50), st.floats(-50, 50)), max_size=30))
def test_node_deviations_take_columns_by_name_and_confirmed_is_the_smaller_of_own_time_and_history(rows):
    names = ["z_log_self_time_us", "other", "recent_z_self_time"]
    x = np.array(rows, dtype=np.float32).reshape(-1, 3)
    got = node_deviations(x, names, ("recent_z_self_time", CONFIRMED, "z_log_self_time_us"))
    assert got.shape == (len(rows), 3) and got.dtype == np.float64
    assert np.array_equal(got[:, 0], x[:, 2]) and np.array_equal(got[:, 2], x[:, 0])
    assert np.array_equal(got[:, 1], np.minimum(x[:, 0], x[:, 2]))
    assert node_deviations(x, names, ()).shape == (len(rows), 0)


def test_node_deviations_name_what_the_features_lack():
    x = np.zeros((2, 2))
    with pytest.raises(ValueError, match="confirmed_z_self_time"):
        node_deviations(x, ["z_log_self_time_us", "z_log_wait_us"], (CONFIRMED,))
    with pytest.raises(ValueError, match="z_log_duration_us"):
        node_deviations(x, ["z_log_self_time_us", "z_log_wait_us"], ("z_log_duration_us",))


def test_trace_svm_with_the_history_tells_a_lasting_fault_from_one_slow_call():
    """Why the trace vector takes the history-confirmed own time: a normal trace whose one node
    is slow by chance (its service's recent visits normal) and a bottlenecked one (the node off
    and so were its service's recent visits) look the same to the trace's own deviations. At
    1% bottlenecked traces, the chance ones outnumber them; with `CONFIRMED` the SVM tells them
    apart."""
    rng = np.random.default_rng(3)
    names = ["z_log_self_time_us", "recent_z_self_time"]

    def traces(count: int, bottlenecked: bool) -> tuple[np.ndarray, np.ndarray]:
        x = np.column_stack([rng.normal(size=3 * count), rng.normal(0, 0.3, 3 * count)])
        off = np.arange(count) * 3 + rng.integers(0, 3, count)
        chosen = off if bottlenecked else off[rng.random(count) < 0.05]  # 5% of normal traces: one slow call
        x[chosen, 0] += rng.uniform(4, 8, len(chosen))
        if bottlenecked:
            x[chosen, 1] += rng.uniform(2, 4, len(chosen))
        return np.repeat(np.arange(count), 3), x

    def best_recall(deviations: tuple[str, ...]) -> float:
        vectorizer = TraceVectorizer(deviations=deviations, times=False).fit(np.array(["k"], dtype=object))

        def rows(count: int, bottlenecked: bool) -> np.ndarray:
            index, x = traces(count, bottlenecked)
            return vectorizer.transform(index, count, np.full(3 * count, "k", dtype=object), np.ones(3 * count),
                                        node_deviations(x, names, deviations))

        svm = TraceSVM(random_state=0).fit(np.vstack([rows(2000, False), rows(100, True)]), np.r_[np.zeros(2000), np.ones(100)])
        score = svm.decision_function(np.vstack([rows(2000, False), rows(20, True)]))
        y = np.r_[np.zeros(2000), np.ones(20)]
        order = np.argsort(-score)
        hits = np.cumsum(y[order])
        precise = hits / np.arange(1, len(y) + 1) >= 0.8
        return float(hits[precise].max() / y.sum()) if precise.any() else 0.0

    assert best_recall(("z_log_self_time_us", CONFIRMED)) >= 0.9
    assert best_recall(("z_log_self_time_us",)) < 0.5


def test_trace_svm_flags_a_fault_on_a_service_never_faulted_in_training():
    """Why the deviations are the trace's largest: trained on faults of service a only, the SVM
    still flags a trace whose service b is far off its baseline; with per-key deviation columns
    it does not (b's column never moved in training)."""
    rng = np.random.default_rng(0)
    known = np.array(["a\x1fop", "b\x1fop", "c\x1fop"], dtype=object)

    def traces(count: int, faulty: int | None) -> tuple:
        trace_index = np.repeat(np.arange(count), 3)
        keys = np.tile(known, count)
        z = rng.normal(size=(3 * count, 1))
        if faulty is not None:
            z[faulty::3, 0] += 20.0
        return trace_index, count, keys, np.exp(rng.normal(5, 0.1, 3 * count)), z

    flagged = {}
    for per_key in (False, True):
        vectorizer = TraceVectorizer(deviations=("z",), per_key_deviations=per_key).fit(known)
        X = np.vstack([vectorizer.transform(*traces(300, None)), vectorizer.transform(*traces(60, 0))])
        svm = TraceSVM(random_state=0).fit(X, np.r_[np.zeros(300), np.ones(60)])
        flagged[per_key] = svm.predict(vectorizer.transform(*traces(50, 1))).mean()
    assert flagged[False] > 0.9
    assert flagged[True] < 0.5


def _rpc_traces(count: int, rng: np.random.Generator, fault: tuple[str, str] | None = None,
                start: int = 0) -> dict[str, list]:
    """front calls a, b and c in turn, each through a client span (service front) over the
    callee's server span. `fault` = (service, "own") makes the callee's own time 20x;
    (service, "queue") makes its request wait 20x longer before its server span starts (a
    worker pool too small: its own time unchanged)."""
    spans: dict[str, list] = {key: [] for key in ("trace_id", "span_id", "parent_id", "service", "operation",
                                                  "start_ns", "duration_ns", "kind")}

    def add(trace: str, span: str, parent: str | None, service: str, operation: str, begin: float, duration: float,
            kind: str) -> None:
        for key, value in zip(spans, (trace, f"{trace}-{span}", parent and f"{trace}-{parent}", service, operation,
                                      int(begin * 1000), int(duration * 1000), kind)):
            spans[key].append(value)

    for t in range(start, start + count):
        trace, clock, children = f"q{t:05d}", 10.0, []
        for callee in ("a", "b", "c"):
            wait, own, back = rng.lognormal(np.log(20), 0.1), rng.lognormal(np.log(300), 0.1), rng.lognormal(np.log(20), 0.1)
            if fault == (callee, "own"):
                own *= 20
            if fault == (callee, "queue"):
                wait *= 20
            children.append((callee, clock, wait, own, back))
            clock += wait + own + back + 5
        add(trace, "r", None, "front", "GET /", 0, clock + 10, "server")
        for callee, begin, wait, own, back in children:
            add(trace, f"c-{callee}", "r", "front", f"{callee}.call", begin, wait + own + back, "client")
            add(trace, f"s-{callee}", f"c-{callee}", callee, f"{callee}.call", begin + wait, own, "server")
    return spans


def test_svm_path_names_a_queued_service_whose_own_time_is_unchanged():
    """Why the SVM path's culprit score reads the queue and the callers' gap: in a pool-limited
    service the requests wait before its server span starts, its own time unchanged. Scored by
    own time alone, the wait shows as the caller's client span's self time and the caller is
    blamed; `service_deviations` moves that gap to the callee and adds its queue, and a
    `CulpritScorer` trained on own-time faults of a and queue faults of b names c, queued,
    a service never faulted in training."""
    from dataclasses import replace


    rng = np.random.default_rng(0)
    encoder = FeatureEncoder().fit(assemble(span_table(_rpc_traces(200, rng))))
    base = tiny_detector()
    detector = replace(base, encoder=encoder, router=Router.everything())

    def features(spans: dict[str, list]) -> tuple[np.ndarray, list[str], np.ndarray]:
        forest = assemble(span_table(spans))
        x = encoder.transform(forest)
        codes, names = pd.factorize(forest.spans["service"].to_numpy(zero_copy_only=False))
        return detector.culprit_features(forest, x, codes, len(names)), list(names), forest

    queued, names, forest = features(_rpc_traces(30, rng, ("c", "queue"), start=1000))
    c, front = names.index("c"), names.index("front")
    own, queue, gap = (queued[:, c, j] for j in range(3))
    assert np.all(np.abs(own) < 5) and np.all(queue > 10) and np.all(gap > 10)
    assert np.all(np.abs(queued[:, front, 0]) < 5)  # the caller's own time: its gap is the callee's
    rows, labels = [], []
    for service, kind in (("a", "own"), ("b", "queue")):
        X, train_names, _ = features(_rpc_traces(40, rng, (service, kind), start=2000 if kind == "own" else 3000))
        rows.append(X.reshape(-1, 3))
        labels.append(np.tile(np.array(train_names) == service, len(X)))
    detector = replace(detector, culprit=CulpritScorer().fit(np.vstack(rows), np.concatenate(labels).astype(int)))
    served = detector.score(forest)
    assert served.to_svm.all()
    assert np.all(np.argmax(served.svm_service, axis=1) == served.services.index("c"))
    assert np.all(served.svm_service[:, served.services.index("c")] > 0.9)
    own_time_only = replace(detector, culprit=None).score(forest)  # a checkpoint saved before: own time
    assert not np.any(np.argmax(own_time_only.svm_service, axis=1) == own_time_only.services.index("c"))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12))
def test_service_deviations_of_some_traces_are_those_rows_of_all(chosen):
    """`Detector._culprit_scores` reads only the SVM-routed traces' nodes: the rows it gets are
    the rows of the whole forest's deviations, in the order asked."""
    rng = np.random.default_rng(len(chosen))
    forest = assemble(span_table(_rpc_traces(len(chosen), rng, ("b", "queue"))))
    x = FeatureEncoder().fit(assemble(span_table(_rpc_traces(50, rng)))).transform(forest)
    codes, names = pd.factorize(forest.spans["service"].to_numpy(zero_copy_only=False))
    kind = forest.spans["kind"].to_numpy(zero_copy_only=False)
    z_self, z_wait = x[:, 0].astype(np.float64), x[:, 1].astype(np.float64)
    everything = service_deviations(forest, codes, len(names), kind, z_self, z_wait)
    traces = np.flatnonzero(chosen)[::-1]
    some = service_deviations(forest, codes, len(names), kind, z_self, z_wait, traces)
    assert some.shape == (len(traces), len(names), 3)
    assert np.array_equal(some, everything[traces])


def test_culprit_scores_of_svm_routed_traces_do_not_depend_on_the_gnn_routed_ones():
    from dataclasses import replace

    rng = np.random.default_rng(3)
    merged = many_traces(6, slow=2)
    for t, leaves in enumerate(([150], [120, 4000], [90])):  # fewer services: under the cut below
        for key, values in star_trace(f"s{t}", leaves).items():
            merged[key].extend(values)
    spans = span_table(merged)
    scorer = CulpritScorer().fit(rng.normal(size=(60, 3)) + np.r_[np.zeros(40), np.full(20, 3.0)][:, None],
                                 np.r_[np.zeros(40), np.ones(20)].astype(int))
    detector = replace(tiny_detector(), culprit=scorer, router=Router.everything())
    everything = detector.score(assemble(spans))
    routed = detector.score(assemble(spans), all_models=True)
    assert np.array_equal(everything.svm_service, routed.svm_service)
    partly = replace(detector, router=Router(3, 1 << 30)).score(assemble(spans))
    assert partly.to_svm.sum() == 3
    rows = partly.to_svm
    assert np.array_equal(partly.svm_service[rows], everything.svm_service[rows])
    assert np.isnan(partly.svm_service[~rows]).all()


def test_trace_vectors_of_some_traces_are_those_rows_of_all():
    from dataclasses import replace

    from bmeg.graphs import node_services, operation_keys

    base = tiny_detector()
    vectorizer = TraceVectorizer(deviations=(*base.vectorizer.deviations, CONFIRMED), times=False, culprit_top=3)
    detector = replace(base, vectorizer=vectorizer.fit(np.asarray(base.vectorizer.keys, dtype=object)))
    forest = assemble(span_table(many_traces(7, slow=3)))
    x = detector.encoder.transform(forest)
    keys = operation_keys(forest, node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False))
    everything = detector.trace_vectors(forest, x, keys)
    assert everything.shape == (7, vectorizer.num_columns)
    # the history-confirmed own time: each trace's 3 largest min(self-time z, recent history)
    confirmed = np.minimum(x[:, detector.encoder.names.index("z_log_self_time_us")],
                           x[:, detector.encoder.names.index("recent_z_self_time")])
    first = 3 * len(DEVIATIONS)
    for trace in range(7):
        top = sorted(confirmed[forest.trace_index == trace].tolist(), reverse=True)[:3]
        assert everything[trace, first:first + len(top)] == pytest.approx(top, rel=1e-6)
    assert np.array_equal(detector.trace_vectors(forest, x, keys, np.array([5, 1, 3])), everything[[5, 1, 3]])


def test_detector_culprit_scorer_round_trips_and_older_checkpoints_load(tmp_path):
    from dataclasses import replace

    from bmeg.models.checkpoint import load_checkpoint, save_checkpoint
    from bmeg.models.detector import Detector

    rng = np.random.default_rng(1)
    scorer = CulpritScorer().fit(rng.normal(size=(60, 3)) + np.r_[np.zeros(40), np.full(20, 3.0)][:, None],
                                 np.r_[np.zeros(40), np.ones(20)].astype(int))
    detector = replace(tiny_detector(), culprit=scorer, router=Router.everything())
    detector.save(tmp_path / "new")
    again = Detector.load(tmp_path / "new", device="cpu", application="toy")
    assert again.culprit is not None and np.allclose(again.culprit.coef_, scorer.coef_)
    spans = span_table(many_traces(3, slow=1))
    assert np.allclose(again.score(assemble(spans)).svm_service, detector.score(assemble(spans)).svm_service)
    state = load_checkpoint(tmp_path / "new", application="toy")
    del state["culprit"]  # as a checkpoint written before the culprit scorer
    save_checkpoint(tmp_path / "old", state)
    old = Detector.load(tmp_path / "old", device="cpu", application="toy")
    assert old.culprit is None
    assert old.diagnose(spans).traces[1].bottlenecks[0].service == "svc1"  # own time against the baseline


def test_distinct_paths_and_router_reasons():
    spans = many_traces(2)
    for key, values in star_trace("fan", [10, 10, 10], operation="same").items():
        spans[key].extend(values)
    forest = assemble(span_table(spans))
    keys = np.char.add(forest.spans["service"].to_numpy(zero_copy_only=False).astype(str),
                       forest.spans["operation"].to_numpy(zero_copy_only=False).astype(str))
    assert distinct_paths(forest, keys).tolist() == [3, 3, 3]
    chain = {"trace_id": ["c"] * 3, "span_id": ["c1", "c2", "c3"], "parent_id": [None, "c1", "c2"],
             "service": ["a", "b", "c"], "operation": ["x"] * 3, "start_ns": [0, 10, 20], "duration_ns": [100, 50, 10]}
    assert distinct_paths(assemble(span_table(chain)), np.array(["a", "b", "c"], dtype=object)).tolist() == [1]
    router = Router(max_services=3, max_paths=2)
    assert router.to_svm(np.array([3, 3, 4]), np.array([2, 3, 1])).tolist() == [True, False, False]
    assert router.reasons(np.array([3, 3, 4]), np.array([2, 3, 1])) == [
        "svm: 3 services <= 3 and 2 distinct paths <= 2", "gnn: 3 distinct paths > 2", "gnn: 4 services > 3"]


def test_router_takes_the_svm_where_it_is_measurably_better_or_tied_and_cheaper():
    y = np.array([1, 0, 1, 0, 1, 0, 1, 0] * 8)
    services = np.array([2, 2, 2, 2, 9, 9, 9, 9] * 8)
    paths = np.array([1, 1, 1, 1, 5, 5, 5, 5] * 8)
    gnn = y.astype(bool)
    gnn_wrong_on_small = np.where(services <= 2, 1 - y, y).astype(bool)
    svm_good_on_small = np.where(services <= 2, y, 1 - y).astype(bool)
    all_named = {"gnn": np.ones(64), "svm": np.ones(64)}
    cheap_svm = {"gnn": 1e-3, "svm": 1e-4}

    def chosen(svm_verdict, named=all_named, cost=cheap_svm, gnn_verdict=gnn, tie_to_cheaper=True):
        return choose(y, {"gnn": gnn_verdict, "svm": svm_verdict}, named, services, paths, cost,
                      tie_to_cheaper=tie_to_cheaper)

    # as good as the GNN where it would go, and cheaper: tied on quality, the cheaper model takes them
    router, _, why = chosen(svm_good_on_small)
    assert router == Router(2, 1) and why.startswith("svm: tied on quality, cheaper: at most 2 services")
    assert chosen(svm_good_on_small, cost={"gnn": 1e-4, "svm": 1e-3})[0] == Router()  # tied but dearer: no
    # on decision traces that share the training faults a tie says nothing: the GNN stays
    router, _, why = chosen(svm_good_on_small, tie_to_cheaper=False)
    assert router == Router() and why.startswith("gnn: no cut")
    # better than the GNN on the small graphs: they go to the SVM, and the reason says so
    router, rows, why = chosen(svm_good_on_small, gnn_verdict=gnn_wrong_on_small)
    assert router == Router(2, 1) and why.startswith("svm: at most 2 services and 1 distinct paths")
    assert min(row["cost_s_per_trace"] for row in rows if row["quality"] == 1.0) == pytest.approx(0.5 * 1e-4 + 0.5 * 1e-3)
    assert chosen(np.zeros(64, dtype=bool))[0] == Router()  # cheaper but worse verdicts: never
    no_culprits = {"gnn": np.ones(64), "svm": np.zeros(64)}
    assert chosen(svm_good_on_small, no_culprits)[0] == Router()  # as good verdicts, worse culprits: never
    # better verdicts where the GNN's misses cost it the same culprits (culprit F1 0.5 both on these traces):
    # but the two claim different traces, and in resamples of 64 traces the cut's culprit F1 falls more than
    # the tolerance below the GNN's too often to be shown tied: the GNN stays
    router, _, why = chosen(svm_good_on_small, no_culprits, gnn_verdict=gnn_wrong_on_small)
    assert router == Router() and "nor is a cheaper cut shown tied with it" in why


def test_router_needs_a_margin_above_the_tolerance_and_never_trades_quality_for_cost():
    """The decision bench/router.py re-measured on fresh fault draws (docs/issue-17.md): the SVM
    takes traces only when a cut beats the GNN alone by more than `tolerance`; a cut inside the
    tolerance, however much cheaper, leaves every trace on the GNN."""
    y = np.array([1] * 100 + [0] * 100)
    services = np.array([2] * 100 + [9] * 100)
    paths = np.ones(200, dtype=np.int64)
    gnn = y.astype(bool)
    gnn_named = (np.arange(200) % 10 != 0).astype(float)  # the GNN names one culprit in ten wrong: culprit F1 0.9
    cheap_svm = {"gnn": 1e-3, "svm": 1e-5}
    svm_named = np.ones(200)  # the SVM names them all right: the small cut's culprit F1 is 1.0
    svm = np.where(services <= 2, y, 1).astype(bool)  # ... and flags every large trace: trace F1 2/3 sending those

    def chosen(tolerance):
        named = {"gnn": gnn_named, "svm": svm_named}
        return choose(y, {"gnn": gnn, "svm": svm}, named, services, paths, cheap_svm, tolerance)[0]

    assert chosen(0.05) == Router(2, 1)  # beyond it: the small traces go to the SVM
    # 1.0 - 0.9 = 0.1 is inside a tolerance of 0.2: no lead, so a tie, and the GNN is not ahead in it: the cheaper SVM
    assert chosen(0.2) == Router(2, 1)
    # ... but a cut 0.1 worse, though inside the tolerance, is one the GNN beats in every resample: the GNN stays
    worse = {"gnn": svm_named, "svm": gnn_named}
    assert choose(y, {"gnn": gnn, "svm": np.where(services <= 2, y, 1).astype(bool)}, worse, services, paths,
                  cheap_svm, 0.2)[0] == Router()
    # an exact tie on both verdicts and culprits: the cheaper model, everywhere
    assert choose(y, {"gnn": gnn, "svm": gnn}, {"gnn": svm_named, "svm": svm_named}, services, paths,
                  cheap_svm)[0] == Router(9, 1)


def test_router_keeps_the_gnn_where_the_svm_names_culprits_with_scores_too_low_to_act_on():
    """The closed loop's case (docs/issue-17.md): on held-out faults the SVM flagged traces as
    the GNN did and ranked the right service first, but scored it 0.13, and the loop's planner,
    weighing the blame by that score, acted on nothing. `choose` reads whatever credit it is
    given; the pipeline's (`named_culprit`) is 0 for a blame scored under the actionable floor
    and 1 above it, whatever the model's scale (tests/test_training_router.py)."""
    y = np.array([1] * 100 + [0] * 100)
    services, paths = np.full(200, 3), np.full(200, 2)
    verdicts = {"gnn": y.astype(bool), "svm": y.astype(bool)}
    cheap_svm = {"gnn": 1e-3, "svm": 1e-5}
    gnn_named = np.where(np.arange(200) % 2 == 0, 0.9, 0.0)  # right half the time, scored 0.9
    assert choose(y, verdicts, {"gnn": gnn_named, "svm": np.full(200, 0.13)}, services, paths, cheap_svm)[0] == Router()
    assert choose(y, verdicts, {"gnn": gnn_named, "svm": np.full(200, 0.95)}, services, paths, cheap_svm)[0] == Router(3, 2)


def _per_source_case(recalls: dict[str, tuple[int, int]], traces: dict[str, int], normal: int = 0):
    """Decision traces of fault sources (`traces` bottlenecked each) that both models flag, the
    GNN naming `recalls[source][0]` of a source's culprits, the SVM `recalls[source][1]`, and
    `normal` normal traces neither flags."""
    sources = np.array([source for source, n in traces.items() for _ in range(n)] + [""] * normal, dtype=object)
    y = (sources != "").astype(np.int64)
    rank = np.r_[np.concatenate([np.arange(n) for n in traces.values()]), np.zeros(normal)]
    named = {model: np.array([float(rank[t] < recalls[source][column]) if source else 0.0
                              for t, source in enumerate(sources)]) for column, model in enumerate(("gnn", "svm"))}
    return y, sources, {"gnn": y.astype(bool), "svm": y.astype(bool)}, named


def test_the_uniform_mix_trades_a_loss_on_one_source_for_larger_gains_on_the_others():
    """Issue 17, session 14 (the lead's decision): a per-source loss may be traded for gains
    elsewhere, as a mean over the sources weighs them; trainticket 0.3's shape (session 13):
    worse on one source, far better on two."""
    y, sources, verdicts, named = _per_source_case({"background": (90, 80), "interference": (50, 90),
                                                    "network": (50, 90)}, dict.fromkeys(
                                                       ("background", "interference", "network"), 100), normal=300)
    services, paths, cost = np.full(len(y), 3), np.full(len(y), 2), {"gnn": 1e-3, "svm": 1e-5}
    router, rows, why = choose(y, verdicts, named, services, paths, cost, sources=sources)
    assert router == Router(3, 2) and why.startswith("svm: at most 3 services and 2 distinct paths, by the lead under "
                                                     "a uniform mix of fault sources: culprit F1 0.867 against "
                                                     "the GNN alone's 0.633 (under a uniform mix of 3 fault sources")
    assert "worse on faults of {'background': '0.800 against 0.900 on 100 traces" in why and "traded" in why
    # the same loss against gains too small to outweigh it: the GNN stays
    y, sources, verdicts, named = _per_source_case({"background": (90, 60), "interference": (50, 55),
                                                    "network": (50, 55)}, dict.fromkeys(
                                                       ("background", "interference", "network"), 100), normal=300)
    router, _, why = choose(y, verdicts, named, services, paths, cost, sources=sources)
    assert router == Router() and why.startswith("gnn: no cut that flags traces as well") and "3 fault sources" in why


def test_the_draws_own_mix_of_sources_decides_nothing():
    """The SVM far better on the common source, worse on the rarer one: on the draw's own mix
    (300 to 100) it leads, 0.75 against 0.575; each source weighed alike it trails, 0.5 against
    0.65, whichever source the draw holds more of."""
    services, paths, cost = np.full(400, 3), np.full(400, 2), {"gnn": 1e-3, "svm": 1e-5}
    for saturation, misconfiguration in ((300, 100), (100, 300)):
        y, sources, verdicts, named = _per_source_case(
            {"saturation": (saturation // 2, saturation), "misconfiguration": (misconfiguration * 8 // 10, 0)},
            {"saturation": saturation, "misconfiguration": misconfiguration})
        router, rows, why = choose(y, verdicts, named, services, paths, cost, sources=sources)
        assert router == Router() and rows[-1]["quality"] == pytest.approx(0.5)
        assert rows[0]["quality"] == pytest.approx(0.65)
    # without sources, one source: the pooled lead of the first draw decides
    y, sources, verdicts, named = _per_source_case({"saturation": (150, 300), "misconfiguration": (80, 0)},
                                                   {"saturation": 300, "misconfiguration": 100})
    assert choose(y, verdicts, named, services, paths, cost)[0] == Router(3, 2)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(15, 60), st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=5),
       st.integers(0, 3), st.integers(0, 80), st.integers(0, 40), st.integers(0, 2**31 - 1))
def test_the_uniform_mix_is_the_mean_of_each_source_alone_at_the_draws_imbalance(per_source, small, normal,
                                                                                 false_alarms, seed):
    """`uniform_mix_culprit_f1` against a direct computation: per source, the plain culprit F1
    of its bottlenecked traces, weighed up to all of the mixed ones, beside every normal trace;
    then the mean. A source under `MIN_SOURCE_TRACES` takes no part."""
    from bmeg.models.router import MIN_SOURCE_TRACES, _culprit_f1, mixed_sources, source_codes, uniform_mix_culprit_f1

    rng = np.random.default_rng(seed)
    sizes = [n for n, _, _ in per_source] + ([small] if small else [])
    sources = np.array([f"s{i}" for i, n in enumerate(sizes) for _ in range(n)] + [""] * normal, dtype=object)
    y = (sources != "").astype(np.int64)
    predicted = np.r_[np.concatenate([rng.random(n) < p for n, p, _ in per_source] + [np.ones(small, dtype=bool)]),
                      np.arange(normal) < false_alarms]
    right = np.r_[np.concatenate([(rng.random(n) < r).astype(float) for n, _, r in per_source] + [np.ones(small)]),
                  np.zeros(normal)]
    weights = rng.uniform(0.5, 2.0, len(y))
    codes = source_codes(y, sources)
    assert mixed_sources(codes) == len(per_source) and np.all(codes[len(y) - normal - small:len(y) - normal] == -2)
    mixed = (y == 1) & (codes >= 0)
    direct = []
    for i in range(len(per_source)):
        own = sources == f"s{i}"
        scaled = np.where(own, weights * np.sum(weights[mixed]) / np.sum(weights[own]), weights)
        keep = own | (y == 0)
        direct.append(_culprit_f1(y[keep], predicted[keep], right[keep], scaled[keep]))
    assert uniform_mix_culprit_f1(codes, predicted, right, weights) == pytest.approx(float(np.mean(direct)))
    assert small < MIN_SOURCE_TRACES


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), min_size=2, max_size=4), st.integers(1, 100))
def test_a_loss_on_one_source_is_outweighed_exactly_when_the_mean_over_sources_says(recalls, loss):
    """Sources of 200 bottlenecked traces, both models flagging all of them (culprit F1 = culprit
    recall per source), the SVM `loss` of 200 culprits worse on the first: the SVM is taken when
    its mean recall over the sources leads by 0.1 or more, kept out when it trails by more than
    the tolerance, whatever the single sources do."""
    gnn = [(min(g + loss, 200), s) for g, s in recalls[:1]] + recalls[1:]
    table = {f"s{i}": (g, max(g - loss, 0) if i == 0 else s) for i, (g, s) in enumerate(gnn)}
    y, sources, verdicts, named = _per_source_case(table, dict.fromkeys(table, 200))
    services, paths, cost = np.full(len(y), 3), np.full(len(y), 2), {"gnn": 1e-3, "svm": 1e-5}
    router, rows, why = choose(y, verdicts, named, services, paths, cost, sources=sources)
    lead = float(np.mean([s - g for g, s in table.values()])) / 200
    assert rows[-1]["quality"] - rows[0]["quality"] == pytest.approx(lead)
    if lead >= 0.1:
        assert router == Router(3, 2) and "by the lead under a uniform mix" in why
    if lead < -0.01:
        assert router == Router()


def test_a_lead_that_a_resample_of_few_traces_undoes_is_a_tie_and_goes_to_the_cheaper_model():
    y = np.array([1] * 6 + [0] * 6)
    services, paths = np.full(12, 3), np.full(12, 2)
    verdicts = {"gnn": y.astype(bool), "svm": y.astype(bool)}
    gnn_named = np.array([1.0] * 5 + [0.0] * 7)  # five of six culprits right against the SVM's six
    named = {"gnn": gnn_named, "svm": np.ones(12)}
    router, _, why = choose(y, verdicts, named, services, paths, {"gnn": 1e-3, "svm": 1e-5}, tie_to_cheaper=False)
    assert router == Router() and "not reliably better" in why
    assert "not reliably better" in Router(why=why).reasons(np.array([3]), np.array([2]))[0]
    router, _, why = choose(y, verdicts, named, services, paths, {"gnn": 1e-3, "svm": 1e-5})
    assert router == Router(3, 2) and why.startswith("svm: tied on quality, cheaper") and "in 100% of" in why
    # the other way round (the GNN names six, the SVM five) is no tie, though the GNN's lead holds
    # in only about 2 of 3 resamples: a cut whose culprit F1 is below the GNN's by more than the
    # tolerance (0.833 against 1.0) is not taken for its cost
    router, _, why = choose(y, verdicts, {"gnn": np.ones(12), "svm": gnn_named}, services, paths,
                            {"gnn": 1e-3, "svm": 1e-5})
    assert router == Router() and "nor is a cheaper cut shown tied with it" in why


@settings(max_examples=12, deadline=None)
@given(disagree=st.integers(3, 8), shared=st.integers(0, 10), missed=st.integers(0, 10),
       false_alarms=st.integers(0, 30), normal=st.integers(200, 1000))
def test_a_tie_needs_the_cut_shown_no_worse_not_merely_the_gnn_not_shown_ahead(disagree, shared, missed,
                                                                              false_alarms, normal):
    """docs/issue-17.md, session 12: at imbalance 0.01 the router's decision traces hold 50
    bottlenecked traces, on which neither model is ahead in 95% of the resamples whatever the
    two do; the rule before took that as a tie and gave every trace to the cheaper SVM. Equal
    point figures, the two naming the culprits of different traces right: the resamples show
    neither ahead, nor the cut no worse: the GNN stays, and says so. The same traces with the
    SVM naming what the GNN names: shown no worse in every resample, a tie, the cheaper SVM."""
    from bmeg.models.router import _bootstrap_shares, source_codes

    bottlenecked = 2 * disagree + shared + missed
    y = np.r_[np.ones(bottlenecked), np.zeros(normal)].astype(np.int64)
    flagged = np.r_[np.ones(bottlenecked, dtype=bool), np.arange(normal) < false_alarms]
    gnn_named = np.r_[np.ones(disagree), np.zeros(disagree), np.ones(shared), np.zeros(missed + normal)]
    svm_named = np.r_[np.zeros(disagree), np.ones(disagree), np.ones(shared), np.zeros(missed + normal)]
    services, paths = np.full(len(y), 3), np.full(len(y), 2)
    verdicts, cost = {"gnn": flagged, "svm": flagged}, {"gnn": 1e-3, "svm": 1e-5}
    _, no_worse, behind = _bootstrap_shares(y, np.ones(len(y)), source_codes(y, np.full(len(y), "")),
                                            (flagged, svm_named), (flagged, gnn_named), 0.01, 0)
    assert behind < 0.95 and no_worse < 0.95
    router, _, why = choose(y, verdicts, {"gnn": gnn_named, "svm": svm_named}, services, paths, cost)
    assert router == Router() and "nor is a cheaper cut shown tied with it" in why and "the nearest, 3 services" in why
    router, _, why = choose(y, verdicts, {"gnn": gnn_named, "svm": gnn_named}, services, paths, cost)
    assert router == Router(3, 2) and why.startswith("svm: tied on quality, cheaper") and "in 100% of" in why


def _history_of(detector, traces: int) -> StreamHistory:
    history = StreamHistory(visits=detector.encoder.history)
    detector.diagnose(span_table(many_traces(traces)), history=history)
    return history


@pytest.mark.parametrize("router", [Router(), Router.everything()], ids=["gnn", "svm"])
def test_a_verdict_does_not_depend_on_the_batch(router):
    from dataclasses import replace

    detector = replace(tiny_detector(), router=router)
    history = _history_of(detector, 12)
    spans = many_traces(6, slow=2)
    for t, key in enumerate(spans["trace_id"]):  # later than the history
        spans["start_ns"][t] += 10**12
    table = span_table(spans)
    batch = detector.diagnose(table, history=history.copy())
    alone = [detector.diagnose(table.filter(pc.equal(table["trace_id"], trace.trace_id)), history=history.copy()).traces[0]
             for trace in batch.traces]
    for together, single in zip(batch.traces, alone):
        assert (together.anomalous, together.model, together.route) == (single.anomalous, single.model, single.route)
        assert together.anomaly_score == pytest.approx(single.anomaly_score, abs=1e-6)
        assert [(s.service, s.bottleneck) for s in together.bottlenecks] == [(s.service, s.bottleneck) for s in single.bottlenecks]
    # no hidden state: the same call twice gives the same answer
    assert detector.diagnose(table, history=history.copy()) == batch
    assert detector.diagnose(table) == detector.diagnose(table)


def test_the_history_is_read_and_recorded():
    detector = tiny_detector()
    history = StreamHistory(visits=detector.encoder.history)
    detector.diagnose(span_table(many_traces(4, slow=1)), history=history)
    assert set(history.z_self) == {"front", "svc0", "svc1", "svc2"} and len(history.z_self["svc1"]) == 4
    forest = assemble(span_table(many_traces(1)))
    quiet = detector.encoder.transform(forest, past={})[:, -1]
    after_slow = detector.encoder.transform(forest, past={"svc1": np.array([40.0, 40.0])})[:, -1]
    assert not np.allclose(quiet, after_slow)  # the temporal feature reads the history


def test_a_trace_after_its_past_reads_as_in_a_replay():
    """The temporal feature of a trace given its stream's past equals the replay over the whole stream."""
    encoder = FeatureEncoder(history=5).fit(assemble(span_table(many_traces(20))))
    spans = many_traces(9, slow=4)
    forest = assemble(span_table(spans))
    replay = encoder.transform(forest)[:, -1]
    z = encoder.transform(forest)[:, encoder.names.index("z_log_self_time_us")]
    services = forest.spans["service"].to_numpy(zero_copy_only=False)
    last = forest.trace_index == forest.num_traces - 1
    past = {name: z[(services == name) & ~last] for name in set(services)}  # forest order is time order here
    alone = assemble(span_table({key: [v for v, t in zip(values, spans["trace_id"]) if t == "t0008"]
                                 for key, values in spans.items()}))
    assert np.allclose(encoder.transform(alone, past=past)[:, -1], replay[last])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(["a", "b"]), st.sampled_from(["get", "put", "scan"])),
                min_size=1, max_size=30))
def test_repeated_share_counts_the_children_whose_key_a_sibling_also_has(tree):
    """`repeated_share`: per span, the share of its children whose (service, operation) an
    earlier sibling already has (children - distinct keys), over the children."""
    parents = [None] + [f"s{index % (row + 1)}" for row, (index, _, _) in enumerate(tree[1:])]
    table = span_table({
        "trace_id": ["t"] * len(tree), "span_id": [f"s{row}" for row in range(len(tree))], "parent_id": parents,
        "service": [service for _, service, _ in tree], "operation": [operation for _, _, operation in tree],
        "start_ns": [1_000 + row for row in range(len(tree))], "duration_ns": [100_000 - 2 * row for row in range(len(tree))],
    })
    forest = assemble(table)
    share = features._columns(forest, critical_paths(forest))["repeated_share"]
    for row in range(forest.num_spans):
        keys = [(forest.spans["service"][c].as_py(), forest.spans["operation"][c].as_py())
                for c in np.flatnonzero(forest.parent == row)]
        assert share[row] == ((len(keys) - len(set(keys))) / len(keys) if keys else 0.0)


def test_a_fault_source_blocks_the_svm_only_on_a_loss_that_resampling_keeps():
    """The per-source check (docs/issue-17.md, session 8 second round; since session 14 only on
    the sources the decision draws lack, `pipeline._uncovered_sources_check`): one culprit in 30
    named worse (0.033) is noise and the cut stands; the same share on 1,500 traces, or a loss
    of 0.45 on 30, holds in the resamples and keeps the GNN."""
    from bmeg.models.router import checked_sources, source_losses, worse_sources

    def case(n_source, gnn_right, svm_right):
        y = np.array([1] * (300 + n_source) + [0] * 300)
        sources = np.array(["saturation"] * 300 + ["network"] * n_source + [""] * 300, dtype=object)
        verdict = y.astype(bool)
        gnn = np.where(sources == "network", np.arange(len(y)) % n_source < gnn_right * n_source, 0.0)
        gnn[:300] = np.arange(300) % 2  # on saturation the GNN names half
        svm = np.where(sources == "network", np.arange(len(y)) % n_source < svm_right * n_source, 1.0)
        svm[300 + n_source:] = 0.0
        return y, sources, verdict, gnn.astype(float), svm.astype(float)

    for n_source, gnn_right, svm_right, blocked in ((30, 1.0, 29 / 30, False), (1500, 1.0, 0.96, True),
                                                    (30, 1.0, 0.55, True), (30, 0.9, 1.0, False)):
        y, sources, verdict, gnn, svm = case(n_source, gnn_right, svm_right)
        losses = source_losses(y, (verdict, svm * (y == 1)), (verdict, gnn * (y == 1)), np.ones(len(y)), sources,
                               0.01, 0)
        assert set(losses) == ({"network"} if svm_right < gnn_right - 0.01 else set())
        worse = worse_sources(losses, 0.95, checked_sources(y, sources))
        assert ("network" in worse) == blocked, (n_source, svm_right, worse)
        assert "saturation" not in worse


def test_a_loss_on_a_fault_source_of_a_handful_of_traces_does_not_block_the_svm():
    """The testbed's case (docs/issue-17.md, session 9): the SVM named none of 3
    code+misconfiguration culprits that the GNN named, a loss every resample of 3 traces keeps,
    and that blocked a cut ahead on 700 other traces. Below `MIN_SOURCE_TRACES` a source's loss
    is reported, not blocking, and the uniform mix leaves it out; from it on, the same loss
    blocks, and in the uniform mix it outweighs the gain on the other source (0.5 against 0.75)."""
    from bmeg.models.router import MIN_SOURCE_TRACES, checked_sources, source_losses, worse_sources

    for n_small, blocked in ((3, False), (MIN_SOURCE_TRACES - 1, False), (MIN_SOURCE_TRACES, True)):
        y = np.array([1] * (300 + n_small) + [0] * 300)
        sources = np.array(["network"] * 300 + ["code+misconfiguration"] * n_small + [""] * 300, dtype=object)
        verdict = y.astype(bool)
        gnn = np.where(sources == "network", np.arange(len(y)) % 2, 1.0) * (y == 1)  # half of network, all of the small one
        svm = np.where(sources == "network", 1.0, 0.0)  # all of network, none of the small one
        losses = source_losses(y, (verdict, svm), (verdict, gnn), np.ones(len(y)), sources, 0.01, 0)
        assert losses["code+misconfiguration"]["held"] == 1.0 and losses["code+misconfiguration"]["traces"] == n_small
        assert ("code+misconfiguration" in worse_sources(losses, 0.95, checked_sources(y, sources))) == blocked
        router, _, why = choose(y, {"gnn": verdict, "svm": verdict}, {"gnn": gnn, "svm": svm}, np.full(len(y), 3),
                                np.full(len(y), 2), {"gnn": 1e-3, "svm": 1e-5}, sources=sources)
        assert (router == Router()) == blocked, why
        assert why.startswith("gnn: no cut" if blocked else "svm: at most 3 services")


def test_the_per_source_checks_block_a_cut_no_worse_anywhere_no_more_often_than_one_check_would():
    """Holm's step-down over the sources checked (docs/issue-17.md, session 13): each source's
    check is a test that can block, so 5 of them blocked a cut as good as the GNN on every source
    more often than the 5% one test allows. A placebo: two models naming each culprit with the
    same chance, independently, on 5 sources of 100 bottlenecked traces, 400 draws."""
    from bmeg.models.router import checked_sources, source_losses, worse_sources

    sources = np.repeat(np.array([f"source {i}" for i in range(5)], dtype=object), 100)
    y, verdict = np.ones(len(sources), dtype=np.int64), np.ones(len(sources), dtype=bool)
    assert checked_sources(y, sources) == 5
    blocked = {"holm": 0, "each alone": 0}
    for draw in range(400):
        rng = np.random.default_rng(draw)
        gnn, svm = ((rng.random(len(y)) < 0.8).astype(float) for _ in range(2))
        losses = source_losses(y, (verdict, svm), (verdict, gnn), np.ones(len(y)), sources, 0.01, draw)
        blocked["holm"] += bool(worse_sources(losses, 0.95, checked_sources(y, sources)))
        blocked["each alone"] += bool(worse_sources(losses, 0.95, 1))
    assert blocked["holm"] <= 0.05 * 400 < blocked["each alone"], blocked


def test_holms_step_down_asks_the_most_of_the_loss_held_most_often():
    """The loss held in most resamples must hold in 1 - 0.05 / k of them (k sources checked),
    the next in 1 - 0.05 / (k - 1), ...; one source checked: 95% as before. A source of fewer
    than `MIN_SOURCE_TRACES` traces is not one of the k that can block."""
    from bmeg.models.router import MIN_SOURCE_TRACES, worse_sources

    def loss(held, traces=100.0):
        return {"cut": 0.80, "gnn": 0.85, "traces": traces, "held": held}

    assert set(worse_sources({"background": loss(0.97)}, 0.95, 1)) == {"background"}
    assert worse_sources({"background": loss(0.97)}, 0.95, 5) == {}  # needs 99%
    both = {"network": loss(1.0), "background": loss(0.985)}
    assert set(worse_sources(both, 0.95, 5)) == {"network"}  # then 1 - 0.05 / 4 = 98.75%
    assert set(worse_sources(both, 0.95, 2)) == {"network", "background"}  # then 95%
    assert "needs 99%" in worse_sources(both, 0.95, 5)["network"]
    tiny = {"code": loss(1.0, MIN_SOURCE_TRACES - 1), "background": loss(0.97)}
    assert worse_sources(tiny, 0.95, 1) == worse_sources({"background": loss(0.97)}, 0.95, 1)
