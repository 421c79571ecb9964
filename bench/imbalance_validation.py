"""Where B-MEG's GNN stages lose bottlenecked traces at 1% prevalence, read on validation traces only.

    python bench/imbalance_validation.py [--traces 40000] [--imbalance 0.01] [--seed 0] [--loss sampling]

Trains as `bmeg experiment imbalance` does (`bmeg.training.train`: the same dataset, split,
epochs and loss; the figures printed first are its GNN / SVM / routed rows on the test traces),
then scores every trace (`Detector.score`, both models, replayed over kept + context traces)
and reads the *validation* traces, where the thresholds are chosen, to tell the two possible
limits apart:
- the threshold: the stage-1 score ranks the bottlenecked validation traces well (high AUC,
  high best recall at precision ≥ 0.8) but the threshold chosen at precision ≥ 0.8 sits where
  few of them pass;
- the features or the model: the score itself does not rank them (the best recall at
  precision ≥ 0.8 over every threshold is already low).
Printed per model (GNN stage 1, trace SVM, and the SVM's margin before its logistic) and for the parameter-free rule of
`bench/history_context.py` (largest over a trace's nodes of min(self-time z, recent history)):
validation AUC, best recall at precision ≥ 0.8 and ≥ 0.7, and the recall and precision at the
threshold the detector kept; then, for the bottlenecked validation traces stage 1 misses at its
threshold, their rule score against the caught ones' (median).
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from sklearn.metrics import precision_recall_curve, roc_auc_score

from bmeg.datasets import load_dataset
from bmeg.graphs import node_services, operation_keys
from bmeg.training import train
from bmeg.training.pipeline import label


def best_recall(y: np.ndarray, score: np.ndarray, precision: float) -> float:
    p, r, _ = precision_recall_curve(y, score)
    feasible = p >= precision
    return float(r[feasible].max()) if feasible.any() else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=40_000)
    parser.add_argument("--imbalance", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss", default="weighted")
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args()
    detector, metrics = train("socialnet", traces=args.traces, imbalance=args.imbalance, epochs=args.epochs,
                              seed=args.seed, loss=args.loss, progress=False)
    print(f"socialnet single, {args.traces} traces at {args.imbalance}, seed {args.seed}, loss {args.loss}; "
          f"test ({metrics['test_anomalous']} bottlenecked), as `bmeg experiment imbalance`:")
    for model in ("gnn", "svm", "bmeg"):
        row = metrics[model]
        print(f"  {model:<5} BP {row['bp']:.3f} BR {row['br']:.3f} AC@1 {row['ac1']:.3f}")
    print(f"  routed: share to the SVM {metrics['routing']['share_to_svm']:.2f}")

    data = label(load_dataset("socialnet", args.traces, args.imbalance, args.seed, progress=False), args.seed)
    raw = detector.score(data.forest, all_models=True, replay=True, context=data.context)
    x = detector.encoder.transform(data.forest, context=data.context)
    names = detector.encoder.names
    rule_nodes = np.minimum(x[:, names.index("z_log_self_time_us")], x[:, names.index("recent_z_self_time")])
    rule = pd.Series(rule_nodes).groupby(data.forest.trace_index).max().to_numpy()
    services = node_services(data.forest, storage_nodes=True).to_numpy(zero_copy_only=False)
    # the SVM's margin, before the logistic: where margins pass ~37, P rounds to 1.0 and ties
    margin = detector.svm.decision_function(detector.trace_vectors(data.forest, x, operation_keys(data.forest, services)))
    val, y = data.val, data.y[data.val]
    print(f"validation: {int(y.sum())} bottlenecked of {len(val)}")
    print(f"  {'score':<10}{'AUC':>8}{'BR@BP0.8':>10}{'BR@BP0.7':>10}{'threshold':>11}{'BR there':>10}{'BP there':>10}")
    for name, score, threshold in (("GNN", raw.gnn_anomaly, detector.thresholds["graph"]),
                                   ("SVM", raw.svm_anomaly, detector.thresholds["svm"]),
                                   ("SVM margin", margin, None), ("rule", rule, None)):
        s = score[val]
        there = ""
        if threshold is not None:
            flagged = s >= threshold
            there = f"{threshold:>11.4f}{flagged[y == 1].mean():>10.3f}{y[flagged].mean() if flagged.any() else 0.0:>10.3f}"
        print(f"  {name:<10}{roc_auc_score(y, s):>8.4f}{best_recall(y, s, 0.8):>10.3f}{best_recall(y, s, 0.7):>10.3f}{there}")
    bottlenecked = val[y == 1]
    caught = raw.gnn_anomaly[bottlenecked] >= detector.thresholds["graph"]
    print(f"  stage 1 misses {int((~caught).sum())} of {len(bottlenecked)}: their rule score, median "
          f"{np.median(rule[bottlenecked][~caught]) if (~caught).any() else float('nan'):.2f} "
          f"(caught: {np.median(rule[bottlenecked][caught]) if caught.any() else float('nan'):.2f}); "
          f"their GNN score, median {np.median(raw.gnn_anomaly[bottlenecked][~caught]) if (~caught).any() else float('nan'):.4f}")
    normal = val[y == 0]
    print(f"  SVM: validation traces at P = 1.0 (margin past ~37): {int((raw.svm_anomaly[val] == 1.0).sum())}, "
          f"of them bottlenecked {int(y[raw.svm_anomaly[val] == 1.0].sum())}")
    print(f"  normal validation traces: GNN score p99 {np.quantile(raw.gnn_anomaly[normal], 0.99):.4f}, "
          f"p99.9 {np.quantile(raw.gnn_anomaly[normal], 0.999):.4f}; rule p99 {np.quantile(rule[normal], 0.99):.2f}")


if __name__ == "__main__":
    main()
