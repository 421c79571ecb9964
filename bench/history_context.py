"""How much the temporal-context feature tells, read over the kept traces alone or over kept + context.

    python bench/history_context.py [--traces 40000] [--imbalance 0.01] [--seed 0]

Loads (generating into the cache once) the `single`-scenario socialnet dataset and fits the
feature baselines on its normal training traces (`bmeg.training.pipeline.label`'s split). It
then scores each test trace with one parameter-free rule, the largest over its nodes of
min(node's self-time z-score, its service's `recent_z_self_time`): a node is off and so were
its service's recent visits. The feature is computed twice in one run: over the kept traces
alone (what a dataset without a context file gives) and over kept + context traces (the
stream the traces were simulated in). Printed per reading: the median feature at bottleneck
nodes and at other nodes with z > 2, the rule's ROC AUC, and its best recall at precision
≥ 0.8 and ≥ 0.9 on the test traces (no threshold is fitted: the best one on test, an upper
bound of what the rule can do, the same for both readings).
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from sklearn.metrics import precision_recall_curve, roc_auc_score

from bmeg.datasets import load_dataset
from bmeg.models.features import FeatureEncoder
from bmeg.training.pipeline import _subforest, label


def best_recall(y: np.ndarray, score: np.ndarray, precision: float) -> float:
    p, r, _ = precision_recall_curve(y, score)
    return float(r[p >= precision].max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=40_000)
    parser.add_argument("--imbalance", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dataset = load_dataset("socialnet", args.traces, args.imbalance, args.seed, progress=False)
    if dataset.context is None:
        raise SystemExit("the dataset has no context file (an older format): nothing to compare")
    data = label(dataset, args.seed)
    forest = data.forest
    normal_train = data.train[data.y[data.train] == 0]
    encoder = FeatureEncoder().fit(_subforest(forest, normal_train))
    z_at, recent_at = encoder.names.index("z_log_self_time_us"), encoder.names.index("recent_z_self_time")
    test = np.isin(np.arange(forest.num_traces), data.test)
    print(f"socialnet single, {args.traces} traces at {args.imbalance}, seed {args.seed}: "
          f"{forest.num_traces} kept traces, {data.context.num_traces} context traces, "
          f"{int(data.y[data.test].sum())} bottlenecked test traces")
    print(f"{'history over':<16}{'at bottlenecks':>16}{'at other z>2':>14}{'AUC':>8}{'BR@BP0.8':>10}{'BR@BP0.9':>10}")
    for name, context in (("kept only", None), ("kept + context", data.context)):
        x = encoder.transform(forest, context=context)
        z, recent = x[:, z_at], x[:, recent_at]
        bottleneck = data.node_y == 1
        score = pd.Series(np.minimum(z, recent)).groupby(forest.trace_index).max().to_numpy()[test]
        y = data.y[test]
        print(f"{name:<16}{np.median(recent[bottleneck]):>16.2f}{np.median(recent[(z > 2) & ~bottleneck]):>14.2f}"
              f"{roc_auc_score(y, score):>8.4f}{best_recall(y, score, 0.8):>10.3f}{best_recall(y, score, 0.9):>10.3f}")


if __name__ == "__main__":
    main()
