"""Running the GNNs: device choice, CPU threads, and probabilities over a `GraphSet`.

Inference needs these and training reuses them, so they live with the models (training sits
above and imports them from here).
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from bmeg.models.graphset import GraphSet, MiniBatch

Target = Literal["graph", "node"]


def limit_cpu_threads(threads: int | None = None) -> None:
    """`threads` intra-op threads per process on CPU; by default BMEG_TORCH_THREADS, else one.

    Call graphs are small: with two OpenMP threads on a busy 2-core machine each tiny scatter
    waits on the other thread (12 ms instead of 0.01 ms a call); processes (`nproc`) scale better.
    """
    torch.set_num_threads(threads or int(os.environ.get("BMEG_TORCH_THREADS", "1")))


def resolve_device(name: str) -> torch.device:
    """`auto` is the GPU when there is one, else the CPU; other names as torch reads them."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def logits_and_labels(model: nn.Module, batch: MiniBatch, target: Target) -> tuple[Tensor, Tensor | None]:
    """A model's logits on a mini-batch, with the labels of the same target (None when unlabelled)."""
    if target == "graph":
        return model(batch.x, batch.adj_t, batch.batch), batch.y
    return model(batch.x, batch.adj_t), batch.node_y


@torch.inference_mode()
def predict_proba(models: dict[Target, nn.Module], graphs: GraphSet, traces: np.ndarray,
                  device: torch.device, batch_size: int = 512) -> dict[Target, np.ndarray]:
    """Each model's P(positive) on the given traces: per graph (target "graph") or per node
    (target "node"). The models share every mini-batch, and so its adjacency.

    The probabilities are taken in float64: in float32 every logit gap above ~17 rounds to
    P = 1.0, and a model bootstrapped from a twin is that sure of some real healthy traces (11
    of the testbed's 496 held-back ones), so a threshold calibrated above them went above 1 and
    stage 1 flagged nothing at all (docs/issue-12.md, session 9)."""
    for model in models.values():
        if model.training:  # eval() walks every submodule: too dear for a served request
            model.eval()
    parts: dict[Target, list[np.ndarray]] = {target: [np.zeros(0)] for target in models}
    for batch in graphs.minibatches(traces, batch_size):
        batch = batch.to(device)
        for target, model in models.items():
            logits, _ = logits_and_labels(model, batch, target)
            parts[target].append(torch.softmax(logits.double(), dim=-1)[:, 1].cpu().numpy())
    return {target: np.concatenate(arrays) for target, arrays in parts.items()}
