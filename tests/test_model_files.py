"""Model files hold no pickle: a run directory with one is refused, and the pickle never runs."""

import os
import pickle
import time
from functools import partial

import pytest
import torch
from fastapi.testclient import TestClient

from bmeg.models.checkpoint import CheckpointError, save_checkpoint
from bmeg.models.detector import Detector


class _Payload:
    """Unpickling this creates `marker`: what a crafted model file would do with any code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _crafted_run_dir(tmp_path, pickle_name: str = "svm.joblib"):
    run_dir = tmp_path / "run"
    marker = tmp_path / "pwned"
    save_checkpoint(run_dir, {"application": "socialnet"})
    (run_dir / pickle_name).write_bytes(pickle.dumps(_Payload(str(marker)), protocol=4))
    return run_dir, marker


@pytest.mark.parametrize("name", ["svm.joblib", "model.pkl", "notes.bin"])
def test_a_run_directory_with_a_pickle_is_refused_unread(tmp_path, name):
    run_dir, marker = _crafted_run_dir(tmp_path, name)
    with pytest.raises(CheckpointError, match=f"{name} is a pickle.*never loads"):
        Detector.load(run_dir, device="cpu")
    assert not marker.exists()


def test_a_model_file_that_is_a_crafted_pickle_is_refused(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    run_dir.mkdir()
    torch.save({"format": "bmeg-checkpoint", "svm": _Payload(str(marker))}, run_dir / "model.pt")
    with pytest.raises(CheckpointError, match="not a bmeg checkpoint"):
        Detector.load(run_dir, device="cpu")
    assert not marker.exists()


def test_the_server_never_loads_a_pickle_at_start_or_reload(tmp_path):
    from bmeg.serving.app import create_app
    from bmeg.serving.settings import ServingSettings

    run_dir, marker = _crafted_run_dir(tmp_path)
    key = {"X-API-Key": "k3y"}
    with TestClient(create_app(partial(Detector.load, run_dir, device="cpu"), ServingSettings(api_key="k3y"))) as client:
        for _ in range(200):  # the first load runs in the background
            if client.get("/readyz").json().get("error"):
                break
            time.sleep(0.05)
        assert client.get("/readyz").status_code == 503
        assert "is a pickle" in client.get("/models", headers=key).json()["error"]
        reloaded = client.post("/models/reload", headers=key)
        assert reloaded.status_code == 422 and "is a pickle" in reloaded.json()["detail"]
    assert not marker.exists()


def test_retraining_into_an_old_run_directory_replaces_its_pickled_svm(tmp_path):
    from bmeg.models.checkpoint import load_checkpoint

    run_dir, marker = _crafted_run_dir(tmp_path)
    save_checkpoint(run_dir, {"application": "socialnet"})
    assert not (run_dir / "svm.joblib").exists()
    assert load_checkpoint(run_dir)["application"] == "socialnet" and not marker.exists()
