"""The FIRM baseline and small-graph fallback: an SVM on (relative importance, congestion intensity).

For each trace and each service on its critical path, over a trailing window of traces:
- relative importance RI: Pearson correlation between the service's critical-path latency and
  the critical path's total latency;
- congestion intensity CI: p99 / p50 of the service's latency.
An SVM classifies (RI, CI) as bottleneck or not (Qiu et al., FIRM, OSDI'20).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC


@dataclass(frozen=True)
class ServiceFrame:
    """Per trace and service: critical-path latency (µs), NaN where the service is off the path.

    Rows are traces in time order; `path_us` is each trace's critical-path total.
    """

    latency_us: np.ndarray  # [num_traces, num_services]
    path_us: np.ndarray  # [num_traces]
    services: list[str]

    def __post_init__(self) -> None:
        if self.latency_us.shape != (len(self.path_us), len(self.services)):
            raise ValueError(
                f"latency_us has shape {self.latency_us.shape}; expected "
                f"({len(self.path_us)}, {len(self.services)})"
            )


def firm_features(frame: ServiceFrame, window: int = 100) -> np.ndarray:
    """(RI, CI) over the trailing `window` traces: [num_traces, num_services, 2]."""
    latency = pd.DataFrame(frame.latency_us)
    path = pd.Series(frame.path_us)
    min_periods = max(3, window // 10)
    rolling = latency.rolling(window, min_periods=min_periods)
    relative_importance = rolling.corr(path).to_numpy()
    p50 = rolling.quantile(0.5).to_numpy()
    p99 = rolling.quantile(0.99).to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        congestion = p99 / p50
    features = np.stack([relative_importance, congestion], axis=-1)
    # A service too rarely on the path (or of constant latency) has no correlation: neutral 0 / 1.
    features[..., 0] = np.nan_to_num(features[..., 0], nan=0.0)
    features[..., 1] = np.nan_to_num(features[..., 1], nan=1.0, posinf=1.0)
    return features


class FirmSVM(ClassifierMixin, BaseEstimator):
    """SVM over FIRM features of (trace, service) pairs on the critical path.

    `fit(X, y)` takes X [num_pairs, 2] from `firm_features` and y [num_pairs] in {0, 1}.
    """

    def __init__(self, C: float = 1.0, gamma: str | float = "scale", max_samples: int = 20_000, seed: int = 0):
        self.C = C
        self.gamma = gamma
        self.max_samples = max_samples
        self.seed = seed

    def fit(self, X: np.ndarray, y: np.ndarray) -> "FirmSVM":
        X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.int64)
        if X.ndim != 2 or X.shape[1] != 2 or len(X) != len(y):
            raise ValueError(f"expected X [n, 2] and y [n]; got {X.shape} and {y.shape}")
        if len(np.unique(y)) < 2:
            raise ValueError("FirmSVM needs both bottleneck and non-bottleneck examples")
        # An RBF SVM is quadratic in samples: fit on a stratified subsample.
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
