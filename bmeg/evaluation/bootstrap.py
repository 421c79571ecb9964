"""The zero-label path: normal traces -> twin -> labelled synthetic dataset -> trained model.

No real fault label is used anywhere: the twin is fitted from fault-free traces, the
fault-injection toolkit injects faults into the twin's services (single and multiple
campaigns), and the detector learns from the simulator's labels. The run directory holds the
model (as `bmeg train` writes it), `twin.yaml`, and the generated data under `data/`.
"""

from __future__ import annotations

from pathlib import Path

from bmeg.datasets.generate import generate_dataset
from bmeg.faultinject.twin import fit_twin
from bmeg.traces.io import read_spans

#: Scenarios the dataset is generated from, one shard each, sharing the traces equally.
SCENARIOS = ("single", "multiple")
#: A twin is never the real application: train on features that mean the same in both.
BOOTSTRAP_FEATURES = "relative"


def bootstrap(normal_traces: str | Path, out: str | Path, traces: int = 6000, imbalance: float = 0.3,
              epochs: int = 10, seed: int = 0, input_format: str | None = None, progress: bool = True,
              features: str = BOOTSTRAP_FEATURES):
    """Fit a twin, generate a labelled dataset from it, train on it; returns (Detector, metrics)."""
    from bmeg.training import train

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = fit_twin(read_spans(normal_traces, format=input_format), name="twin",
                    description=f"twin fitted from {normal_traces}")
    twin_file = out / "twin.yaml"
    twin_file.write_text(spec.to_yaml())
    for index, scenario in enumerate(SCENARIOS):  # a seed each: the shards' trace ids must differ
        generate_dataset(out / "data" / scenario, topology=twin_file, traces=traces // len(SCENARIOS),
                         imbalance=imbalance, seed=seed * len(SCENARIOS) + index, scenario=scenario, progress=progress)
    return train(out / "data", out=out, epochs=epochs, seed=seed, progress=progress, features=features)
