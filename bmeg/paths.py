"""Where bmeg finds its specs (topologies, scenarios, catalogues) and caches generated data."""

from __future__ import annotations

import os
from pathlib import Path

#: The project root: top-level folders `datasets/`, `faultinject/`, `mitigation/`, `training/`.
PROJECT_ROOT = Path(os.environ.get("BMEG_HOME", Path(__file__).resolve().parents[1]))


def cache_dir() -> Path:
    """Generated datasets and default runs go here, never into git."""
    path = Path(os.environ.get("BMEG_CACHE", Path.home() / ".cache" / "bmeg"))
    path.mkdir(parents=True, exist_ok=True)
    return path
