"""The FIRM baseline and small-graph fallback: an SVM on (relative importance, congestion intensity).

For each trace and each service on its critical path, over a trailing window of traces:
- relative importance RI: Pearson correlation between the service's critical-path latency and
  the critical path's total latency;
- congestion intensity CI: p99 / p50 of the service's latency.
An SVM classifies (RI, CI) as bottleneck or not (Qiu et al., FIRM, OSDI'20).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC

from bmeg.graphs import SpanForest
from bmeg.graphs.critical_path import CriticalPaths

PATH, START = "__path__", "__start__"


def critical_path_frame(forest: SpanForest, services: np.ndarray, paths: CriticalPaths) -> pd.DataFrame:
    """Per trace (rows, forest order) and service (columns): critical-path time in µs, NaN off the path.

    The column `__path__` holds each trace's critical-path total; `__start__` its start time.
    """
    codes, names = pd.factorize(services)
    latency = np.zeros((forest.num_traces, len(names)))
    on_path = np.zeros_like(latency, dtype=bool)
    rows = np.flatnonzero(paths.on_path)
    np.add.at(latency, (forest.trace_index[rows], codes[rows]), paths.exclusive_ns[rows] / 1e3)
    on_path[forest.trace_index[rows], codes[rows]] = True
    frame = pd.DataFrame(np.where(on_path, latency, np.nan), columns=names)
    frame[PATH] = latency.sum(axis=1)
    frame[START] = forest.start_ns[forest.root]
    return frame


def firm_features(frame: pd.DataFrame, window: int = 100, history: pd.DataFrame | None = None) -> np.ndarray:
    """(RI, CI) per trace and service of `frame`, over the trailing `window` traces in time order.

    `history` (earlier traces, same layout) fills the window for the first traces of `frame`.
    Returns [num_traces, num_services, 2], services in the column order of `frame`.
    """
    services = [name for name in frame.columns if name not in (PATH, START)]
    earlier = history.reindex(columns=frame.columns) if history is not None else frame.iloc[:0]
    timeline = pd.concat([earlier, frame], ignore_index=True)
    order = np.argsort(timeline[START].to_numpy(), kind="stable")
    latency = timeline[services].to_numpy(dtype=np.float64)[order]
    path = timeline[PATH].to_numpy(dtype=np.float64)[order]
    # Row r of `frame` sits at position where[r] of the time-ordered timeline.
    where = np.empty(len(order), dtype=np.int64)
    where[order] = np.arange(len(order))
    where = where[len(earlier):]
    features = np.empty((len(frame), len(services), 2))
    for chunk in np.array_split(np.arange(len(frame)), max(1, len(frame) // 512)):
        features[chunk] = _window_features(latency, path, where[chunk], window)
    return features


def _window_features(latency: np.ndarray, path: np.ndarray, ends: np.ndarray, window: int) -> np.ndarray:
    """(RI, CI) over the windows that end at each row of `ends` (inclusive): [len(ends), S, 2]."""
    offsets = np.arange(-window + 1, 1)
    rows = ends[:, None] + offsets  # [E, W]
    valid_row = rows >= 0
    values = latency[np.clip(rows, 0, None)]  # [E, W, S]
    values[~valid_row] = np.nan
    totals = np.where(valid_row, path[np.clip(rows, 0, None)], np.nan)[:, :, None]  # [E, W, 1]
    seen = ~np.isnan(values)
    count = seen.sum(axis=1)  # [E, S]
    enough = count >= max(3, window // 10)
    # Pearson correlation over the rows where the service was on the path.
    x = np.where(seen, values, 0.0)
    y = np.where(seen, totals, 0.0)
    n = np.maximum(count, 1)
    mean_x, mean_y = x.sum(axis=1) / n, y.sum(axis=1) / n
    dx = np.where(seen, values - mean_x[:, None], 0.0)
    dy = np.where(seen, totals - mean_y[:, None], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        relative_importance = (dx * dy).sum(axis=1) / np.sqrt((dx**2).sum(axis=1) * (dy**2).sum(axis=1))
        congestion = _quantile(values, count, 0.99) / _quantile(values, count, 0.5)
    # A service too rarely on the path (or of constant latency) has no correlation: neutral 0 / 1.
    relative_importance = np.where(enough & np.isfinite(relative_importance), relative_importance, 0.0)
    congestion = np.where(enough & np.isfinite(congestion), congestion, 1.0)
    return np.stack([relative_importance, congestion], axis=-1)


def _quantile(values: np.ndarray, count: np.ndarray, q: float) -> np.ndarray:
    """Linear-interpolated quantile over axis 1, ignoring NaN (sorted last)."""
    ordered = np.sort(values, axis=1)  # NaN sorts to the end
    position = (np.maximum(count, 1) - 1) * q
    low = np.floor(position).astype(np.int64)
    high = np.minimum(low + 1, np.maximum(count - 1, 0))
    take = lambda index: np.take_along_axis(ordered, index[:, None, :], axis=1)[:, 0, :]  # noqa: E731
    return take(low) + (take(high) - take(low)) * (position - low)


class FirmSVM(ClassifierMixin, BaseEstimator):
    """SVM over FIRM features of (trace, service) pairs on the critical path.

    `fit(X, y)` takes X [num_pairs, 2] from `firm_features` and y [num_pairs] in {0, 1}.
    """

    def __init__(self, C: float = 1.0, gamma: str | float = "scale", max_samples: int = 4_000, seed: int = 0):
        self.C = C
        self.gamma = gamma
        self.max_samples = max_samples
        self.seed = seed

    def fit(self, X: np.ndarray, y: np.ndarray) -> FirmSVM:
        X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.int64)
        if X.ndim != 2 or X.shape[1] != 2 or len(X) != len(y):
            raise ValueError(f"expected X [n, 2] and y [n]; got {X.shape} and {y.shape}")
        if len(np.unique(y)) < 2:
            raise ValueError("FirmSVM needs both bottleneck and non-bottleneck examples")
        # An RBF SVM is quadratic in samples to fit and linear in support vectors to apply:
        # fit on a stratified subsample.
        index = _stratified_subsample(y, self.max_samples, np.random.default_rng(self.seed))
        self.pipeline_ = make_pipeline(
            StandardScaler(), SVC(C=self.C, gamma=self.gamma, class_weight="balanced")
        )
        self.pipeline_.fit(X[index], y[index])
        self.classes_ = np.array([0, 1])
        return self

    def score_samples(self, X: np.ndarray) -> np.ndarray:
        """A bottleneck score in (0, 1): the logistic of the SVM margin."""
        margin = self.pipeline_.decision_function(np.asarray(X, dtype=np.float64))
        return 1.0 / (1.0 + np.exp(-margin))

    def predict(self, X: np.ndarray) -> np.ndarray:
        return (self.score_samples(X) >= 0.5).astype(np.int64)


def _stratified_subsample(y: np.ndarray, limit: int, rng: np.random.Generator) -> np.ndarray:
    if len(y) <= limit:
        return np.arange(len(y))
    parts = []
    for label in np.unique(y):
        members = np.flatnonzero(y == label)
        share = max(1, round(limit * len(members) / len(y)))
        parts.append(rng.choice(members, size=min(share, len(members)), replace=False))
    return np.sort(np.concatenate(parts))
