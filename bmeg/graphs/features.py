"""Per-node columns of call graphs, computed for all spans of a forest at once.

Built-in per-node columns (times in microseconds), computed on demand by `NodeColumns`
(`base_columns` returns them all):

- `duration_us`: the span's duration, the thesis's *service time*;
- `self_time_us`: duration not covered by any child (union of children, clipped to the span);
- `cp_exclusive_us`: exclusive critical-path time (0 off the path);
- `on_critical_path`: 1.0 / 0.0;
- `start_offset_us`: start relative to the trace's root;
- `depth`, `fan_out`: position and number of children in the call tree;
- `log_*`: log1p of each time and of the fan-out, for models that want tame scales.

`SERVICE_TIME_ONLY` (the thesis's feature) and `DEFAULT_FEATURES` name the columns the models
start from; the models' feature encoder (`bmeg.models.features`) adds per-operation baselines
and history to them, and `bmeg.models.graphset` batches the result for the GNNs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from bmeg.graphs.assemble import SpanForest
from bmeg.graphs.critical_path import CriticalPaths, critical_paths

#: The thesis's feature: the service time of each node, no feature engineering.
SERVICE_TIME_ONLY: tuple[str, ...] = ("log_duration_us",)
#: The call-graph columns: time, own time, critical path, position.
DEFAULT_FEATURES: tuple[str, ...] = (
    "log_duration_us",
    "log_self_time_us",
    "log_cp_exclusive_us",
    "on_critical_path",
    "log_start_offset_us",
    "depth",
    "log_fan_out",
)


class NodeColumns(Mapping[str, np.ndarray]):
    """The built-in per-node columns of a forest, each computed when first asked for
    (so a spec of service time only never computes critical paths)."""

    def __init__(self, forest: SpanForest, paths: CriticalPaths | None = None):
        self.forest = forest
        self._paths = paths
        self._values: dict[str, np.ndarray] = {}

    @property
    def paths(self) -> CriticalPaths:
        if self._paths is None:
            self._paths = critical_paths(self.forest)
        return self._paths

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._values:
            if name in _BUILT_IN:
                self._values[name] = np.asarray(_BUILT_IN[name](self), dtype=np.float64)
            elif name.removeprefix("log_") in LOG_SCALED:
                # Async children that kept their timing may start before the root: signed log.
                plain = self[name.removeprefix("log_")]
                self._values[name] = np.sign(plain) * np.log1p(np.abs(plain))
            else:
                raise KeyError(name)
        return self._values[name]

    def __iter__(self):
        names = [*_BUILT_IN, *(f"log_{name}" for name in LOG_SCALED)]
        return iter(names + [name for name in self._values if name not in names])

    def __len__(self) -> int:
        return len(list(iter(self)))


def _start_offset_us(columns: NodeColumns) -> np.ndarray:
    forest = columns.forest
    return (forest.start_ns - forest.start_ns[forest.root][forest.trace_index]) / 1e3


_BUILT_IN: dict[str, Callable[[NodeColumns], np.ndarray]] = {
    "duration_us": lambda c: c.forest.duration_ns / 1e3,
    "self_time_us": lambda c: self_time_ns(c.forest) / 1e3,
    "cp_exclusive_us": lambda c: c.paths.exclusive_ns / 1e3,
    "on_critical_path": lambda c: c.paths.on_path,
    "start_offset_us": _start_offset_us,
    "depth": lambda c: c.forest.depth,
    "fan_out": lambda c: np.bincount(c.forest.parent[c.forest.parent >= 0], minlength=c.forest.num_spans),
}
LOG_SCALED = ("duration_us", "self_time_us", "cp_exclusive_us", "start_offset_us", "fan_out")


def base_columns(forest: SpanForest, paths: CriticalPaths | None = None) -> dict[str, np.ndarray]:
    """All built-in per-node columns (see the module docstring), float64 [num_spans]."""
    columns = NodeColumns(forest, paths)
    return {name: columns[name] for name in columns}


def self_time_ns(forest: SpanForest) -> np.ndarray:
    """Duration of each span not covered by the union of its children (clipped to the span):
    `SpanForest.self_time_ns`, computed once per forest (read-only)."""
    return forest.self_time_ns
