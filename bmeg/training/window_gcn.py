"""Training the window ranker `bmeg.models.window_gcn.WindowGCN` with no real label.

Every training window is simulated from the application's twin (`twin.yaml` of a run of `bmeg
bootstrap`): one episode of fault-free traffic, then 1-3 faults of every simulated source
(and, in a share of windows, a code fault applied to the spans) on the twin's services from a
moment on. The traces begun before that moment are the window's normal period (as `bmeg evaluate
rca --recent-traces` compares a window with the traffic just before it), those begun after are
the window. Each window's features are computed against its normal period with the run's own
detector (the per-trace GNN's score shift), exactly as the ranker computes them on real windows
(`service_features`); the faulty services visited by the window are its targets.

The loss is listwise: minus the log of the softmax mass the window's services put on its targets
(any one of them first is a hit, as the harness scores several faults of one window).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from tqdm import tqdm

from bmeg.faultinject import Fault, TopologySpec, load_topology, simulate, spans_of
from bmeg.faultinject.codefaults import CODE_FAULTS, apply_code_fault
from bmeg.faultinject.scenario import SCHEDULER_PARAMETERS, SOURCE_PARAMETERS, kernel_form_parameters
from bmeg.graphs.rpc import rpc_view
from bmeg.models.checkpoint import CheckpointError, load_tensor_dict
from bmeg.models.normal import NormalStats
from bmeg.models.window import gnn_window_scores, node_score_shift, with_normal_baselines
from bmeg.models.window_gcn import (FEATURES, WINDOW_GCN_FILE, WindowGCN, WindowGCNEnsemble, WindowGraph, WindowModel,
                                    save_window_gcn, service_features)
from bmeg.training.config import TRAINING_WINDOWS
from bmeg.traces.schema import trace_starts

#: Latency sources the twin simulates (all of `SOURCE_PARAMETERS`).
SOURCES = tuple(SOURCE_PARAMETERS)
#: The share of windows that also hold a code fault, and the share of its service's requests it hits.
CODE_FAULT_WINDOWS = 0.15
CODE_FAULT_SHARE = 0.5
#: The share of windows with a code fault alone (no latency fault): the only windows in which
#: errors and vanished calls, not a time shift, must put the faulty service first.
CODE_ALONE_WINDOWS = 0.2
#: The share of the training windows' CPU faults drawn in the kernel scheduler's form (a CFS
#: quota, a hog's time slices: `SCHEDULER_PARAMETERS`), as the testbed injects them. 0: with the
#: start-wait inputs, 0.5 ranked the testbed's faults no better (docs/issue-12.md, session 19), and
#: 0 keeps the windows of earlier sessions; `bench/window_gcn.py --kernel-form` compares.
KERNEL_FORM_FAULTS = 0.0
#: Traces of a window's normal period and of the window itself (drawn between the two): the
#: default `WindowShape`; the fixed normal period the detector's baselines come from is the longest.
NORMAL_TRACES = (300, 1200)
WINDOW_TRACES = (300, 1500)
#: The self-time rule's own inputs, left out since round 4 (docs/issue-12.md, session 17): the
#: window GCN without them was at least round 2 on both testbed recordings over seeds 0-4.
RULE_INPUTS = ("self_time", "self_time_lead")
#: Member i of an ensemble is fitted with seed `seed + MEMBER_SEED_STEP * i` (member 0: `seed`).
MEMBER_SEED_STEP = 1000
EPOCH_NS = 1_700_000_000 * 10**9
WINDOWS_FORMAT = "bmeg-window-gcn-windows"


@dataclass(frozen=True)
class WindowShape:
    """How many traces a simulated window's normal period and the window hold (each drawn
    uniformly between its two bounds): the real windows' (`bmeg evaluate rca --recent-traces 300`
    on the testbed: 300 before, ~480-600 in the window) or wider."""

    normal_traces: tuple[float, float] = NORMAL_TRACES
    window_traces: tuple[float, float] = WINDOW_TRACES


@dataclass(frozen=True)
class TrainingWindow:
    graph: WindowGraph
    targets: list[int]  # indices of the faulty services in graph.services
    code_alone: bool = False  # a code fault and no latency fault


def simulated_windows(spec: TopologySpec, detector: Any, count: int, seed: int = 0,
                      code_alone: float = CODE_ALONE_WINDOWS, shape: WindowShape = WindowShape(),
                      kernel_form: float = KERNEL_FORM_FAULTS, progress: bool = False) -> list[TrainingWindow]:
    """`count` faulted windows of `shape` simulated from `spec`, with their features read by
    `detector` (a `bmeg.models.detector.Detector`), a share `code_alone` of them with a code fault
    alone, a share `kernel_form` of their CPU faults in the kernel's form (`_latency_fault`);
    windows whose faulty services are never visited are skipped."""
    rng = np.random.default_rng(seed)
    rate = spec.workload.rate
    baseline = rpc_view(spans_of(simulate(spec, [], NORMAL_TRACES[1] / rate, seed), EPOCH_NS, seed))
    detector = with_normal_baselines(detector, baseline)  # as the harness does with the fixed normal period
    targets = spec.code_services()
    windows = []
    for index in tqdm(range(count), desc="window GCN: simulated windows", unit="window", disable=not progress):
        window = _simulated_window(spec, detector, targets, rng, seed * 100_003 + index + 1, code_alone, shape,
                                   kernel_form)
        if window is not None:
            windows.append(window)
    return windows


def _simulated_window(spec: TopologySpec, detector: Any, services: list[str], rng: np.random.Generator,
                      episode_seed: int, code_alone: float = 0.0, shape: WindowShape = WindowShape(),
                      kernel_form: float = KERNEL_FORM_FAULTS) -> TrainingWindow | None:
    rate = spec.workload.rate
    before_s = rng.uniform(*shape.normal_traces) / rate
    window_s = rng.uniform(*shape.window_traces) / rate
    alone = rng.random() < code_alone
    latency = 0 if alone else min(int(rng.choice([1, 1, 2, 3])), len(services))
    chosen = rng.choice(services, size=latency, replace=False)
    faults = [_latency_fault(str(service), rng, before_s, before_s + window_s, kernel_form) for service in chosen]
    spans = spans_of(simulate(spec, faults, before_s + window_s, episode_seed), EPOCH_NS, episode_seed)
    starts = trace_starts(spans)
    begun_before = pc.less(starts["start_ns_min"], EPOCH_NS + int(before_s * 1e9))
    normal_ids, window_ids = starts["trace_id"].filter(begun_before), starts["trace_id"].filter(pc.invert(begun_before))
    window_spans = spans.filter(pc.is_in(spans["trace_id"], window_ids))
    faulty = [str(service) for service in chosen]
    if alone or rng.random() < CODE_FAULT_WINDOWS:
        service = str(rng.choice(services))
        fault = apply_code_fault(window_spans, service, str(rng.choice(CODE_FAULTS)), CODE_FAULT_SHARE, rng)
        if alone and not fault.bottleneck.any():
            return None  # nothing a trace records shows it (an early return from a span that calls nothing)
        if fault.spans.num_rows:
            window_spans, faulty = _with_changed_traces(window_spans, fault.spans), [*faulty, service]
    window = training_window(detector, spans.filter(pc.is_in(spans["trace_id"], normal_ids)), window_spans, faulty)
    return None if window is None else TrainingWindow(window.graph, window.targets, code_alone=alone)


def _with_changed_traces(spans: pa.Table, changed: pa.Table) -> pa.Table:
    """`spans` with the traces of `changed` replaced by it (a code fault keeps only the traces
    that visit its service; a real window holds the others too)."""
    others = spans.filter(pc.invert(pc.is_in(spans["trace_id"], pc.unique(changed["trace_id"]))))
    return pa.concat_tables([others, changed.select(others.column_names).cast(others.schema)])


def _latency_fault(service: str, rng: np.random.Generator, start_s: float, end_s: float,
                   kernel_form: float = KERNEL_FORM_FAULTS) -> Fault:
    """A fault of a source drawn from `SOURCES` with its campaign's parameters; a CPU fault
    (one with `SCHEDULER_PARAMETERS`) in the kernel scheduler's form a share `kernel_form` of the time."""
    source = str(rng.choice(SOURCES))
    parameters = {name: float(rng.uniform(lo, hi)) for name, (lo, hi) in SOURCE_PARAMETERS[source].items()}
    if source == "network":
        parameters.pop("bandwidth_kbit")  # a delay, as the real lists' network_delay
    if kernel_form > 0 and source in SCHEDULER_PARAMETERS and rng.random() < kernel_form:  # 0: no draw, main's windows
        parameters = kernel_form_parameters(source, parameters, rng)
    return Fault(service, source, "multiple", start_s, end_s, parameters)


