"""The `relative-siblings` features (issue 12; the bootstrap's default since session 13): a call's
stretch beside its siblings', so that a slow callee (only its own calls stretch) reads apart from
a slow caller (all its calls stretch)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.faultinject import Fault, parse_topology, simulate, spans_of
from bmeg.graphs.rpc import rpc_view
from bmeg.models.features import RELATIVE_COLUMNS, FeatureEncoder, beyond_siblings
from builders import SHOP_SPEC, many_traces, span_table, tiny_detector

@st.composite
def forests(draw):
    """A parent array (each node's parent earlier, or -1) and a value per node."""
    n = draw(st.integers(1, 40))
    parent = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]
    values = draw(st.lists(st.floats(-50, 50), min_size=n, max_size=n))
    return np.array(parent, dtype=np.int64), np.array(values)


@settings(max_examples=200, deadline=None)
@given(forests())
def test_beyond_siblings_is_the_value_minus_its_siblings_mean(forest):
    parent, values = forest
    got = beyond_siblings(parent, values)
    for node in range(len(parent)):
        siblings = [other for other in range(len(parent))
                    if other != node and parent[node] >= 0 and parent[other] == parent[node]]
        expected = values[node] - (np.mean(values[siblings]) if siblings else 0.0)
        assert got[node] == pytest.approx(expected, abs=1e-9)


def _web_calls(fault: Fault) -> pd.DataFrame:
    """Mean of the new column over web's client spans, per operation, with `fault` on all along."""
    topology = parse_topology(SHOP_SPEC)
    normal = rpc_view(spans_of(simulate(topology, [], 5, 1)))
    faulty = rpc_view(spans_of(simulate(topology, [fault], 5, 2)))
    encoder = FeatureEncoder("relative-siblings").fit(normal)
    table = pd.DataFrame(encoder.transform(faulty), columns=encoder.names)
    spans = faulty.spans
    table["service"] = spans["service"].to_numpy(zero_copy_only=False)
    table["kind"] = spans["kind"].to_numpy(zero_copy_only=False)
    table["operation"] = spans["operation"].to_numpy(zero_copy_only=False)
    calls = table[(table.service == "web") & (table.kind == "client")]
    return calls.groupby("operation")[["z_log_duration_us", "z_duration_beyond_siblings"]].mean()


def test_a_slow_callee_stands_out_from_its_siblings_more_than_a_delayed_callers_calls():
    slow_callee = _web_calls(Fault("pay", "interference", "single", 0.0, 5.0, {"factor": 5.0}))
    stretch, beyond = slow_callee.loc["charge_client"]
    assert stretch > 3 and beyond > 0.9 * stretch  # its sibling, cart's call, did not move
    # web's egress delayed: both of its calls stretch, and their contrast is less than half the
    # stretch (not zero: a fixed delay stretches the shorter call more in log units)
    delayed_caller = _web_calls(Fault("web", "network", "single", 0.0, 5.0, {"delay_ms": 20}))
    assert (delayed_caller["z_log_duration_us"] > 3).all()
    assert (delayed_caller["z_duration_beyond_siblings"].abs() < 0.5 * delayed_caller["z_log_duration_us"]).all()


def test_checkpoints_saved_with_the_former_relative_features_still_load():
    former = ["z_log_self_time_us", "z_log_duration_us", "z_log_wait_us", "parent_z_log_self_time_us",
              "parent_z_log_duration_us", "z_explained_share", "children_delta", "repeated_delta", "error",
              "error_origin", "z_cp_share", "unknown_operation", "recent_z_self_time"]
    state = {"variant": "relative", "history": 50, "keys": [], "medians": [], "spreads": [], "names": former}
    assert FeatureEncoder.from_state(state).names == former
    siblings = FeatureEncoder("relative-siblings")
    assert siblings.names == [*RELATIVE_COLUMNS, "z_duration_beyond_siblings", "unknown_operation", "recent_z_self_time"]
    assert FeatureEncoder.from_state(siblings.to_state()).names == siblings.names
    with pytest.raises(ValueError, match="differ"):
        FeatureEncoder.from_state({**state, "variant": "relative-siblings"})


def test_a_model_saved_on_the_former_default_features_loads_and_diagnoses(tmp_path):
    """`relative` was the bootstrap's features until session 13: its runs must keep working."""
    from bmeg.models.detector import Detector

    tiny_detector("relative").save(tmp_path)
    loaded = Detector.load(tmp_path, device="cpu", application="toy")
    assert loaded.encoder.variant == "relative" and loaded.encoder.num_features == len(RELATIVE_COLUMNS) + 2
    diagnosis = loaded.diagnose(span_table(many_traces(3, slow=1)), window=True)
    assert [t.trace_id for t in diagnosis.traces] == ["t0000", "t0001", "t0002"]
    assert diagnosis.ranking is not None
