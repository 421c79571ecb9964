"""The closed loop driven by a trained detector: the loop's recipe trains in about a minute,
then each scenario's fault is found from the traces and mitigated (integration: a few minutes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from bmeg.cli import main
from bmeg.faultinject import SpecError, load_scenario, load_topology, parse_scenario, plan_faults
from bmeg.training.pipeline import load_recipe, run

RECIPE = "socialnet-mitigation"  # shipped in bmeg/training/recipes/


def test_hot_paths_misconfigures_only_the_loaded_services() -> None:
    scenario = load_scenario("hot-paths")
    targets = set(scenario.campaign.targets["misconfiguration"])
    faults = [f for seed in range(10) for f in plan_faults(scenario, load_topology("socialnet"), np.random.default_rng(seed))]
    misconfigured = {f.service for f in faults if f.source == "misconfiguration"}
    assert misconfigured and misconfigured <= targets
    assert {f.source for f in faults} == set(scenario.campaign.sources)


def _campaign(**campaign) -> dict:
    return {"name": "t", "kind": "multiple", "duration_s": 20, "campaign": {
        "every_s": 6, "burst_s": 5, "faults_per_round": [2, 2],
        "sources": {"saturation": {}, "misconfiguration": {"pool_size": [1, 1]}}, **campaign}}


def test_campaign_targets_are_checked() -> None:
    with pytest.raises(SpecError, match="targets: \\['network'\\] are not among"):
        parse_scenario(_campaign(targets={"network": ["nginx-web-server"]}))
    scenario = parse_scenario(_campaign(targets={"misconfiguration": ["no-such-service"]}))
    with pytest.raises(SpecError, match="campaign.targets.misconfiguration\\[0\\]: unknown service 'no-such-service'"):
        plan_faults(scenario, load_topology("socialnet"), np.random.default_rng(0))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("loop-model")
    run(load_recipe(RECIPE), out)
    return str(out)


@pytest.mark.integration
@pytest.mark.parametrize("scenario", ["saturation", "interference", "misconfiguration", "cascading"])
def test_trained_detector_drives_the_loop_to_normal(trained: str, scenario: str) -> None:
    result = CliRunner().invoke(main, ["mitigate", "--sim", "socialnet", "--scenario", scenario, "--model", trained, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["detector"].startswith("bmeg-")
    kept = [a for a in report["actions"] if a["status"] == "applied" and "rolled_back_s" not in a]
    assert kept and report["mitigated_from_s"] == max(a["time_s"] for a in kept)
    assert report["p95_mitigated_ms"] <= 1.2 * report["p95_normal_ms"]
    assert report["p95_fault_period_mitigated_ms"] < report["p95_fault_ms"]
    if scenario in ("misconfiguration", "cascading"):
        assert report["p95_mitigated_ms"] < report["p95_hpa_ms"]
