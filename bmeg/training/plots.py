"""PNG plots of a training run: learning curves, confusion matrices, precision-recall curves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # figures without pyplot: no backend switch, no display
from sklearn.metrics import ConfusionMatrixDisplay, PrecisionRecallDisplay


def plot_run(out: Path, histories: dict, y_test: np.ndarray, scores: dict[str, np.ndarray],
             verdicts: dict[str, np.ndarray]) -> list[Path]:
    """Write the plots into `out`; returns their paths."""
    return [
        _learning_curves(out / "training_curves.png", histories),
        _confusion(out / "confusion_matrices.png", y_test, verdicts),
        _precision_recall(out / "precision_recall.png", y_test, scores),
    ]


def _learning_curves(path: Path, histories: dict) -> Path:
    figure = Figure(figsize=(10, 4))
    axes = figure.subplots(1, 2)
    for name, history in histories.items():
        axes[0].plot(history.train_loss, label=name)
        axes[1].plot(history.val_ap, label=name)
    axes[0].set(title="training loss", xlabel="epoch")
    axes[1].set(title="validation average precision", xlabel="epoch")
    for axis in axes:
        axis.legend()
    return _save(figure, path)


def _confusion(path: Path, y_test: np.ndarray, verdicts: dict[str, np.ndarray]) -> Path:
    figure = Figure(figsize=(4.5 * len(verdicts), 4))
    axes = figure.subplots(1, len(verdicts))
    for axis, (name, predicted) in zip(np.atleast_1d(axes), verdicts.items()):
        ConfusionMatrixDisplay.from_predictions(
            y_test, predicted, labels=[0, 1], display_labels=["normal", "bottleneck"], ax=axis, colorbar=False
        )
        axis.set_title(name)
    return _save(figure, path)


def _precision_recall(path: Path, y_test: np.ndarray, scores: dict[str, np.ndarray]) -> Path:
    figure = Figure(figsize=(5, 4))
    axis = figure.subplots()
    for name, score in scores.items():
        PrecisionRecallDisplay.from_predictions(y_test, score, name=name, ax=axis)
    axis.set_title("trace-level precision-recall (test)")
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path
