"""The wheel works outside a checkout: built from the repository, installed with the core
dependencies only (no extra) into a fresh virtual environment, then run from another directory.

What it guards: every file the library reads at run time (topologies, campaigns, recipes,
policies, the parameter catalogue, the page) ships inside the package, and the core commands
(`generate`, `train`, `diagnose`) import nothing from an extra (FastAPI, Kafka, Kubernetes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"

pytestmark = pytest.mark.integration


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel and its core dependencies (pinned by the lock file)."""
    root = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(root / "dist"), str(REPO)],
         cwd=root, env=env, timeout=600)
    (wheel,) = (root / "dist").glob("bmeg-*.whl")
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    constraints = ["-c", str(LOCK)] if LOCK.is_file() else []
    _run([str(python), "-m", "pip", "install", "-q", *constraints, str(wheel)], cwd=root, env=env, timeout=1800)
    yield root / "venv" / "bin"
    shutil.rmtree(root, ignore_errors=True)  # ~6 GB; freed now, not when the run ends


def test_the_installed_wheel_generates_trains_and_diagnoses_from_another_directory(
        installed: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["BMEG_CACHE"] = str(tmp_path / "cache")  # never a stale model from the user's cache
    bmeg = str(installed / "bmeg")
    work = tmp_path / "elsewhere"
    work.mkdir()

    # the core install has none of the extras
    python = str(installed / "python")
    for extra_module in ("fastapi", "kafka", "kubernetes"):
        probe = subprocess.run([python, "-c", f"import {extra_module}"], capture_output=True, env=env)
        assert probe.returncode != 0, f"{extra_module} was installed without its extra"

    _run([bmeg, "generate", "socialnet", "--traces", "500", "--out", "data", "--json"], cwd=work, env=env, timeout=300)
    card = json.loads((work / "data" / "dataset.json").read_text())
    assert card["traces"] == 500

    metrics = json.loads(_run([bmeg, "train", "--dataset", "data", "--epochs", "2", "--out", "run", "--json"],
                              cwd=work, env=env, timeout=900))
    assert 0.0 <= metrics["bmeg"]["accuracy"] <= 1.0

    other = tmp_path / "other"
    other.mkdir()
    diagnosis = json.loads(_run([bmeg, "diagnose", str(work / "data" / "spans.parquet"), "--model", str(work / "run"),
                                 "--json"], cwd=other, env=env, timeout=300))
    assert diagnosis["application"] == "socialnet"
    assert len(diagnosis["traces"]) == 500

    # shipped specs resolve by name inside the installed package, not from a checkout
    recipes = _run([python, "-c", "from bmeg.paths import shipped_names; print(shipped_names('bmeg.training', 'recipes'))"],
                   cwd=other, env=env, timeout=60)
    assert "socialnet-mitigation" in recipes
