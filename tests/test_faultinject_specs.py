"""Topology specs and scenario files: the shipped ones load, bad ones fail naming the key."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from builders import chain_spec, chain_topology

from bmeg.faultinject import SpecError, load_scenario, load_topology, parse_scenario, parse_topology, plan_faults
from bmeg.faultinject.scenario import check_against, service_chains


@pytest.mark.parametrize("name", ["socialnet", "hotelreservation", "trainticket"])
def test_shipped_topologies_load_and_round_trip(name):
    topology = load_topology(name)
    assert parse_topology(__import__("yaml").safe_load(topology.to_yaml())) == topology


def test_socialnet_has_the_reference_services_and_mix():
    topology = load_topology("socialnet")
    stores = {name for name, service in topology.services.items() if service.storage}
    assert {"post-storage-mongodb", "post-storage-memcached", "social-graph-redis", "user-timeline-mongodb"} <= stores
    assert {"nginx-web-server", "compose-post-service", "text-service", "unique-id-service"} <= set(topology.services)
    code = topology.code_services()  # where code faults and the harness's simulated faults go: no store
    assert code == sorted(set(topology.services) - stores) and "compose-post-service" in code
    weights = {name: request.weight for name, request in topology.requests.items()}
    assert weights == {"compose-post": 0.1, "read-home-timeline": 0.6, "read-user-timeline": 0.3}


def test_small_topologies_match_the_thesis_shape():
    def logic_paths(name):
        topology = load_topology(name)
        logic = {s for s, spec in topology.services.items() if not spec.storage}
        return logic, {tuple(s for s in chain if s in logic) for chain in service_chains(topology)}

    hotel_services, hotel_paths = logic_paths("hotelreservation")
    train_services, train_paths = logic_paths("trainticket")
    assert (len(hotel_services), len(hotel_paths)) == (5, 3)
    assert (len(train_services), len(train_paths)) == (11, 7)


def _broken(mutate) -> dict:
    spec = copy.deepcopy(chain_spec())
    mutate(spec)
    return spec


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s["services"]["mid"]["operations"]["work_server"]["calls"].append({"call": "nowhere:x"}),
         "services.mid.operations.work_server.calls[2]: unknown service 'nowhere'"),
        (lambda s: s["services"]["mid"]["operations"]["work_server"]["calls"].append({"call": "leaf:nope"}),
         "service 'leaf' has no operation 'nope'"),
        (lambda s: s["workload"].update(rate=-5), "workload.rate: Input should be greater than 0"),
        (lambda s: s.pop("workload"), "workload: Field required"),
        (lambda s: s["services"]["leaf"].update(workers=0), "services.leaf.workers"),
        (lambda s: s["services"]["leaf"]["operations"]["compute"]["self_time"].pop("p99_us"), "give exactly one of p99_us or sigma"),
        (lambda s: s["services"]["leaf"]["operations"]["compute"].update(calls=[{"call": "front:get"}]), "call cycle: front:get -> mid:work_server -> leaf:compute -> front:get"),
        (lambda s: s["services"]["db"]["operations"]["find"].update(calls=[{"call": "leaf:compute"}]), "a store (mongodb) makes no calls"),
        (lambda s: s["services"]["mid"]["operations"]["work_server"]["calls"].append({"jump": "leaf:compute"}), "a step needs one of the keys"),
        (lambda s: s["services"]["mid"]["operations"]["work_server"]["calls"].append({"branch": [{"p": 0.5}, {"p": 0.2}]}), "branch probabilities sum to 0.7"),
        (lambda s: s["services"]["mid"].update(thread_pool=4), "services.mid.thread_pool: Extra inputs are not permitted"),
    ],
)
def test_bad_topology_fails_naming_the_key(mutate, message):
    with pytest.raises(SpecError) as error:
        parse_topology(_broken(mutate), "chain.yaml")
    assert message in str(error.value) and "chain.yaml" in str(error.value)


def test_unknown_topology_name_lists_the_known_ones():
    with pytest.raises(SpecError, match="socialnet"):
        load_topology("no-such-app")


def test_a_campaign_may_draw_network_delays_in_both_forms():
    campaign = {"every_s": 2, "burst_s": 1, "sources": {"network": {"delay_ms": [20, 50], "inbound": [0, 1]}}}
    scenario = parse_scenario(_scenario(duration_s=60, faults=[], campaign=campaign))
    faults = plan_faults(scenario, load_topology("socialnet"), np.random.default_rng(0))
    assert {f.parameter("inbound") for f in faults} == {0.0, 1.0}
    shipped = plan_faults(load_scenario("single-scheduler"), load_topology("socialnet"), np.random.default_rng(0))
    assert {f.parameter("inbound") for f in shipped if f.source == "network"} == {0.0}  # the default: outbound


def test_a_balanced_campaign_deals_every_source_once_in_each_run_of_faults():
    """`balanced_sources`: each run of five consecutive faults holds each of five sources once
    (an episode's few dozen faults hold each about equally often); without it, sources are drawn
    independently, and an episode of 25 holds some far more often than others."""
    sources = {"interference": {"factor": [4, 25]}, "saturation": {"quota": [0.3, 1.0]},
               "network": {"delay_ms": [20, 50]}, "misconfiguration": {"pool_size": [1, 2]},
               "background": {"pause_ms": [50, 200], "every_ms": [300, 1000]}}
    counts = {}
    for balanced in (True, False):
        campaign = {"every_s": 2, "burst_s": 1, "sources": sources, "balanced_sources": balanced}
        scenario = parse_scenario(_scenario(duration_s=52, faults=[], campaign=campaign))
        faults = plan_faults(scenario, load_topology("socialnet"), np.random.default_rng(3))
        assert len(faults) == 25
        if balanced:
            for start in range(0, 25, 5):
                assert sorted(f.source for f in faults[start:start + 5]) == sorted(sources)
        counts[balanced] = sorted(sum(f.source == source for f in faults) for source in sources)
    assert counts[True] == [5] * 5 and counts[False] != [5] * 5


@pytest.mark.parametrize("name", ["single", "multiple", "cascading"])
def test_shipped_scenarios_plan_faults_of_their_kind(name):
    scenario = load_scenario(name)
    faults = plan_faults(scenario, load_topology("socialnet"), np.random.default_rng(0))
    assert faults and all(f.kind == name for f in faults)
    starts = sorted({f.start_s for f in faults})
    if name == "single":
        assert len(starts) == len(faults)
    if name == "cascading":  # a round's faults follow one call path, one after another
        first_round = [f for f in faults if f.start_s < scenario.campaign.every_s + scenario.campaign.start_s]
        assert len({f.start_s for f in first_round}) == len(first_round) >= 2


def _scenario(**overrides) -> dict:
    scenario = {"name": "t", "kind": "single", "duration_s": 10,
                "faults": [{"service": "leaf", "source": "interference", "start_s": 1, "duration_s": 2, "parameters": {"factor": 3}}]}
    scenario.update(overrides)
    return scenario


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"duration_s": -1}, "duration_s: Input should be greater than 0"),
        ({"kind": "sometimes"}, "kind: Input should be 'single', 'multiple' or 'cascading'"),
        ({"faults": [{"service": "leaf", "source": "interference", "start_s": 1, "duration_s": 2}]}, "interference needs one of the parameters ['factor']"),
        ({"faults": [{"service": "leaf", "source": "network", "start_s": 1, "duration_s": 2, "parameters": {"factor": 2}}]}, "network takes parameters"),
        ({"faults": [{"service": "leaf", "source": "interference", "start_s": 1, "duration_s": 2, "parameters": {"factor": 0.5}}]}, "factor 0.5 must be >= 1"),
        ({"faults": [{"service": "leaf", "source": "network", "start_s": 1, "duration_s": 2, "parameters": {"delay_ms": 9, "inbound": 0.5}}]}, "inbound 0.5 must be 0 or 1"),
        ({"faults": [], "campaign": {"every_s": 5, "burst_s": 4, "sources": {"network": {"delay_ms": [9, 9], "inbound": [0, 2]}}}}, "inbound 2.0 must be 0 or 1"),
        ({"faults": []}, "needs `faults`, a `campaign`, or both"),
        ({"faults": [], "campaign": {"every_s": 5, "burst_s": 4, "balanced_sources": True, "sources": {"interference": {}},
                                     "targets": {"interference": ["leaf"]}}}, "cannot use it"),
        ({"faults": [], "campaign": {"every_s": 5, "burst_s": 10, "sources": {"interference": {}}}}, "rounds overlap"),
        ({"kind": "multiple", "faults": [], "campaign": {"every_s": 20, "sources": {"interference": {}}}}, "needs faults_per_round with max >= 2"),
    ],
)
def test_bad_scenario_fails_naming_the_key(overrides, message):
    with pytest.raises(SpecError) as error:
        parse_scenario(_scenario(**overrides), "s.yaml")
    assert message in str(error.value)


@pytest.mark.parametrize(
    "fault, message",
    [
        ({"service": "ghost", "source": "interference", "start_s": 1, "duration_s": 2, "parameters": {"factor": 3}},
         "faults[0].service: unknown service 'ghost'"),
        ({"service": "leaf", "source": "misconfiguration", "start_s": 1, "duration_s": 2, "parameters": {"hit_ratio": 0.1}},
         "'leaf' is no cache"),
    ],
)
def test_scenario_must_fit_the_topology(fault, message):
    scenario = parse_scenario(_scenario(faults=[fault]))
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_against(scenario, chain_topology())


def test_spec_written_from_code_round_trips_through_yaml(tmp_path):
    from bmeg.faultinject.spec import CallStep, Latency, Operation, Request, Service, TopologySpec, Workload

    spec = TopologySpec(
        name="two",
        workload=Workload(rate=10),
        requests={"r": Request(entry="a:op", weight=1)},
        services={
            "a": Service(operations={"op": Operation(self_time=Latency(median_us=100, sigma=0.3), calls=[CallStep(call="b:op")])}),
            "b": Service(operations={"op": Operation(self_time=Latency(median_us=50, p99_us=200))}),
        },
    )
    path = tmp_path / "two.yaml"
    path.write_text(spec.to_yaml())
    assert load_topology(path) == spec
