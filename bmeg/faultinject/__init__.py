"""Fault injection: topology specs, scenarios, the embedded simulator and its labels.

The simulator is the default backend: it turns a `TopologySpec` and a `Scenario` into spans
(`SPAN_SCHEMA`) with ground-truth labels. `bmeg.datasets` builds datasets from it.
"""

from bmeg.faultinject.errors import SpecError
from bmeg.faultinject.labels import LABEL_RULE, Thresholds, calibrate, label_episode
from bmeg.faultinject.scenario import Fault, Scenario, load_scenario, parse_scenario, plan_faults
from bmeg.faultinject.simulator import SimulationResult, simulate
from bmeg.faultinject.spec import TopologySpec, load_topology, parse_topology
from bmeg.faultinject.tables import EpisodeTables, episode_tables, spans_of

__all__ = [
    "LABEL_RULE",
    "EpisodeTables",
    "Fault",
    "Scenario",
    "SimulationResult",
    "SpecError",
    "Thresholds",
    "TopologySpec",
    "calibrate",
    "episode_tables",
    "label_episode",
    "load_scenario",
    "load_topology",
    "parse_scenario",
    "parse_topology",
    "plan_faults",
    "simulate",
    "spans_of",
]
