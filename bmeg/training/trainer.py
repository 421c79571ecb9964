"""Train one classifier (graph- or node-level) on a `GraphSet`, on CPU or GPU, in 1..N processes.

Class imbalance is handled by the loss: `weighted` (cross-entropy with inverse-frequency class
weights), `focal` (focal loss with the same weights as alpha), `sampling` (positives drawn
again until classes balance; graph-level only) or `plain`. The best epoch by validation
average precision is kept. With `nproc > 1` the epochs run under DistributedDataParallel (gloo
on CPU, NCCL on GPU), each process taking its share of every epoch's mini-batches.

Across machines, `torchrun` starts the processes instead (env:// rendezvous: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT come from the environment). `process_group` joins its
group once for a whole run, and `fit` then trains under DDP in that group: every process runs
the whole pipeline on the same data, takes its share of each epoch's mini-batches, and ends
with rank 0's best epoch (broadcast), so every rank holds the same model; the caller lets only
rank 0 write. `nproc` is for one machine without torchrun and must stay 1 under it.
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch import Tensor, nn
from tqdm import tqdm

from bmeg.models.graphset import GraphSet
from bmeg.models.inference import (
    Target,
    limit_cpu_threads,
    logits_and_labels,
    predict_proba,
    resolve_device,
)
from bmeg.training.config import FitConfig

T = TypeVar("T")
#: What torchrun (or any launcher of the env:// rendezvous) sets in each process it starts.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class History:
    train_loss: list[float] = field(default_factory=list)
    val_ap: list[float] = field(default_factory=list)
    best_epoch: int = 0
    processes: int = 1  # that trained together (DDP when more than 1)


def _rank_device(name: str, local_rank: int) -> torch.device:
    """The device of the process with this rank on its machine: its own GPU when on GPU."""
    device = resolve_device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


@dataclass(frozen=True)
class Group:
    """This process's place among the processes of one run (rank 0 of 1 when alone)."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1

    def local_leader_first(self, work: Callable[[], T]) -> T:
        """`work()` on each machine's local rank 0 first, then on its other ranks: one process per
        machine fills a shared cache (e.g. generates the dataset), the others then read it."""
        if self.world == 1:
            return work()
        result = work() if self.local_rank == 0 else None
        dist.barrier()
        return result if self.local_rank == 0 else work()  # type: ignore[return-value]


