"""The `relative` node features (the same meaning in every application) and the window scores
of the rca rankers (visit- and baseline-normalised, combined by rank)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.models.window import culprit_vote_shift, culprit_votes, node_score_shift, rank_fusion, standardised_fusion
from bmeg.faultinject import Fault, parse_topology, simulate, spans_of
from bmeg.graphs.rpc import rpc_view
from bmeg.graphs import assemble
from bmeg.models.features import FeatureEncoder
from builders import SHOP_SPEC


@pytest.fixture(scope="module")
def shop():
    topology = parse_topology(SHOP_SPEC)
    normal = rpc_view(spans_of(simulate(topology, [], 5, 1)))
    slow = rpc_view(spans_of(simulate(topology, [Fault("pay", "interference", "single", 0.0, 5.0, {"factor": 5.0})], 5, 2)))
    return normal, slow


def frame(forest, encoder) -> pd.DataFrame:
    table = pd.DataFrame(encoder.transform(forest), columns=encoder.names)
    table["service"] = forest.spans["service"].to_numpy(zero_copy_only=False)
    return table


def test_relative_features_sit_at_zero_on_normal_traffic_and_move_at_the_slow_service(shop):
    normal, slow = shop
    encoder = FeatureEncoder("relative").fit(normal)
    assert encoder.num_features == len(encoder.names) == 13
    assert not any("log_duration_us" == name or name.startswith("log_") for name in encoder.names)  # no absolute time
    # no raw share either: where time is usually spent is not what changed
    assert not {"cp_share", "explained_share"} & set(encoder.names)
    healthy = frame(normal, encoder)
    assert np.isfinite(healthy[encoder.names].to_numpy()).all()
    assert abs(healthy["z_log_self_time_us"].median()) < 0.1 and healthy["z_log_self_time_us"].abs().median() < 1
    assert (healthy[["children_delta", "repeated_delta", "error"]] == 0).all().all()
    faulty = frame(slow, encoder).groupby("service")["z_log_self_time_us"].median()
    assert faulty.idxmax() == "pay" and faulty["pay"] > 3


def test_missing_repeated_children_and_errors_show_against_the_operations_pattern(shop):
    normal, _ = shop
    encoder = FeatureEncoder("relative").fit(normal)
    spans = normal.spans
    trace = spans["trace_id"][0].as_py()
    in_trace = pc.equal(spans["trace_id"], trace)
    one = spans.filter(in_trace)
    services = one["service"].to_pylist()
    # drop pay's spans (a missing call), repeat cart's (a retry), and mark the root an error
    kept = one.filter(pc.invert(pc.equal(one["service"], "pay")))
    cart = one.filter(pc.equal(one["service"], "cart"))
    retry = cart.set_column(cart.schema.get_field_index("span_id"), cart.schema.field("span_id"),
                            pa.array([f"{s}-retry" for s in cart["span_id"].to_pylist()]))
    changed = pa.concat_tables([kept, retry])
    is_root = pc.is_null(changed["parent_id"])
    changed = changed.set_column(changed.schema.get_field_index("status"), changed.schema.field("status"),
                                 pc.if_else(is_root, "error", changed["status"]))
    assert "pay" in services
    features = frame(assemble(changed), encoder)
    web = features[features["service"] == "web"]
    assert web["error"].iloc[0] == 1.0 and (features["error"] == 0).sum() == len(features) - 1
    # web's client span to cart now has two cart children where it always had one...
    assert (web["repeated_delta"] > 0).sum() == 1 and (web["children_delta"] > 0).sum() == 1
    # ...and its client span to pay none: a missing call
    assert (web["children_delta"] < 0).sum() == 1
    assert web["error_origin"].iloc[0] == 1.0  # the root's error begins there: no child has one


def test_an_error_begins_where_no_child_has_one(shop):
    """An exception in cart, recorded by every caller above it: only cart's span is its origin."""
    normal, _ = shop
    encoder = FeatureEncoder("relative").fit(normal)
    one = normal.spans.filter(pc.equal(normal.spans["trace_id"], normal.spans["trace_id"][0]))
    forest = assemble(one)
    failed = forest.spans["service"].to_numpy(zero_copy_only=False) == "cart"
    for row in np.argsort(-forest.depth, kind="stable"):  # children before parents
        if failed[row] and forest.parent[row] >= 0:
            failed[forest.parent[row]] = True
    status = pa.array(np.where(failed, "error", "unset").astype(object), pa.string())
    table = forest.spans.set_column(forest.spans.schema.get_field_index("status"), "status", status)
    features = frame(assemble(table), encoder)
    assert features["error"].sum() >= 2  # cart and its callers
    assert features.loc[features["error_origin"] == 1.0, "service"].tolist() == ["cart"]


