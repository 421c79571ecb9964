"""Checkpoints: one run directory holds the trained models and what is needed to use them.

`RUN_DIR/model.pt` is a dict of tensors and plain values (numbers, strings, lists, dicts),
loaded with `weights_only=True`: torch's restricted unpickler, which builds only allow-listed
types and never runs code. It holds the format version, bmeg version, application, feature spec,
service vocabulary, baselines, thresholds, the router's cuts, both networks' weights, both
SVMs as plain arrays (`TraceSVM.to_state`, `FirmSVM.to_state`) and the metrics.

No other file of a run directory is ever loaded as code or objects: a run directory that holds
a pickle (a `*.joblib`, `*.pkl`, `*.pickle` file, or any file that starts like one, such as
the `svm.joblib` of format 1) is refused before anything is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bmeg.version import __version__

FORMAT = "bmeg-checkpoint"
FORMAT_VERSION = 2
MODEL_FILE = "model.pt"
PICKLE_SUFFIXES = (".joblib", ".pkl", ".pickle")
#: The pickled SVM of format 1, which a new checkpoint written into the same directory replaces.
LEGACY_SVM_FILE = "svm.joblib"


class CheckpointError(ValueError):
    """A run directory that is missing, damaged, unsafe, from another version or another application."""


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "format_version": FORMAT_VERSION, "bmeg_version": __version__, **state}
    torch.save(payload, run_dir / MODEL_FILE)
    (run_dir / LEGACY_SVM_FILE).unlink(missing_ok=True)  # retraining into an old run directory


def refuse_pickles(run_dir: Path) -> None:
    """CheckpointError when the run directory holds a pickle: it is never loaded."""
    for path in sorted(Path(run_dir).iterdir()):
        if path.name == MODEL_FILE or not path.is_file():
            continue
        if path.suffix.lower() in PICKLE_SUFFIXES or _starts_like_a_pickle(path):
            raise CheckpointError(
                f"{path} is a pickle, which can run code when loaded: bmeg never loads one. Remove it "
                f"(bmeg >= 0.1 keeps every model in {MODEL_FILE}) or retrain with `bmeg train --out {run_dir}`"
            )


def _starts_like_a_pickle(path: Path) -> bool:
    """Pickle protocols 2-5 start with the PROTO opcode 0x80 and the protocol number."""
    with path.open("rb") as handle:
        head = handle.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def load_tensor_dict(path: Path, format_name: str, what: str) -> dict[str, Any]:
    """The dict of tensors and plain values saved at `path` with `"format": format_name`, read by
    torch's restricted unpickler; CheckpointError naming `what` it should be otherwise."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for damaged, foreign or unsafe files
        raise CheckpointError(f"{path} is not {what} ({type(error).__name__}: {error})") from error
    if not isinstance(state, dict) or state.get("format") != format_name:
        raise CheckpointError(f"{path} is not {what}")
    return state


def load_checkpoint(run_dir: Path, *, application: str | None = None) -> dict[str, Any]:
    """The saved state; CheckpointError with the reason when it cannot (or must not) be used."""
    run_dir = Path(run_dir)
    model_path = run_dir / MODEL_FILE
    if not model_path.is_file():
        raise CheckpointError(f"no model at {model_path}: train one with `bmeg train --out {run_dir}`")
    refuse_pickles(run_dir)
    state = load_tensor_dict(model_path, FORMAT, "a bmeg checkpoint")
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
    return state
