"""Train the window GCN (`bmeg.models.window_gcn`) of runs of `bmeg bootstrap`, on windows simulated
from each run's twin (no real label), into each run directory, and print how often its first
service is a faulty one on held-out simulated windows:

    python bench/window_gcn.py RUN_DIR [RUN_DIR ...] [--windows 300] [--epochs 60] [--seed 0]

`bench/family_pretrain.py` and `bmeg evaluate rca` then score it as `bmeg-window-gcn`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bmeg.training.window_gcn import train_window_gcn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--windows", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # small graphs on a shared machine (`fit_window_gcn`)
    for run in args.runs:
        began = time.perf_counter()
        _, metrics = train_window_gcn(run, args.windows, args.epochs, args.seed)
        print(f"{run}: {metrics['windows']} windows, held-out top-1 {metrics['held_out_top1']:.2f} "
              f"(train {metrics['train_top1']:.2f}; the self-time rule {metrics['held_out_self_time_top1']:.2f}, "
              f"the GNN's shift {metrics['held_out_gnn_top1']:.2f}), {time.perf_counter() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
