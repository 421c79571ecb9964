from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["conftest_infra"]  # fixtures for Kafka and the Kubernetes API server

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