def training_window(detector: Any, normal_spans: pa.Table, window_spans: pa.Table,
                    faulty: list[str]) -> TrainingWindow | None:
    """One window's graph against its normal period, the `faulty` services it visits its targets."""
    normal, window = rpc_view(normal_spans), rpc_view(window_spans)
    if normal.num_traces == 0 or window.num_traces == 0:
        return None
    gnn = node_score_shift(gnn_window_scores(detector, window), gnn_window_scores(detector, normal))
    graph = service_features(NormalStats.from_forest(normal), window, gnn)
    targets = sorted({graph.services.index(service) for service in faulty if service in graph.services})
    return TrainingWindow(graph, targets) if targets else None


def listwise_loss(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """-log of the softmax mass on the targets: small when one of them comes first."""
    return -(torch.logsumexp(logits[targets], 0) - torch.logsumexp(logits, 0))


@dataclass(frozen=True)
class FitSettings:
    """How a window GCN is fitted: the inputs it reads (an ablation drops some), its steps and
    decay, and how many members fitted apart it holds (`fit_ensemble`)."""

    # round 2's (docs/issue-12.md, session 15), without the self-time rule's own inputs since
    # round 4 (session 17), with the start waits since round 5 (session 19); `bench/window_gcn.py`'s
    # defaults are these
    epochs: int = 10
    lr: float = 3e-3
    weight_decay: float = 1e-2
    features: tuple[str, ...] = tuple(f for f in FEATURES if f not in RULE_INPUTS)
    members: int = 1


def fit_window_gcn(windows: list[TrainingWindow], seed: int = 0, settings: FitSettings = FitSettings(),
                   after_epoch: Callable[[int, WindowGCN], None] | None = None) -> WindowGCN:
    """A `WindowGCN` trained on `windows` as `settings` say, one window per step, in a fresh order
    each epoch; `after_epoch(epoch, model)` is called after each epoch (1, 2, ...), e.g. to follow
    held-out windows."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = WindowGCN(features=settings.features)
    optimiser = torch.optim.Adam(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # graphs of a few dozen nodes: more threads only wait on each other (30x slower on 2 busy cores)
    try:
        for epoch in range(1, settings.epochs + 1):
            model.train()
            for index in rng.permutation(len(windows)):
                window = windows[index]
                optimiser.zero_grad()
                listwise_loss(model(window.graph.x, window.graph.edges), window.targets).backward()
                optimiser.step()
            if after_epoch is not None:
                after_epoch(epoch, model.eval())
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def fit_ensemble(windows: list[TrainingWindow], seed: int = 0, settings: FitSettings = FitSettings()) -> WindowModel:
    """`settings.members` window GCNs fitted on the same `windows` with seeds `seed`, `seed +
    MEMBER_SEED_STEP`, ... as one `WindowGCNEnsemble`; one member is returned as itself (the
    model `fit_window_gcn` fits with `seed`)."""
    members = [fit_window_gcn(windows, seed + MEMBER_SEED_STEP * i, settings) for i in range(settings.members)]
    return members[0] if len(members) == 1 else WindowGCNEnsemble(members)


def top1(model: WindowModel, windows: list[TrainingWindow]) -> float:
    """The share of windows whose first service is one of its targets."""
    with torch.no_grad():
        hits = [int(model(w.graph.x, w.graph.edges).argmax()) in w.targets for w in windows]
    return float(np.mean(hits)) if hits else float("nan")


def feature_top1(feature: str, windows: list[TrainingWindow]) -> float:
    """`top1` of the rule that ranks by one input feature (e.g. `self_time`, the self-time rule)."""
    column = FEATURES.index(feature)
    hits = [int(w.graph.x[:, column].argmax()) in w.targets for w in windows]
    return float(np.mean(hits)) if hits else float("nan")


def save_windows(windows: list[TrainingWindow], path: Path) -> None:
    """Training windows as a dict of tensors and plain values (`load_windows`): simulating them
    is most of a training run's time, and the settings of `FitSettings` are compared on the same."""
    torch.save({"format": WINDOWS_FORMAT, "features": list(FEATURES),
                "windows": [{"services": w.graph.services, "x": w.graph.x, "edges": w.graph.edges,
                             "targets": w.targets, "code_alone": w.code_alone} for w in windows]}, path)


def load_windows(path: Path) -> list[TrainingWindow]:
    state = load_tensor_dict(path, WINDOWS_FORMAT, "bmeg window GCN training windows")
    if state.get("features") != list(FEATURES):
        raise CheckpointError(f"{path} holds windows of other features ({state.get('features')}): simulate them again")
    return [TrainingWindow(WindowGraph(w["services"], w["x"], w["edges"]), w["targets"], w["code_alone"])
            for w in state["windows"]]


def train_window_gcn(run_dir: str | Path, windows: int | list[TrainingWindow] = TRAINING_WINDOWS, seed: int = 0,
                     settings: FitSettings = FitSettings(), file: str = WINDOW_GCN_FILE,
                     held_out: float = 0.0, progress: bool = False) -> tuple[WindowModel, dict]:
    """Train the window GCN of a run of `bmeg bootstrap` (its `twin.yaml` and detector) into the
    run directory (`file`, the ranker's `WINDOW_GCN_FILE` unless told) on `windows` (or that many
    simulated here), fitted once on all of them; returns (model, metrics). With `held_out` (a
    share, e.g. 0.2) the metrics also hold the top-1 on that share of the windows of a second
    model fitted on the rest (`held_out_check`)."""
    from bmeg.models.detector import Detector

    run_dir = Path(run_dir)
    if isinstance(windows, int):
        windows = simulated_windows(load_topology(run_dir / "twin.yaml"), Detector.load(run_dir), windows, seed,
                                    progress=progress)
    model = fit_ensemble(windows, seed=seed, settings=settings)
    metrics = {"windows": len(windows), "train_top1": top1(model, windows),
               "code_alone_windows": sum(w.code_alone for w in windows), "epochs": settings.epochs,
               "lr": settings.lr, "weight_decay": settings.weight_decay, "members": settings.members,
               **(held_out_check(windows, held_out, seed, settings) if held_out > 0 else {})}
    save_window_gcn(model, run_dir / file, metrics)
    return model, metrics


def held_out_check(windows: list[TrainingWindow], share: float, seed: int, settings: FitSettings) -> dict:
    """Top-1 on the first `share` of `windows` of a model fitted as `settings` say on the others,
    beside the self-time rule's and the GNN shift's. A second fit, apart from the saved model:
    the check needs a model that never saw the held-out windows, the saved one sees them all."""
    held = max(int(len(windows) * share), 1)
    model = fit_ensemble(windows[held:], seed=seed, settings=settings)
    return {"held_out": held, "held_out_top1": top1(model, windows[:held]),
            "held_out_self_time_top1": feature_top1("self_time", windows[:held]),
            "held_out_gnn_top1": feature_top1("gnn_shift", windows[:held])}
