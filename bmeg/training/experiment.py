"""The thesis's imbalance experiment (its Figure 5.2): B-MEG vs the SVM as bottlenecks get rarer.

Per dataset and ratio, three rows: B-MEG's GNN stages alone, the per-trace SVM alone, and the
routed combination the detector serves, each with its inference throughput (traces/s of
`Detector.diagnosis_document` over up to 1,000 test traces, the three measured in one run).
"""

from __future__ import annotations

from collections.abc import Iterable

from bmeg.training import train

#: The thesis's reported figures on socialnet (DESIGN.md §2), for the side-by-side table.
THESIS = {
    ("socialnet", 0.1): {"gnn": {"bp": 0.74, "br": 0.8, "nbr": 0.81}, "svm": {"br": 0.81, "nbr": 0.39}},
    ("socialnet", 0.01): {"gnn": {"accuracy": 0.71, "br": 0.67}, "svm": {"accuracy": 0.78, "br": 0.07}},
}
#: metrics key -> row name
MODELS = {"gnn": "B-MEG (GNN)", "svm": "SVM", "bmeg": "routed"}
DEFAULT_RATIOS = (0.3, 0.1, 0.01)
#: Traces per dataset and ratio, as in the thesis (the socialnet-thesis recipe's size).
DEFAULT_TRACES = 40_000


def imbalance_experiment(datasets: Iterable[str], ratios: Iterable[float], traces: int, epochs: int,
                         seed: int = 0, progress: bool = True, **options) -> list[dict]:
    """One row per (dataset, ratio, model) with the thesis's columns and AC@k; the routed row
    also with the router's reason (`router`)."""
    rows = []
    for dataset in datasets:
        for ratio in ratios:
            _, metrics = train(dataset, traces=traces, imbalance=ratio, epochs=epochs, seed=seed,
                               progress=progress, **options)
            for model, name in MODELS.items():
                thesis = THESIS.get((dataset, ratio), {}).get(model, {})
                rows.append({
                    "dataset": dataset, "imbalance": ratio, "model": name,
                    **{key: metrics[model][key] for key in ("accuracy", "nbp", "bp", "nbr", "br", "ac1", "ac3")},
                    "test_bottlenecked": metrics["test_anomalous"],
                    "to_svm": {"gnn": 0.0, "svm": 1.0}.get(model, metrics["routing"]["share_to_svm"]),
                    "traces_per_s": metrics["traces_per_s"][model],
                    "thesis": ", ".join(f"{k.upper()} {v}" for k, v in thesis.items()),
                    # which model the router chose, and why (the routed row's; its reason in words)
                    "router": metrics["routing"].get("why", "") if model == "bmeg" else "",
                })
    return rows
