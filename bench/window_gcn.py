"""Train the window GCN (`bmeg.models.window_gcn`) of runs of `bmeg bootstrap`, on windows simulated
from each run's twin (no real label), into each run directory, and print how often its first
service is a faulty one on its training windows (`--held-out 0.2`: also on a fifth of them held
out of a second fit):

    python bench/window_gcn.py RUN_DIR [RUN_DIR ...] [--windows 200] [--epochs 10] [--seed 0] \
        [--code-alone 0.2] [--weight-decay 1e-2] [--without gnn_shift gnn_lead] [--cache DIR] \
        [--drop-code-alone] [--file window_gcn.pt] [--members 1] [--fit-seed S] \
        [--normal-traces 300 1200] [--window-traces 300 1500] [--held-out 0.2] [--kernel-form 0]

The defaults are the library's (`FitSettings()`, `TRAINING_WINDOWS`, `CODE_ALONE_WINDOWS`,
`KERNEL_FORM_FAULTS`; `--kernel-form 0.5` draws half the CPU faults as a quota or a hog, session 19).

`--members K` fits K window GCNs on the same windows (seeds S, S+1000, ...) and saves them as one
ensemble (`WindowGCNEnsemble`); `--fit-seed` fits with another seed than the windows' (`--seed`);
`--normal-traces` / `--window-traces` shape the simulated windows (`WindowShape`).

`--cache DIR` keeps each run's simulated windows (DIR/<run>-<windows>-<code-alone>-s<seed>.pt) and
reads them back when they are there: simulating them is most of the time. `--compare N` trains
nothing into the runs: it fits settings side by side on the same windows and prints their top-1
on N held-out windows simulated apart (another seed), latency windows and code-alone windows
apart, after 10-`--epochs` epochs, with the fit's time (`bench/window_gcn.py RUN --compare 150`).

`bench/family_pretrain.py` and `bmeg evaluate rca` then score it as `bmeg-window-gcn`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bmeg.faultinject import load_topology
from bmeg.models.detector import Detector
from bmeg.models.window_gcn import FEATURES, WINDOW_GCN_FILE
from bmeg.training.config import TRAINING_WINDOWS
from bmeg.training.window_gcn import (CODE_ALONE_WINDOWS, KERNEL_FORM_FAULTS, FitSettings, TrainingWindow, WindowShape, feature_top1,
                                      fit_window_gcn, load_windows, save_windows, simulated_windows, top1, train_window_gcn)

#: held-out seeds are apart from every training seed
HELD_OUT_SEED = 1000
GNN_INPUTS = ("gnn_shift", "gnn_lead")


def windows_of(run: Path, count: int, seed: int, code_alone: float, cache: Path | None,
               shape: WindowShape = WindowShape(), kernel_form: float = KERNEL_FORM_FAULTS) -> list[TrainingWindow]:
    shaped = "" if shape == WindowShape() else "-n{:g}-{:g}-w{:g}-{:g}".format(*shape.normal_traces, *shape.window_traces)
    path = None if cache is None else cache / f"{run.name}-{count}-{code_alone:g}{shaped}-k{kernel_form:g}-s{seed}.pt"
    if path is not None and path.is_file():
        return load_windows(path)
    began = time.perf_counter()
    windows = simulated_windows(load_topology(run / "twin.yaml"), Detector.load(run), count, seed, code_alone, shape,
                                kernel_form)
    print(f"{run}: simulated {len(windows)} windows (seed {seed}) in {time.perf_counter() - began:.0f} s", flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_windows(windows, path)
    return windows


def compare(run: Path, pool: list[TrainingWindow], held: list[TrainingWindow], settings: FitSettings, seed: int) -> None:
    """Fit settings side by side on `pool` and print their held-out top-1 per epoch checkpoint."""
    latency, code = [w for w in held if not w.code_alone], [w for w in held if w.code_alone]
    print(f"{run}: held out {len(latency)} latency windows, {len(code)} code-alone; rules on the latency ones: "
          f"self time {feature_top1('self_time', latency):.3f}, GNN shift {feature_top1('gnn_shift', latency):.3f}; "
          f"on the code-alone ones: errors {feature_top1('errors_beyond_noise', code):.3f}", flush=True)
    plain = [w for w in pool if not w.code_alone]
    without_gnn = tuple(f for f in FEATURES if f not in GNN_INPUTS)
    variants = {
        "100 windows, no code-alone (session 14)": (plain[:100], settings),
        f"{len(plain)} windows, no code-alone": (plain, settings),
        f"{len(pool)} windows with code-alone": (pool, settings),
        "  the same, weight decay 1e-3": (pool, FitSettings(settings.epochs, settings.lr, 1e-3, settings.features)),
        "  the same, weight decay 1e-2": (pool, FitSettings(settings.epochs, settings.lr, 1e-2, settings.features)),
        "  the same, lr 1e-3": (pool, FitSettings(settings.epochs, 1e-3, settings.weight_decay, settings.features)),
        "  the same, without the GNN's shift": (pool, FitSettings(settings.epochs, settings.lr, settings.weight_decay,
                                                                  without_gnn)),
    }
    checkpoints = sorted({10, 20, 40, settings.epochs} & set(range(1, settings.epochs + 1)))
    for name, (train, chosen) in variants.items():
        curve: dict[int, tuple[float, float]] = {}

        def follow(epoch: int, model, curve=curve) -> None:
            if epoch in checkpoints:
                curve[epoch] = (top1(model, latency), top1(model, code))

        began = time.perf_counter()
        model = fit_window_gcn(train, seed=seed, settings=chosen, after_epoch=follow)
        cells = " ".join(f"e{e} {lat:.3f}/{cod:.3f}" for e, (lat, cod) in curve.items())
        print(f"{run}: {name}: held-out latency/code top-1 {cells}; train {top1(model, train):.2f}; "
              f"fit {time.perf_counter() - began:.0f} s", flush=True)


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    # the defaults are the library's (`FitSettings`, `TRAINING_WINDOWS`, `CODE_ALONE_WINDOWS`)
    fit = FitSettings()
    parser.add_argument("--windows", type=int, default=TRAINING_WINDOWS)
    parser.add_argument("--epochs", type=int, default=fit.epochs)
    parser.add_argument("--seed", type=int, default=0, help="the windows' seed (and the fit's)")
    parser.add_argument("--fit-seed", type=int, help="the fit's seed when not --seed")
    parser.add_argument("--members", type=int, default=fit.members, help="window GCNs fitted apart, saved as one ensemble")
    parser.add_argument("--normal-traces", type=float, nargs=2, default=WindowShape().normal_traces, metavar=("LO", "HI"))
    parser.add_argument("--window-traces", type=float, nargs=2, default=WindowShape().window_traces, metavar=("LO", "HI"))
    parser.add_argument("--code-alone", type=float, default=CODE_ALONE_WINDOWS, help="share of windows with a code fault alone")
    parser.add_argument("--kernel-form", type=float, default=KERNEL_FORM_FAULTS,
                        help="share of the windows' CPU faults in the kernel's form (a quota, a hog's slices)")
    parser.add_argument("--weight-decay", type=float, default=fit.weight_decay)
    parser.add_argument("--lr", type=float, default=fit.lr)
    parser.add_argument("--without", nargs="*", default=[f for f in FEATURES if f not in fit.features], choices=FEATURES,
                        help="inputs left out (an ablation; none leaves out nothing)")
    parser.add_argument("--cache", type=Path, help="a folder for the simulated windows")
    parser.add_argument("--drop-code-alone", action="store_true", help="train on the latency windows only")
    parser.add_argument("--file", default=WINDOW_GCN_FILE, help="the model's file in each run directory")
    parser.add_argument("--compare", type=int, metavar="N", help="compare settings on N held-out windows")
    parser.add_argument("--simulate-only", action="store_true", help="only simulate the windows into --cache")
    parser.add_argument("--held-out", type=float, default=0.0, metavar="SHARE",
                        help="also fit on all but SHARE of the windows and print the top-1 on them (a second fit)")
    return parser


def fit_settings(args: argparse.Namespace) -> FitSettings:
    return FitSettings(args.epochs, args.lr, args.weight_decay, tuple(f for f in FEATURES if f not in args.without),
                       args.members)


def main() -> None:
    args = argument_parser().parse_args()
    torch.set_num_threads(1)  # small graphs on a shared machine (`fit_window_gcn`)
    settings = fit_settings(args)
    shape = WindowShape(tuple(args.normal_traces), tuple(args.window_traces))
    for run in args.runs:
        began = time.perf_counter()
        windows = windows_of(run, args.windows, args.seed, args.code_alone, args.cache, shape, args.kernel_form)
        if args.simulate_only:
            continue
        if args.compare:
            held = windows_of(run, args.compare, HELD_OUT_SEED + args.seed, args.code_alone, args.cache, shape,
                              args.kernel_form)
            compare(run, windows, held, settings, args.seed)
            continue
        if args.drop_code_alone:
            windows = [w for w in windows if not w.code_alone]
        fit_seed = args.seed if args.fit_seed is None else args.fit_seed
        _, metrics = train_window_gcn(run, windows, seed=fit_seed, settings=settings, file=args.file, held_out=args.held_out)
        held = "" if not args.held_out else (
            f"; held-out top-1 {metrics['held_out_top1']:.2f} (the self-time rule {metrics['held_out_self_time_top1']:.2f}, "
            f"the GNN's shift {metrics['held_out_gnn_top1']:.2f})")
        print(f"{run}: {metrics['members']} member(s), {metrics['windows']} windows ({metrics['code_alone_windows']} "
              f"code-alone), train top-1 {metrics['train_top1']:.2f}{held}, {time.perf_counter() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
