"""Training data from a topology: the shards `bmeg bootstrap` trains on, and a family of them.

`write_training_shards` writes, for one topology spec, a shard per latency campaign
(`SCENARIOS`: the simulator's faults of every source, one at a time and several at once) and a
third of code faults (`bmeg.faultinject.codefaults`: an early return or an exception, which
change structure and status and not time), sharing the traces equally. `bmeg bootstrap` writes
them for the twin of the user's application.

`generate_family` writes them for `apps` random applications (`bmeg.faultinject.family`), each
app's spec beside its shards (`<out>/<app>.yaml`, shards `<out>/<app>-<shard>/`), so that the
folder loads as one dataset (`bmeg.datasets.loader`: the union of its sub-folders) to pretrain
on: many shapes, so a model cannot learn one application's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bmeg.datasets.generate import generate_dataset
from bmeg.faultinject.codefaults import code_fault_dataset
from bmeg.faultinject.family import FamilyParams, random_topology
from bmeg.faultinject.scenario import load_scenario, plan_faults
from bmeg.faultinject.spec import load_topology

#: The latency campaigns of the training shards, a shard each, beside a shard of code faults,
#: by how the CPU faults work: `fluid` (a CPU limit or a neighbour slows every burst alike) or
#: `scheduler` (a CFS quota and a CPU hog's time slices, `bmeg.faultinject.cpu`; and a third shard
#: of them on the services that call stores, docs/issue-12.md, "Issue 12, session 34").
CPU_FAULT_SCENARIOS = {"fluid": ("single", "multiple"),
                       "scheduler": ("single-scheduler", "multiple-scheduler", "callers-scheduler")}
#: The CPU-fault model `bmeg bootstrap` trains on unless told otherwise: `scheduler` since
#: session 11 (docs/issue-12.md, "Issue 12, session 11"), ahead of `fluid` on the testbed's single faults.
DEFAULT_CPU_FAULTS = "scheduler"
SCENARIOS = CPU_FAULT_SCENARIOS["fluid"]
#: Seeds of family members: member i of a family with seed s is drawn with s * SEED_STRIDE + i.
SEED_STRIDE = 1000


def write_training_shards(out: str | Path, topology: str | Path, traces: int, imbalance: float, seed: int,
                          progress: bool = True, prefix: str = "", scenarios: tuple[str, ...] = SCENARIOS) -> list[Path]:
    """The latency-campaign shards (one per scenario) and the code-fault shard of `topology` (a
    spec file) under `out` (`<prefix><shard>/`); returns their folders. A campaign that can hit no
    service of the topology (`callers-scheduler` where no service calls a store) has no shard."""
    out = Path(out)
    spec = load_topology(topology)
    scenarios = tuple(name for name in scenarios if plan_faults(load_scenario(name), spec, np.random.default_rng(0)))
    shard_traces = traces // (len(scenarios) + 1)
    folders = []
    for index, scenario in enumerate(scenarios):  # a seed each: the shards' trace ids must differ
        folders.append(out / f"{prefix}{scenario}")
        generate_dataset(folders[-1], topology=topology, traces=shard_traces, imbalance=imbalance,
                         seed=seed * len(scenarios) + index, scenario=scenario, progress=progress)
    folders.append(out / f"{prefix}code")
    code_fault_dataset(spec, folders[-1], traces=shard_traces, seed=seed)
    return folders


def generate_family(out: str | Path, apps: int, traces: int, imbalance: float = 0.3, seed: int = 0,
                    params: FamilyParams = FamilyParams(), progress: bool = True) -> list[Path]:
    """`apps` random applications, `traces` training traces each; returns their spec files."""
    if apps < 1 or traces < 3:
        raise ValueError(f"a family needs at least 1 app and 3 traces per app, not {apps} and {traces}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for index in range(apps):
        member = seed * SEED_STRIDE + index
        name = f"family{seed}-app{index:02d}"
        spec_file = out / f"{name}.yaml"
        spec_file.write_text(random_topology(member, params, name=name).to_yaml())
        write_training_shards(out, spec_file, traces, imbalance, member, progress, prefix=f"{name}-")
        specs.append(spec_file)
    return specs
