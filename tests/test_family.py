"""The randomised family of synthetic applications (`bmeg.faultinject.family`), its training
data (`bmeg.datasets.family`) and the warm start of a bootstrap from a family-pretrained run."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bmeg.datasets.loader import read_dataset
from bmeg.faultinject import parse_topology, simulate, spans_of
from bmeg.faultinject.family import FamilyParams, expected_visits, random_topology
from bmeg.faultinject.spec import CacheStep, walk_calls
from bmeg.graphs import assemble


def _ranges(low: int, high: int):
    return st.tuples(st.integers(low, high), st.integers(low, high)).map(sorted).map(tuple)


params_strategy = st.builds(
    FamilyParams,
    services=_ranges(2, 40), depth=_ranges(1, 7), fan_out=_ranges(1, 5), operations=_ranges(1, 3),
    replicas=_ranges(1, 3), store_share=st.floats(0, 1), cache_share=st.floats(0, 1),
    parallel_share=st.floats(0, 1), branch_share=st.floats(0, 1),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), params=params_strategy)
def test_every_drawn_application_is_a_valid_spec_that_simulates(seed, params):
    spec = random_topology(seed, params)
    again = parse_topology(yaml.safe_load(spec.to_yaml()))  # the one format, through its own validation
    assert again == spec
    assert params.services[0] <= len(spec.services) - _caches(spec) <= params.services[1]
    visits = expected_visits(spec)
    assert set(visits) == {f"{s}:{o}" for s, service in spec.services.items() for o in service.operations}, \
        "every operation is reached by some request"
    spans = spans_of(simulate(again, [], 0.05, seed % 1000))
    if spans.num_rows:
        forest = assemble(spans)
        assert forest.num_traces > 0
        assert set(spans["service"].to_pylist()) <= set(spec.services)


def _caches(spec) -> int:
    return len({step.cache.split(":")[0] for service in spec.services.values() for op in service.operations.values()
                for _, step in walk_calls(op.calls, "") if isinstance(step, CacheStep)})


def test_the_same_seed_draws_the_same_application_and_others_differ():
    assert random_topology(3) == random_topology(3)
    shapes = {random_topology(seed).to_yaml() for seed in range(5)}
    assert len(shapes) == 5


def test_the_drawn_depth_is_the_longest_call_chain():
    params = FamilyParams(services=(12, 12), depth=(5, 5), store_share=0.0, branch_share=0.0)
    spec = random_topology(7, params)
    forest = assemble(spans_of(simulate(spec, [], 0.5, 1)))
    # five services deep: each call a client span and the callee's server span (no stores)
    assert int(forest.depth.max()) == 2 * (5 - 1)


def test_a_fault_free_member_is_not_saturated():
    for seed in range(4):
        spec = random_topology(seed)
        spans = spans_of(simulate(spec, [], 1.0, seed))
        roots = assemble(spans)
        durations = roots.duration_ns[roots.root] / 1e6
        assert np.median(durations) < 200, f"seed {seed}: fault-free requests take {np.median(durations):.0f} ms"


@pytest.mark.parametrize("bad, message", [
    ({"services": (1, 4)}, "at least 2"), ({"depth": (3, 2)}, "empty"), ({"store_share": 1.5}, r"\[0, 1\]"),
    ({"fan_out": (0, 2)}, "at least 1"), ({"utilisation": (0.2, 1.5)}, "utilisation"),
])
def test_bad_family_parameters_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        FamilyParams(**bad)


def test_a_family_dataset_loads_as_one_dataset_of_distinct_applications(tmp_path):
    from bmeg.datasets.family import generate_family

    specs = generate_family(tmp_path, apps=2, traces=150, seed=1, params=FamilyParams(services=(5, 8)), progress=False)
    dataset = read_dataset(tmp_path)
    assert len(dataset.cards) == 6  # two latency campaigns and code faults per app
    services = set(dataset.spans["service"].to_pylist())
    members = [parse_topology(yaml.safe_load(spec_file.read_text())) for spec_file in specs]
    for spec in members:
        assert services & set(spec.services), f"{spec.name} has no traces"
        assert all(name.startswith(spec.name + "-") for name in spec.services)
    assert not set(members[0].services) & set(members[1].services)


@pytest.mark.parametrize("stores, shards", [
    (True, {"single-scheduler", "multiple-scheduler", "callers-scheduler", "code"}),
    (False, {"single-scheduler", "multiple-scheduler", "code"}),  # no service calls a store
])
def test_the_training_shards_starve_store_callers_where_the_application_has_them(tmp_path, stores, shards):
    from builders import SHOP_SPEC, chain_spec

    from bmeg.datasets.family import CPU_FAULT_SCENARIOS, write_training_shards

    spec_file = tmp_path / "app.yaml"
    spec_file.write_text(yaml.safe_dump(chain_spec(100) if stores else SHOP_SPEC))
    folders = write_training_shards(tmp_path / "data", spec_file, 400, 0.3, 0, progress=False,
                                    scenarios=CPU_FAULT_SCENARIOS["scheduler"])
    assert {folder.name for folder in folders} == shards
    if stores:  # the third shard's faults hit the one service that calls a store (mid: a cache, a db)
        traces = pq.read_table(tmp_path / "data" / "callers-scheduler" / "traces.parquet").to_pandas()
        faulty = traces.loc[traces["anomalous"], "fault_services"]
        assert len(faulty) and {service for services in faulty for service in services} == {"mid"}


def test_training_starts_from_the_pretrained_weights(tmp_path):
    """One epoch of family pretraining; a run warm-started from it starts from its weights and
    hyperparameters and ends with the same shapes; a run on other features is refused."""
    import torch

    from bmeg.evaluation.bootstrap import pretrain_on_family
    from bmeg.models.detector import Detector
    from bmeg.training.pipeline import pretrained_stages
    from bmeg.models.features import BOOTSTRAP_FEATURES, FeatureEncoder

    pretrained, _ = pretrain_on_family(tmp_path / "pre", apps=1, traces=300, epochs=1, seed=2,
                                       params=FamilyParams(services=(5, 7)), progress=False)
    encoder = FeatureEncoder(BOOTSTRAP_FEATURES)
    hparams, dgcnn, gcn = pretrained_stages(tmp_path / "pre", encoder)
    assert hparams["dgcnn"] == pretrained.hparams["dgcnn"]
    for name, tensor in pretrained.dgcnn.state_dict().items():
        assert torch.equal(tensor.cpu(), dgcnn.state_dict()[name])
    assert Detector.load(tmp_path / "pre").router.max_services == -1
    from bmeg.training import train

    warm, _ = train(str(tmp_path / "pre" / "data"), epochs=1, progress=False, features=BOOTSTRAP_FEATURES,
                    svm_max_services=-1, pretrained=str(tmp_path / "pre"))
    assert warm.hparams["dgcnn"] == pretrained.hparams["dgcnn"]
    with pytest.raises(ValueError, match="same --features"):
        pretrained_stages(tmp_path / "pre", FeatureEncoder("full"))
