"""What a training run is given: `TrainConfig` (the data, the features, the models' settings)
and its `FitConfig` (how each GNN stage is fitted), with the losses `fit` knows.

Plain dataclasses with no torch import, so that the command line reads its defaults and
choices from here without loading the models (`bmeg --help` stays fast).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bmeg.datasets.generate import DEFAULT_IMBALANCE, DEFAULT_SCENARIO, DEFAULT_TRACES
from bmeg.models.features import NODE_INPUTS, VARIANTS

#: Simulated training windows of a run's window GCN (`bmeg.training.window_gcn`; round 2's,
#: docs/issue-12.md, session 15).
TRAINING_WINDOWS = 200
#: Draws of the twin's training faults a bootstrap bags its node stage over (one node classifier
#: each, `bmeg.models.gcn_node.GCNNodeEnsemble`; 1: one classifier, as before issue 12 session 28).
NODE_DRAWS = 1
#: The losses of `bmeg.training.trainer.fit` (its docstring says what each does).
LOSSES = ("weighted", "focal", "sampling", "plain")


@dataclass(frozen=True)
class FitConfig:
    epochs: int = 15
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 1e-5
    loss: str = "weighted"
    #: Node stage: how much more a non-bottleneck node whose parent is a bottleneck (its client
    #: spans: calls to other services and to stores) weighs in the loss than other nodes of its
    #: class (`bmeg.training.trainer.callee_emphasis`); 1: as much (the default: 4 was not
    #: better on the testbed and worse on simulated Train Ticket, docs/issue-12.md, session 12).
    hard_negatives: float = 1.0
    device: str = "auto"
    nproc: int = 1
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; choose from {LOSSES}")
        if self.epochs < 1 or self.batch_size < 1 or self.nproc < 1:
            raise ValueError("epochs, batch_size and nproc must be at least 1")
        if self.hard_negatives < 1.0:
            raise ValueError("hard_negatives must be at least 1")


@dataclass(frozen=True)
class TrainConfig:
    dataset: str = "socialnet"
    traces: int = DEFAULT_TRACES
    imbalance: float = DEFAULT_IMBALANCE
    scenario: str = DEFAULT_SCENARIO
    seed: int = 0
    features: str = "full"  # one of bmeg.models.features.VARIANTS
    node_inputs: str = "raw"  # how the node classifier reads them, one of NODE_INPUTS
    min_precision: float = 0.8  # stage-1 threshold: best recall at this precision
    firm_window: int = 100  # traces over which FIRM's RI and CI are computed
    svm_C: float = 0.1  # the trace SVM's regularisation
    svm_max_services: int | None = None  # the router's cuts; None: chosen on validation
    svm_max_paths: int | None = None
    router_holdout: float = 0.34  # share of faulted services held out for the router's decision; 0: none
    router_fresh: int = 5000  # traces of other simulated fault draws, stratified by source, the router decides on; 0: held-out services
    router_tolerance: float = 0.01  # culprit F1 (and trace F1) the router may give up for a cheaper model
    pretrained: str | None = None  # a run directory whose GNN weights both stages start from
    fit: FitConfig = field(default_factory=FitConfig)


__all__ = ["LOSSES", "NODE_DRAWS", "NODE_INPUTS", "TRAINING_WINDOWS", "VARIANTS", "FitConfig", "TrainConfig"]
