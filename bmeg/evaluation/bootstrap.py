"""The zero-label path: normal traces -> twin -> labelled synthetic dataset -> trained model
-> baselines and stage 1 set on the application's own healthy traces.

No real fault label is used anywhere: the twin is fitted from fault-free traces, the
fault-injection toolkit injects faults into the twin's services (single and multiple
campaigns, CPU faults on the services that call stores, and code faults applied to its spans), and the detector learns from the simulator's labels. Then the model is made to
read the real application: its per-operation baselines are refitted on the real normal
traces the twin came from, and its stage-1 thresholds are raised until at most
`false_alarm_rate` of the later, held-back real normal traces are flagged
(`bmeg.training.calibration`). Last, the window GCN learns to rank the services of windows
simulated from the twin (`bmeg.training.window_gcn`): bmeg's window ranker fuses its ranking with
the time shift (`bmeg.models.window.combined_ranking`). The run directory holds the model (as
`bmeg train` writes it, with a `calibration` entry in its metrics), `twin.yaml`, the generated
data under `data/`, the window GCN (`bmeg.models.window_gcn.WINDOW_GCN_FILE`) and the normal
traces the twin was fitted from (`bmeg.paths.NORMAL_TRACES_FILE`): `bmeg diagnose --window`
ranks a window against them (`bmeg.models.window.WindowRanker`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from dataclasses import replace
from pathlib import Path

from bmeg.datasets.family import CPU_FAULT_SCENARIOS, DEFAULT_CPU_FAULTS, generate_family, write_training_shards
from bmeg.faultinject.family import FamilyParams
from bmeg.models.features import BOOTSTRAP_FEATURES, NODE_INPUTS
from bmeg.models.window import with_normal_baselines
from bmeg.faultinject.twin import fit_twin
from bmeg.graphs.rpc import rpc_view
from bmeg.paths import NORMAL_TRACES_FILE
from bmeg.training.calibration import DEFAULT_CONFIDENCE, DEFAULT_FALSE_ALARM_RATE
from bmeg.training.config import NODE_DRAWS, TRAINING_WINDOWS, FitConfig
from bmeg.training.window_gcn import train_window_gcn
from bmeg.traces.io import read_spans, write_spans

#: The later share of the normal traces held back to calibrate stage 1 on.
HELD_BACK = 0.25
#: A further draw's seed is the bootstrap's plus this many times its index: far from the seeds
#: other bootstraps draw with, so that two runs' draws do not share faults.
DRAW_SEED_STRIDE = 1000


def bootstrap(normal_traces: str | Path, out: str | Path, traces: int = 6000, imbalance: float = 0.3,
              epochs: int = 10, seed: int = 0, input_format: str | None = None, progress: bool = True,
              features: str = BOOTSTRAP_FEATURES, held_back: float = HELD_BACK,
              false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE, confidence: float | None = DEFAULT_CONFIDENCE,
              pretrained: str | Path | None = None, cpu_faults: str = DEFAULT_CPU_FAULTS,
              hard_negatives: float = FitConfig.hard_negatives, window_gcn_windows: int = TRAINING_WINDOWS,
              node_draws: int = NODE_DRAWS, node_inputs: str = "raw", signs: bool = False):
    """Fit a twin, generate a labelled dataset from it, train on it, calibrate on the held-back
    healthy traces; returns (Detector, metrics). With `pretrained` (a run of `pretrain_on_family`,
    or any run on the same features) both GNN stages start from its weights and specialise on the
    twin. `cpu_faults` picks the training campaigns' CPU faults (`CPU_FAULT_SCENARIOS`);
    `hard_negatives`, the node stage's weight of a bottleneck's client spans (`FitConfig`);
    `window_gcn_windows`, how many simulated windows the window GCN trains on (0: none, and the
    window ranker fuses the per-trace GNN's ranking instead); `node_draws`, how many draws of the
    training faults the node stage is bagged over (each one more classifier, `bagged_node_stage`);
    `node_inputs`, how the node classifier reads its features (`NODE_INPUTS`: "asinh" helps
    where the real deviations outgrow the twin's, docs/issue-12.md, session 31); `signs`, whether
    stage 1 also reads the simple per-trace signs, calibrated beside the model (`bmeg.models.signs`;
    not the default: docs/issue-12.md, session 40)."""
    from bmeg.training import train
    from bmeg.training.calibration import calibrate_on_healthy, split_by_time
    from bmeg.training.pipeline import TrainConfig, bagged_node_stage

    if cpu_faults not in CPU_FAULT_SCENARIOS:
        raise ValueError(f"cpu_faults must be one of {', '.join(CPU_FAULT_SCENARIOS)}, not {cpu_faults!r}")
    if node_draws < 1:
        raise ValueError(f"node_draws must be at least 1, not {node_draws}")
    if node_inputs not in NODE_INPUTS:
        raise ValueError(f"node_inputs must be one of {', '.join(NODE_INPUTS)}, not {node_inputs!r}")
    if pretrained is not None:  # refuse a run on other features before the data are made
        from bmeg.models.features import FeatureEncoder
        from bmeg.training.pipeline import pretrained_stages

        pretrained_stages(pretrained, FeatureEncoder(features), node_inputs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fitting, healthy = split_by_time(read_spans(normal_traces, format=input_format), held_back)
    spec = fit_twin(fitting, name="twin", description=f"twin fitted from {normal_traces}")
    twin_file = out / "twin.yaml"
    twin_file.write_text(spec.to_yaml())
    write_spans(fitting, out / NORMAL_TRACES_FILE, "parquet")
    # the latency campaigns and a shard of code faults: without it the model never sees a
    # fault that changes structure and not time, and reads an error or a missing call as noise
    write_training_shards(out / "data", twin_file, traces, imbalance, seed, progress,
                          scenarios=CPU_FAULT_SCENARIOS[cpu_faults])
    detector, metrics = train(str(out / "data"), out=out, epochs=epochs, seed=seed, progress=progress, features=features,
                              hard_negatives=hard_negatives, pretrained=None if pretrained is None else str(pretrained),
                              node_inputs=node_inputs)
    if node_draws > 1:
        draws = [out / "draws" / str(index) for index in range(1, node_draws)]
        for index, folder in enumerate(draws, start=1):
            write_training_shards(folder, twin_file, traces, imbalance, seed + DRAW_SEED_STRIDE * index, progress,
                                  scenarios=CPU_FAULT_SCENARIOS[cpu_faults])
        fit = FitConfig(epochs=epochs, hard_negatives=hard_negatives, progress=progress)
        config = TrainConfig(seed=seed, features=features, fit=fit, pretrained=None if pretrained is None else str(pretrained),
                             node_inputs=node_inputs)
        detector = bagged_node_stage(detector, draws, config)
        metrics["node_draws"] = node_draws
    detector = with_normal_baselines(detector, rpc_view(fitting))
    detector, calibration = calibrate_on_healthy(detector, rpc_view(healthy), false_alarm_rate, confidence, signs)
    metrics["calibration"] = calibration.to_dict()
    detector = replace(detector, metrics=metrics).save(out)
    if window_gcn_windows > 0:  # after the save: it simulates its windows with the calibrated detector
        metrics["window_gcn"] = train_window_gcn(out, window_gcn_windows, seed, progress=progress)[1]
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return detector, metrics


def pretrain_on_family(out: str | Path, apps: int = 12, traces: int = 3000, epochs: int = 5, seed: int = 0,
                       params: FamilyParams = FamilyParams(), imbalance: float = 0.3, features: str = BOOTSTRAP_FEATURES,
                       node_inputs: str = "raw", progress: bool = True):
    """Train both GNN stages on a randomised family of `apps` synthetic applications
    (`bmeg.datasets.family.generate_family`, data under `out/data`), to start a bootstrap from
    (`bootstrap(pretrained=out)`); returns (Detector, metrics). Only the GNN stages are meant
    to be reused: the router sends every trace to the GNN (no probe detector is fitted)."""
    from bmeg.training import train

    out = Path(out)
    generate_family(out / "data", apps, traces, imbalance, seed, params, progress)
    return train(str(out / "data"), out=out, epochs=epochs, seed=seed, progress=progress, features=features,
                 node_inputs=node_inputs, svm_max_services=-1)


def cached_run_dir(normal_traces: str | Path, input_format: str | None = None,
                   cpu_faults: str = DEFAULT_CPU_FAULTS) -> Path:
    """Where `cached_bootstrap` keeps the run bootstrapped from these normal traces. Keyed by
    everything that changes the run: the traces' path and each file's size and modification
    time (other traces written to the same path, a dataset regenerated in place, get a run of
    their own), the options given, `bootstrap`'s defaults for the rest, and what the twin's
    training data come from: the simulator's version (`SIMULATOR_VERSION`) and the content of
    the training campaigns (an edited campaign draws other faults)."""
    from bmeg.faultinject.scenario import scenario_path
    from bmeg.faultinject.simulator import SIMULATOR_VERSION
    from bmeg.paths import cache_dir

    path = Path(normal_traces).resolve()
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    stamps = [f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    settings = {name: parameter.default for name, parameter in inspect.signature(bootstrap).parameters.items()
                if parameter.default is not inspect.Parameter.empty and name != "progress"}
    campaigns = {name: hashlib.sha256(scenario_path(name).read_bytes()).hexdigest()
                 for name in CPU_FAULT_SCENARIOS.get(cpu_faults, ())}
    settings.update(input_format=input_format, cpu_faults=cpu_faults, simulator_version=SIMULATOR_VERSION,
                    campaigns=campaigns)
    key = hashlib.sha256("\n".join([str(path), *stamps, json.dumps(settings, sort_keys=True, default=str)]).encode())
    return cache_dir() / "runs" / f"bootstrap-{key.hexdigest()[:10]}"


def cached_bootstrap(normal_traces: str | Path, input_format: str | None = None, progress: bool = True,
                     cpu_faults: str = DEFAULT_CPU_FAULTS) -> Path:
    """The run directory of a model bootstrapped from `normal_traces` with the defaults (and
    `cpu_faults`): from the cache when a finished run is there (its metrics.json, written
    last), else trained now."""
    run_dir = cached_run_dir(normal_traces, input_format, cpu_faults)
    if not (run_dir / "metrics.json").is_file():
        if progress:
            print(f"no model given: bootstrapping one from {normal_traces} into {run_dir}", file=sys.stderr)
        bootstrap(normal_traces, run_dir, input_format=input_format, progress=progress, cpu_faults=cpu_faults)
    return run_dir