@settings(max_examples=10, deadline=None)
@given(scale=st.sampled_from([0.1, 3.0, 20.0]))
def test_relative_features_do_not_depend_on_the_applications_time_scale(shop, scale):
    """Every time of an application multiplied by `scale` (a slower machine, another
    application): fitted on its own normal traces, the features read the same."""
    normal, slow = shop

    def scaled(forest):
        table = forest.spans
        for name in ("start_ns", "duration_ns"):
            values = pc.multiply(pc.cast(table[name], pa.float64()), scale)
            table = table.set_column(table.schema.get_field_index(name), table.schema.field(name),
                                     pc.cast(pc.round(values), pa.int64()))
        return assemble(table)

    original = FeatureEncoder("relative").fit(normal).transform(slow)
    rescaled = FeatureEncoder("relative").fit(scaled(normal)).transform(scaled(slow))
    # log1p(µs) is log(µs) within 1/µs: times of a few µs after scaling 0.1 differ a little
    assert np.median(np.abs(rescaled - original)) < 0.02
    assert np.quantile(np.abs(rescaled - original), 0.95) < 0.3


def test_window_score_does_not_reward_visits_or_a_high_normal_level():
    # "big" is visited 10 times a trace and always scores high; "db" once and jumps in the window
    normal = SimpleNamespace(gnn_node=np.r_[np.full(10, 0.8), 0.1], node_services=np.array(["big"] * 10 + ["db"]))
    window = SimpleNamespace(gnn_node=np.r_[np.full(10, 0.85), 0.6], node_services=np.array(["big"] * 10 + ["db"]))
    shift = node_score_shift(window, normal)
    assert shift.idxmax() == "db"
    assert shift["big"] == pytest.approx(0.05) and shift["db"] == pytest.approx(0.5)


def _traces(services: list[str], present: list[list[bool]], top: list[str], anomaly: list[float]) -> SimpleNamespace:
    """Scores of traces: which services each visits, the one the GNN scores highest, P(anomalous)."""
    gnn_service = np.array([[1.0 if service == first else 0.1 for service in services] for first in top])
    return SimpleNamespace(services=services, present=np.array(present), gnn_service=gnn_service,
                           gnn_anomaly=np.array(anomaly))


def test_culprit_votes_count_anomalous_traces_not_visits_or_a_usual_culprit():
    services = ["front", "db", "cache"]
    every, no_cache = [True, True, True], [True, True, False]
    # normally the GNN names the front in most traces; the cache is on a fifth of the paths
    normal = _traces(services, [every, no_cache, no_cache, no_cache, no_cache], ["front"] * 4 + ["db"], [0.1] * 5)
    # in the window the anomalous traces name the cache; healthy ones (P 0) still name the front
    window = _traces(services, [every, every, no_cache, no_cache, no_cache], ["cache", "cache", "front", "front", "front"],
                     [0.9, 0.9, 0.0, 0.0, 0.0])
    shift = culprit_vote_shift(window, normal)
    assert shift.idxmax() == "cache"
    assert shift["cache"] == pytest.approx(0.9)  # both traces visiting it name it, at 0.9 each
    assert shift["front"] == pytest.approx(0.0 - 4 * 0.1 / 5)  # the healthy traces' votes weigh nothing
    # unweighted, each trace's vote counts whole, healthy or not
    assert culprit_vote_shift(window, normal, weighted=False)["front"] == pytest.approx(3 / 5 - 4 / 5)


