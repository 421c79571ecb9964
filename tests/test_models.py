"""Models, features, checkpoints and metrics on small hand-made and generated inputs."""

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GCNConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm

from bmeg.graphs import assemble
from bmeg.models.adjacency import gcn_adjacency
from bmeg.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from bmeg.models.dgcnn import DGCNN
from bmeg.models.features import FeatureEncoder
from bmeg.models.gcn_node import GCNNodeClassifier
from bmeg.models.svm import PATH, START, FirmSVM, firm_features
from bmeg.models.graphset import GraphSet
from bmeg.training.metrics import accuracy_at_k, average_at_k, classification_table, threshold_for_precision
from bmeg.traces import span_table


def star_trace(trace_id: str, leaf_us: list[int], operation: str = "op") -> dict[str, list]:
    """A root with one child per entry of `leaf_us`, run one after the other."""
    spans = {"trace_id": [], "span_id": [], "parent_id": [], "service": [], "operation": [], "start_ns": [], "duration_ns": []}
    total = sum(leaf_us) + 10
    rows = [("r", None, "front", "GET /", 0, total * 1000)]
    start = 5
    for i, us in enumerate(leaf_us):
        rows.append((f"c{i}", "r", f"svc{i}", operation, start * 1000, us * 1000))
        start += us
    for span_id, parent, service, op, begin, duration in rows:
        for key, value in zip(spans, (trace_id, f"{trace_id}-{span_id}", parent and f"{trace_id}-{parent}", service, op, begin, duration)):
            spans[key].append(value)
    return spans


def many_traces(n: int, slow: int | None = None) -> dict[str, list]:
    merged: dict[str, list] = {}
    for t in range(n):
        leaf = [100 + t % 7, 200 + t % 5, 50]
        if slow is not None and t == slow:
            leaf[1] = 5000
        for key, values in star_trace(f"t{t:04d}", leaf).items():
            merged.setdefault(key, []).extend(values)
    return merged


def test_dgcnn_and_gcn_shapes():
    graphs = [Data(x=torch.randn(n, 6), edge_index=torch.tensor([[0] * (n - 1), list(range(1, n))])) for n in (2, 12, 40)]
    batch = Batch.from_data_list(graphs)
    assert DGCNN(6, k=10)(batch.x, batch.edge_index, batch.batch).shape == (3, 2)
    assert GCNNodeClassifier(6)(batch.x, batch.edge_index).shape == (54, 2)
    with pytest.raises(ValueError, match="too small"):
        DGCNN(6, k=4)


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


def _tiny_detector():
    from bmeg.models.detector import Detector

    from bmeg.models.router import Router
    from bmeg.models.svm import TraceSVM, TraceVectorizer

    forest = assemble(span_table(many_traces(20)))
    encoder = FeatureEncoder().fit(forest)
    rng = np.random.default_rng(0)
    firm = FirmSVM().fit(rng.normal(size=(40, 2)), np.r_[np.zeros(30), np.ones(10)])
    keys = np.char.add(np.char.add(forest.spans["service"].to_numpy(zero_copy_only=False).astype(str), "\x1f"),
                       forest.spans["operation"].to_numpy(zero_copy_only=False).astype(str))
    vectorizer = TraceVectorizer().fit(keys)
    svm = TraceSVM().fit(rng.normal(size=(40, vectorizer.num_columns)), np.r_[np.zeros(30), np.ones(10)])
    return Detector(
        application="toy", encoder=encoder, dgcnn=DGCNN(encoder.num_features, k=10).eval(),
        gcn=GCNNodeClassifier(encoder.num_features).eval(), vectorizer=vectorizer, svm=svm, firm=firm,
        thresholds={"graph": 0.5, "node": 0.5, "svm": 0.5, "svm_node": 0.5}, router=Router(), firm_window=20,
        services=["front", "svc0", "svc1", "svc2"], service_baseline_us={"svc1": 200.0},
        hparams={"dgcnn": {"k": 10}, "gcn": {}}, metrics={},
    )


def test_detector_round_trip_and_diagnosis(tmp_path):
    from bmeg.models.detector import Detector

    _tiny_detector().save(tmp_path)
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
    diagnosis = _tiny_detector().diagnose(span_table(spans))
    warnings = " ".join(diagnosis.traces[0].warnings)
    assert "brand-new-service" in warnings and "parent" in warnings


def test_checkpoint_with_other_features_is_rejected(tmp_path):
    from bmeg.models.detector import Detector

    _tiny_detector().save(tmp_path)
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    state["encoder"]["names"] = state["encoder"]["names"][:-1]
    torch.save(state, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="differ from this bmeg"):
        Detector.load(tmp_path)