def torchrun_group() -> Group | None:
    """Where this process stands when started by torchrun (from its environment); None otherwise."""
    if not all(name in os.environ for name in TORCHRUN_ENV):
        return None
    try:
        return Group(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"]))
    except ValueError:
        raise ValueError("RANK, LOCAL_RANK and WORLD_SIZE must be integers (as torchrun sets them)") from None


def is_main_process() -> bool:
    """Rank 0 of torchrun's processes, or a process alone: the one that writes and prints."""
    group = torchrun_group()
    return group is None or group.rank == 0


@contextmanager
def process_group(device: str = "auto") -> Iterator[Group]:
    """Under torchrun, join its process group (env://) for the block; alone, do nothing."""
    group = torchrun_group()
    if group is None:
        yield Group()
        return
    resolved = _rank_device(device, group.local_rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    dist.init_process_group("nccl" if resolved.type == "cuda" else "gloo", init_method="env://")
    try:
        yield group
    finally:
        dist.destroy_process_group()


def fit(model: nn.Module, graphs: GraphSet, train: np.ndarray, val: np.ndarray, target: Target,
        config: FitConfig, label: str = "") -> History:
    """Train `model` in place; returns the history. Uses `config.nproc` processes, or under
    torchrun (inside `process_group`) the processes of its group."""
    if dist.is_initialized():
        if config.nproc > 1:
            raise ValueError("under torchrun, start more processes with torchrun's --nproc-per-node, not --nproc")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = _rank_device(config.device, int(os.environ.get("LOCAL_RANK", "0")))
        history = _train(rank, world, device, model, graphs, train, val, target, config, label)
        # every rank keeps rank 0's best epoch (their validation scores could differ in the last bits)
        shared: list[Any] = [(model.state_dict(), history) if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        state, history = shared[0]
        model.load_state_dict(state)
        return history
    if config.nproc == 1:
        return _fit_process(0, 1, model, graphs, train, val, target, config, label, None)
    with tempfile.TemporaryDirectory() as scratch:
        result_path = os.path.join(scratch, "result.pt")
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
        torch.multiprocessing.start_processes(
            _fit_process, args=(config.nproc, model, graphs, train, val, target, config, label, result_path),
            nprocs=config.nproc, start_method="fork",
        )
        result = torch.load(result_path, weights_only=False)
    model.load_state_dict(result["state"])
    return result["history"]


def _fit_process(rank: int, world: int, model: nn.Module, graphs: GraphSet, train: np.ndarray, val: np.ndarray,
                 target: Target, config: FitConfig, label: str, result_path: str | None) -> History:
    """One of `world` processes forked on this machine (`nproc`): its own group, for this fit."""
    device = _rank_device(config.device, rank)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    history = _train(rank, world, device, model, graphs, train, val, target, config, label)
    if world > 1:
        if rank == 0:
            torch.save({"state": model.state_dict(), "history": history}, result_path)
        dist.barrier()
        dist.destroy_process_group()
    return history


def _train(rank: int, world: int, device: torch.device, model: nn.Module, graphs: GraphSet, train: np.ndarray,
           val: np.ndarray, target: Target, config: FitConfig, label: str) -> History:
    """The epochs of one process; under DDP when world > 1 (its group already joined)."""
    distributed = world > 1
    if device.type == "cpu":
        limit_cpu_threads()
    torch.manual_seed(config.seed)
    model.to(device)
    trained = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.Adam(trained.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    labels = graphs.y[train] if target == "graph" else graphs.node_y[graphs.node_rows(train)]
    loss_fn = _loss_function(config.loss, labels, device)
    history, best_state, best_ap = History(processes=world), None, -1.0
    rng = np.random.default_rng(config.seed)
    epochs = tqdm(range(config.epochs), desc=f"train {label}", disable=not config.progress or rank > 0, unit="epoch")
    for epoch in epochs:
        trained.train()
        order = _epoch_order(train, graphs, target, config.loss, rng)
        mine = order[rank::world][: len(order) // world]  # equal shares keep DDP in step
        losses = []
        for batch in graphs.minibatches(mine, config.batch_size):
            batch = batch.to(device)
            logits, y = logits_and_labels(trained, batch, target)
            loss = loss_fn(logits, y, batch.node_emphasis if target == "node" else None)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        history.train_loss.append(float(np.mean(losses)) if losses else float("nan"))
        ap = _validation_ap(model, graphs, val, target, device)
        history.val_ap.append(ap)
        if ap > best_ap:
            best_ap, history.best_epoch = ap, epoch
            best_state = copy.deepcopy(model.state_dict())
        epochs.set_postfix(loss=f"{history.train_loss[-1]:.4f}", val_ap=f"{ap:.3f}")
    model.load_state_dict(best_state)
    model.to("cpu")
    return history


def _validation_ap(model: nn.Module, graphs: GraphSet, val: np.ndarray, target: Target, device) -> float:
    scores = predict_proba({target: model}, graphs, val, device)[target]
    truth = graphs.y[val] if target == "graph" else graphs.node_y[graphs.node_rows(val)]
    if len(np.unique(truth)) < 2:
        return float(-np.mean(np.abs(scores - truth)))  # one class only: closeness stands in
    return float(average_precision_score(truth, scores))


def _epoch_order(train: np.ndarray, graphs: GraphSet, target: Target, loss: str, rng: np.random.Generator) -> np.ndarray:
    if loss == "sampling" and target == "graph":
        positives, negatives = train[graphs.y[train] == 1], train[graphs.y[train] == 0]
        if len(positives):
            extra = rng.choice(positives, size=max(0, len(negatives) - len(positives)), replace=True)
            return rng.permutation(np.concatenate([train, extra]))
    return rng.permutation(train)


def callee_emphasis(parent: np.ndarray, node_y: np.ndarray, weight: float) -> np.ndarray | None:
    """float32 per node: `weight` for a non-bottleneck node whose parent is a bottleneck (the
    bottleneck's client spans: its calls to other services and to its stores), 1 for the others;
    None when `weight` is 1 (no emphasis). `parent`: each node's parent row, -1 at roots.

    Why: on the testbed the GNN's misses rank a store the faulty service calls first and the
    target second (docs/issue-12.md, session 10): a CPU-starved caller reads its responses late,
    so its client spans to an untouched store stretch. Those client spans are the negatives the
    node classifier must tell from the bottleneck above them.
    """
    if weight == 1.0:
        return None
    has_parent = parent >= 0
    below = np.zeros(len(parent), dtype=bool)
    below[has_parent] = node_y[parent[has_parent]] == 1
    return np.where(below & (node_y == 0), weight, 1.0).astype(np.float32)


def _loss_function(kind: str, labels: np.ndarray, device) -> Callable[[Tensor, Tensor, Tensor | None], Tensor]:
    """loss(logits, y, emphasis): the mean over samples of the loss `kind`, each sample weighted
    by its class weight (`weighted`, `focal`) times its `emphasis` (None: 1 for all)."""
    counts = np.bincount(labels, minlength=2).astype(np.float64)
    weights = torch.tensor(counts.sum() / (2 * np.maximum(counts, 1)), dtype=torch.float32, device=device)

    def plain(logits: Tensor, y: Tensor, emphasis: Tensor | None = None) -> Tensor:
        if emphasis is None:
            return F.cross_entropy(logits, y)
        return (emphasis * F.cross_entropy(logits, y, reduction="none")).sum() / emphasis.sum()

    if kind in ("plain", "sampling"):
        return plain

    def weighted(logits: Tensor, y: Tensor, emphasis: Tensor | None = None) -> Tensor:
        if emphasis is None:
            return F.cross_entropy(logits, y, weight=weights)
        sample = weights[y] * emphasis
        return (sample * F.cross_entropy(logits, y, reduction="none")).sum() / sample.sum()

    if kind == "weighted":
        return weighted

    def focal(logits: Tensor, y: Tensor, emphasis: Tensor | None = None, gamma: float = 2.0) -> Tensor:
        log_p = F.log_softmax(logits, dim=-1).gather(1, y[:, None]).squeeze(1)
        terms = -weights[y] * (1 - log_p.exp()) ** gamma * log_p
        return terms.mean() if emphasis is None else (emphasis * terms).sum() / emphasis.sum()

    return focal


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
