"""Checkpoints: one run directory holds the trained models and what is needed to use them.

`RUN_DIR/model.pt` is a dict of tensors and plain values (loaded with `weights_only=True`, so
a checkpoint cannot run code): format version, bmeg version, application, feature spec,
service vocabulary, baselines, thresholds, router settings, both networks' weights, metrics.
`RUN_DIR/svm.joblib` holds the scikit-learn SVM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import joblib
import torch

from bmeg.version import __version__

FORMAT = "bmeg-checkpoint"
FORMAT_VERSION = 1
MODEL_FILE = "model.pt"
SVM_FILE = "svm.joblib"


class CheckpointError(ValueError):
    """A run directory that is missing, damaged, from another version or another application."""


def save_checkpoint(run_dir: Path, state: dict[str, Any], svm: Any) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "format_version": FORMAT_VERSION, "bmeg_version": __version__, **state}
    torch.save(payload, run_dir / MODEL_FILE)
    joblib.dump(svm, run_dir / SVM_FILE)


def load_checkpoint(run_dir: Path, *, application: str | None = None) -> tuple[dict[str, Any], Any]:
    """The saved state and SVM; CheckpointError with the reason when they cannot be used."""
    run_dir = Path(run_dir)
    model_path = run_dir / MODEL_FILE
    if not model_path.is_file():
        raise CheckpointError(f"no model at {model_path}: train one with `bmeg train --out {run_dir}`")
    try:
        state = torch.load(model_path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for damaged or foreign files
        raise CheckpointError(f"{model_path} is not a bmeg checkpoint ({type(error).__name__}: {error})") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{model_path} is not a bmeg checkpoint")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{model_path} has checkpoint format {state.get('format_version')} "
            f"(written by bmeg {state.get('bmeg_version')}); this bmeg {__version__} reads format "
            f"{FORMAT_VERSION}: retrain with `bmeg train`"
        )
    if application is not None and state["application"] != application:
        raise CheckpointError(
            f"{model_path} was trained on {state['application']!r}, not {application!r}"
        )
    try:
        svm = joblib.load(run_dir / SVM_FILE)
    except Exception as error:
        raise CheckpointError(f"{run_dir / SVM_FILE} cannot be loaded ({type(error).__name__}: {error})") from error
    return state, svm
