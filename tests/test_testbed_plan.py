"""Testbed campaign files: the simulator's format plus `testbed: {code_share}`, and the code
faults drawn from it (fast; no processes)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.faultinject.errors import SpecError
from bmeg.faultinject.scenario import Fault, plan_faults, scenario_path
from bmeg.faultinject.spec import load_topology
from bmeg.faultinject.testbed.campaign import load_testbed_scenario, with_code_faults
from bmeg.faultinject.testbed.deployment import CFS_PERIOD_US, CODE_OPERATIONS
from bmeg.faultinject.cpu import SATURATION_HEADROOM, saturation_quota
from bmeg.faultinject.testbed.faults import code_operation


def test_dataset_campaign_draws_every_source_thirty_times_in_seventeen_episodes():
    plan, share, request_shares = load_testbed_scenario(scenario_path("testbed-dataset"))
    assert request_shares == (1.0,)
    topology, rng = load_topology("socialnet"), np.random.default_rng(0)
    counts: Counter[str] = Counter()
    for _ in range(17):
        counts.update(f.source for f in with_code_faults(plan_faults(plan, topology, rng), share, rng))
    assert set(counts) == {"interference", "saturation", "network", "misconfiguration", "background", "code"}
    assert min(counts.values()) >= 30, counts


def test_code_faults_keep_service_and_times_and_name_an_operation():
    faults = [Fault("post-storage-service", "network", "multiple", 2.0, 8.0, {"delay_ms": 20.0})] * 50
    drawn = with_code_faults(faults, 1.0, np.random.default_rng(1))
    assert {(f.service, f.source, f.start_s, f.end_s) for f in drawn} == {("post-storage-service", "code", 2.0, 8.0)}
    assert {code_operation(f.service, f.parameters["operation"]) for f in drawn} == set(CODE_OPERATIONS["post-storage-service"])
    assert {f.parameters["error"] for f in drawn} == {0.0, 1.0}
    assert {f.parameters["share"] for f in drawn} == {1.0}
    assert with_code_faults(faults, 0.0, np.random.default_rng(1)) == faults


def test_partial_code_campaign_draws_every_request_share_on_every_service():
    plan, share, request_shares = load_testbed_scenario(scenario_path("testbed-partial-code"))
    assert share == 1.0 and request_shares == (0.05, 0.1, 0.25, 0.5, 1.0)
    topology, rng = load_topology("socialnet"), np.random.default_rng(0)
    drawn = [f for _ in range(14) for f in with_code_faults(plan_faults(plan, topology, rng), share, rng, request_shares)]
    assert {f.source for f in drawn} == {"code"}
    assert Counter(f.parameters["share"] for f in drawn).keys() == set(request_shares)
    assert {f.service for f in drawn} == set(CODE_OPERATIONS)


@pytest.mark.parametrize("extra", [{"code_share": 2}, {"code_share": "half"}, {"share": 0.1}, ["code_share"],
                                   {"code_request_shares": [0]}, {"code_request_shares": []},
                                   {"code_request_shares": 0.5}, {"code_request_shares": [1.5]}])
def test_bad_testbed_section_is_a_clear_error(tmp_path, extra):
    document = yaml.safe_load(scenario_path("testbed-single").read_text())
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**document, "testbed": extra}))
    with pytest.raises(SpecError, match="testbed"):
        load_testbed_scenario(path)


def test_code_operation_needs_one():
    assert code_operation("unique-id-service", "/compose_unique_id") == "/compose_unique_id"
    with pytest.raises(Exception, match="needs an operation"):
        code_operation("nginx-web-server", 0.0)


@settings(max_examples=200, deadline=None)
@given(capacity=st.floats(0.0, 2.0), demand=st.floats(0.0, 4.0))
def test_saturation_quota_follows_demand_within_the_kernels_limits(capacity, demand):
    """The cut follows what the service uses (capacity < 1: it cannot keep up); the kernel's
    1-ms minimum quota per period (1 ms - 1 s) holds, with the period lengthened only as needed."""
    cores, period = saturation_quota(capacity, demand)
    demand = SATURATION_HEADROOM * demand
    assert CFS_PERIOD_US <= period <= 1_000_000
    assert cores * period >= 1000 - 1e-6
    assert cores == pytest.approx(max(capacity * demand, 1000 / period))
    if capacity * demand * CFS_PERIOD_US >= 1000:
        assert period == CFS_PERIOD_US
    elif capacity * demand >= 0.001:
        assert cores == pytest.approx(capacity * demand)


def test_posts_at_init_come_from_the_environment_and_bad_values_are_refused(monkeypatch):
    from bmeg.faultinject.testbed.supervisor import DEFAULT_POSTS_PER_USER, POSTS_ENV, posts_per_user
    from bmeg.faultinject.testbed.system import TestbedError

    monkeypatch.delenv(POSTS_ENV, raising=False)
    assert posts_per_user() == DEFAULT_POSTS_PER_USER == 10  # warm stores (docs/issue-12.md, session 23)
    monkeypatch.setenv(POSTS_ENV, "0")
    assert posts_per_user() == 0  # the stores start empty
    for bad in ("-1", "ten", "1.5", "", "²", " 3"):
        monkeypatch.setenv(POSTS_ENV, bad)
        with pytest.raises(TestbedError, match=POSTS_ENV):
            posts_per_user()
