"""Training and evaluation of the detector (`bmeg train`)."""

from __future__ import annotations

from pathlib import Path

from bmeg.training.config import FitConfig


def train(dataset: str = "socialnet", *, out: str | Path | None = None, epochs: int = FitConfig.epochs,
          device: str = FitConfig.device, nproc: int = FitConfig.nproc, loss: str = FitConfig.loss,
          hard_negatives: float = FitConfig.hard_negatives, progress: bool = True, **options):
    """Train on a dataset (name or folder); returns (Detector, metrics). `options` are `TrainConfig` fields."""
    from bmeg.training.pipeline import TrainConfig, run

    fit = FitConfig(epochs=epochs, device=device, nproc=nproc, loss=loss, hard_negatives=hard_negatives, progress=progress)
    return run(TrainConfig(dataset=str(dataset), fit=fit, **options), None if out is None else Path(out))


__all__ = ["FitConfig", "train"]
