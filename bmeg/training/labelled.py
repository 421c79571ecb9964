"""`Labelled`: a dataset as training and evaluation read it (assembled, labelled, split).

`bmeg.training.pipeline.label` makes it; the pipeline fits on it and `bmeg.training.evaluate` scores on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from bmeg.graphs import SpanForest


@dataclass
class Labelled:
    """A dataset assembled into a forest, with labels in forest order and the split."""

    forest: SpanForest
    y: np.ndarray  # [T]
    node_y: np.ndarray  # [N]
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    traces: pa.Table  # trace labels in forest order
    # the dataset's context traces (history only: no labels, in no split); None: none stored
    context: SpanForest | None = None