def test_a_store_culprit_votes_for_its_caller_when_owners_are_given():
    services = ["front", "db", "db-redis"]
    every = [True, True, True]
    normal = _traces(services, [every] * 4, ["front"] * 4, [0.1] * 4)
    # a starved db stretches its own client spans to its redis: the GNN names the redis node
    window = _traces(services, [every] * 4, ["db-redis"] * 3 + ["front"], [0.9] * 4)
    assert culprit_vote_shift(window, normal).idxmax() == "db-redis"
    folded = culprit_vote_shift(window, normal, owners={"db-redis": "db"})
    assert folded.idxmax() == "db" and "db-redis" not in folded.index
    assert folded["db"] == pytest.approx(3 * 0.9 / 4)
    # an owner the traces never visit leaves the store its own row
    assert "db-redis" in culprit_votes(window, owners={"db-redis": "elsewhere"}).index


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=1, max_value=40), st.integers(1, 4))
def test_culprit_votes_are_shares_and_do_not_grow_with_more_of_the_same_traffic(seed, traces, copies):
    rng = np.random.default_rng(seed)
    services = ["a", "b", "c", "d"]
    present = rng.random((traces, 4)) < 0.7
    present[:, 0] = True  # every trace has its entry service
    scores = SimpleNamespace(services=services, present=present, gnn_service=rng.random((traces, 4)) * present,
                             gnn_anomaly=rng.random(traces))
    votes = culprit_votes(scores)
    assert ((votes >= 0) & (votes <= 1)).all() and set(votes.index) <= set(services)
    # the same traffic `copies` times over: the same shares, so no shift against itself
    repeated = SimpleNamespace(**{name: np.concatenate([value] * copies) if name != "services" else value
                                  for name, value in vars(scores).items()})
    pd.testing.assert_series_equal(culprit_votes(repeated), votes)
    assert (culprit_vote_shift(repeated, scores).abs() < 1e-12).all()


def test_standardised_fusion_reads_a_lead_that_rank_fusion_does_not():
    # the time shift puts "profile" far ahead (1.15 log2 against 0.09); the learned ranking has it
    # fourth, a little below three services it barely separates
    time = pd.Series({"profile": 1.15, "geo": 0.09, "search": 0.05, "rate": 0.0, "user": -0.02})
    learned = pd.Series({"geo": 1.1, "search": 1.0, "rate": 0.9, "profile": 0.8, "user": -1.0})
    assert rank_fusion(time, learned).index[0] == "geo"
    assert standardised_fusion(time, learned).index[0] == "profile"
    # a learned ranking that is decisive still overturns a time shift that is not
    assert standardised_fusion(pd.Series({"a": 0.2, "b": 0.1, "c": 0.0}),
                               pd.Series({"a": -1.0, "b": 5.0, "c": -1.0})).index[0] == "b"


def test_standardised_fusion_of_missing_flat_and_tied_scores():
    # a service a ranking lacks counts as its lowest; a flat ranking adds nothing; ties keep the
    # first ranking's order
    fused = standardised_fusion(pd.Series({"a": 1.0, "b": 0.0}), pd.Series({"a": 0.0, "b": 1.0, "c": 3.0}))
    assert fused.index.tolist() == ["c", "a", "b"] and np.isfinite(fused).all()
    assert standardised_fusion(pd.Series({"a": 2.0, "b": 1.0}), pd.Series({"a": 5.0, "b": 5.0})).index.tolist() == ["a", "b"]
    assert standardised_fusion(pd.Series({"a": 2.0, "b": 1.0}),
                               pd.Series({"b": 2.0, "a": 1.0})).index.tolist() == ["a", "b"]


def test_rank_fusion_lets_no_scale_bury_a_first_place():
    rule = pd.Series({"pay": 9.0, "web": 1.0, "cart": 0.5})
    gnn = pd.Series({"web": 0.9, "cart": 0.2, "pay": 0.001})  # a low GNN score for pay
    fused = rank_fusion(rule, gnn)
    assert list(fused.index[:2]) == ["web", "pay"] or list(fused.index[:2]) == ["pay", "web"]
    assert fused.index[-1] == "cart"
    # an exact tie keeps the first ranking's order; a service one ranking lacks comes after its services
    assert list(rank_fusion(pd.Series({"a": 2.0, "b": 1.0}), pd.Series({"b": 2.0, "a": 1.0})).index) == ["a", "b"]
    assert rank_fusion(pd.Series({"a": 1.0}), pd.Series({"a": 1.0, "b": 2.0})).index.tolist() == ["a", "b"]
