"""Train one classifier (graph- or node-level) on a `GraphSet`, on CPU or GPU, in 1..N processes.

Class imbalance is handled by the loss: `weighted` (cross-entropy with inverse-frequency class
weights), `focal` (focal loss with the same weights as alpha), `sampling` (positives drawn
again until classes balance; graph-level only) or `plain`. The best epoch by validation
average precision is kept. With `nproc > 1` the epochs run under DistributedDataParallel (gloo
on CPU, NCCL on GPU), each process taking its share of every epoch's mini-batches.
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

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

LOSSES = ("weighted", "focal", "sampling", "plain")


@dataclass(frozen=True)
class FitConfig:
    epochs: int = 15
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 1e-5
    loss: str = "weighted"
    device: str = "auto"
    nproc: int = 1
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; choose from {LOSSES}")
        if self.epochs < 1 or self.batch_size < 1 or self.nproc < 1:
            raise ValueError("epochs, batch_size and nproc must be at least 1")


@dataclass
class History:
    train_loss: list[float] = field(default_factory=list)
    val_ap: list[float] = field(default_factory=list)
    best_epoch: int = 0


def fit(model: nn.Module, graphs: GraphSet, train: np.ndarray, val: np.ndarray, target: Target,
        config: FitConfig, label: str = "") -> History:
    """Train `model` in place; returns the history. Uses `config.nproc` processes."""
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
    device = resolve_device(config.device)
    distributed = world > 1
    if distributed:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world)
    if device.type == "cpu":
        limit_cpu_threads()
    torch.manual_seed(config.seed)
    model.to(device)
    trained = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.Adam(trained.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    labels = graphs.y[train] if target == "graph" else graphs.node_y[graphs.node_rows(train)]
    loss_fn = _loss_function(config.loss, labels, device)
    history, best_state, best_ap = History(), None, -1.0
    rng = np.random.default_rng(config.seed)
    epochs = tqdm(range(config.epochs), desc=f"train {label}", disable=not config.progress or rank > 0, unit="epoch")
    for epoch in epochs:
        trained.train()
        order = _epoch_order(train, graphs, target, config.loss, rng)
        mine = order[rank::world][: len(order) // world]  # equal shares keep DDP in step
        losses = []
        for batch in graphs.minibatches(mine, config.batch_size):
            logits, y = logits_and_labels(trained, batch.to(device), target)
            loss = loss_fn(logits, y)
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
    if distributed:
        if rank == 0:
            torch.save({"state": model.state_dict(), "history": history}, result_path)
        dist.barrier()
        dist.destroy_process_group()
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


def _loss_function(kind: str, labels: np.ndarray, device) -> Callable[[Tensor, Tensor], Tensor]:
    counts = np.bincount(labels, minlength=2).astype(np.float64)
    weights = torch.tensor(counts.sum() / (2 * np.maximum(counts, 1)), dtype=torch.float32, device=device)
    if kind in ("plain", "sampling"):
        return F.cross_entropy
    if kind == "weighted":
        return lambda logits, y: F.cross_entropy(logits, y, weight=weights)

    def focal(logits: Tensor, y: Tensor, gamma: float = 2.0) -> Tensor:
        log_p = F.log_softmax(logits, dim=-1).gather(1, y[:, None]).squeeze(1)
        return (-weights[y] * (1 - log_p.exp()) ** gamma * log_p).mean()

    return focal


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
