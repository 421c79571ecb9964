"""Where bmeg finds the files it ships (topologies, campaigns, recipes, policies) and where it
caches generated data.

Shipped files live inside the package and are read with `importlib.resources`, so an installed
wheel finds them wherever it runs; a user's own file is always given by its path.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path


#: In a run directory of `bmeg bootstrap`: the normal traces a window is ranked against.
NORMAL_TRACES_FILE = "normal.parquet"


def shipped_folder(package: str, folder: str) -> Path:
    """The folder `folder` shipped inside `package` (e.g. `bmeg.faultinject`, `topologies`)."""
    return Path(str(files(package).joinpath(folder)))


def shipped_file(name_or_path: str | Path, package: str, folder: str) -> Path | None:
    """`name_or_path` when it is a file, else the shipped `<folder>/<name>.yaml`, else None."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_folder(package, folder) / f"{name_or_path}.yaml"
    return shipped if shipped.is_file() else None


def shipped_names(package: str, folder: str) -> list[str]:
    """The names of the YAML files shipped in `<package>/<folder>`, for error messages."""
    return sorted(p.stem for p in shipped_folder(package, folder).glob("*.yaml"))


def cache_dir() -> Path:
    """Generated datasets and default runs go here, never into git."""
    path = Path(os.environ.get("BMEG_CACHE", Path.home() / ".cache" / "bmeg"))
    path.mkdir(parents=True, exist_ok=True)
    return path
