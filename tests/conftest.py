from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

# hypothesis's 200-ms deadline per example fails tests on a loaded 2-core machine (CI shares it):
# no deadline unless a test sets one
settings.register_profile("bmeg", deadline=None)
settings.load_profile("bmeg")

# fixtures for Kafka and the Kubernetes API server; a small trained model for the serving tests
pytest_plugins = ["conftest_infra", "serving_fixtures"]

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """`../shared` beside the project; tests that need it skip cleanly where it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent: the shared fixtures and data are not beside the project")
    return SHARED


@pytest.fixture
def output_dir(request) -> Path:
    """A folder for artefacts a test wants kept (screenshots, plots): test-output/<test name>."""
    path = Path(__file__).resolve().parents[1] / "test-output" / request.node.name
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A small socialnet model trained once per test session (real training, small data)."""
    import os

    from bmeg.training import train

    root = tmp_path_factory.mktemp("trained")
    previous = os.environ.get("BMEG_CACHE")
    os.environ["BMEG_CACHE"] = str(root / "cache")
    try:
        train("socialnet", out=root / "run", traces=3000, imbalance=0.1, epochs=8, seed=3, progress=False)
    finally:
        if previous is None:
            os.environ.pop("BMEG_CACHE")
        else:
            os.environ["BMEG_CACHE"] = previous
    return root / "run"
