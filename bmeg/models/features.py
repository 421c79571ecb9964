"""Node features for the models: the graph stage's columns, plus what the thesis did not have.

- `thesis`: only the service time of each node (log duration), as in the B-MEG thesis.
- `full` (default): the call-graph columns (`bmeg.graphs.DEFAULT_FEATURES`), plus per-operation
  baselines (how far a node's self time and duration sit from the normal distribution of its
  (service, operation), in robust z-scores, including the wait between the parent's start and
  the node's: a callee's queue shows there, before its server span starts) and temporal context (the same z-score of the
  node's service, averaged over its recent visits in earlier traces).
- `relative`: only columns that mean the same in every application, so that a model
  trained on one (a twin, a simulated family) reads another: no absolute time, no service
  identity, no position that depends on the application's shape. Per node, against its own
  (service, operation)'s normal baseline: the robust z-scores of its self time, its duration
  and its wait after the parent's start; the same z-scores of its parent (a call seen from
  the other end: a client span's self time is the call's gap, so a server span sees its
  caller's gap and a client span its caller's work); the share of its time its children
  explain, as a z-score; its call pattern against the operation's normal one (children
  missing, extra, repeated: the log ratio of the child count to its normal median, and the
  share of children calling an operation another sibling also calls, above normal); its error
  status, and whether the error begins there (no child has one: callers that record a failed
  call are not where it began); its share of the trace's end-to-end time on the critical
  path, as a z-score; plus the unknown-operation flag and the temporal context of `full`.
  Shares and times enter only as deviations from the operation's normal: a raw share says
  where time is usually spent (a large orchestrator), and a model reading it ranks the same
  services first whatever changed (issue 12: the GNN alone put the orchestrators first on
  real faults).
- `relative-siblings` (what `bmeg bootstrap` trains with, since session 13; issue 12):
  `relative` plus `z_duration_beyond_siblings`, a node's duration z-score minus the mean of its siblings' (the other children of its parent;
  its own z-score where it has none). A slow store stretches only its own calls; a caller
  starved of CPU, or whose egress is delayed, stretches all of its calls at once, so its
  store's call stands out from its siblings only in the first case.

Where the earlier traces come from: over a recorded stream (training, evaluation: `past=None`)
they are the forest's own earlier traces, and those of `context` where given (a generated
dataset's traces simulated but not sampled, `bmeg.datasets.generate`: read as history, never
given rows); a served trace (`past` given: each service's latest
self-time z-scores, oldest first, from a `bmeg.models.history.StreamHistory`) reads only `past`
and its own trace, never the other traces of its batch, so its verdict does not depend on them.

`FeatureEncoder` is fitted on normal training traces, like a scikit-learn transformer, and is
saved in the checkpoint as plain lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.graphs import DEFAULT_FEATURES, SERVICE_TIME_ONLY, SpanForest, base_columns, node_services
from bmeg.graphs import operation_key_array as _operation_key_array
from bmeg.graphs import operation_keys as _operation_keys
from bmeg.graphs.critical_path import CriticalPaths
from bmeg.graphs.features import NodeColumns

VARIANTS = ("thesis", "full", "relative", "relative-siblings")
#: What a model trained on a twin reads (`bmeg bootstrap`, `bmeg pretrain`): a twin is never the
#: real application, so columns that mean the same in both, and a call's stretch beside its
#: siblings' (docs/issue-12.md, session 13: ahead of `relative` on two testbed recordings).
BOOTSTRAP_FEATURES = "relative-siblings"
#: The variants built on `relative`'s columns.
RELATIVE_VARIANTS = ("relative", "relative-siblings")
BASELINE_COLUMNS = ("log_self_time_us", "log_duration_us", "log_wait_us")
#: Baselines the `relative` variant adds: z-scored like the first three, except the child
#: counts, whose difference from the median is used as it is (a count has no useful spread).
STRUCTURE_COLUMNS = ("explained_share", "log_children", "repeated_share", "cp_share")
RELATIVE_COLUMNS = (
    "z_log_self_time_us", "z_log_duration_us", "z_log_wait_us",
    "parent_z_log_self_time_us", "parent_z_log_duration_us",
    "z_explained_share", "children_delta", "repeated_delta",
    "error", "error_origin", "z_cp_share",
)
#: How the node classifier reads these features (`bmeg.models.gcn_node`): as they are, or
#: through asinh (linear near 0, logarithmic far out; docs/issue-12.md, session 31).
NODE_INPUTS = ("raw", "asinh")
#: Where a z-score is capped: a node 50 robust deviations off is as off as it matters.
Z_LIMIT = 50.0
#: The smallest spread of a baseline, in log units (~5%), so constant operations don't explode.
MIN_SPREAD = 0.05


@dataclass
class FeatureEncoder:
    variant: str = "full"
    history: int = 50  # visits of a service that make its temporal context
    keys: list[str] = field(default_factory=list)  # "service\x1foperation"
    medians: list[list[float]] = field(default_factory=list)  # [key][baseline column]
    spreads: list[list[float]] = field(default_factory=list)
    # The baselines as a lookup, built once: a served request would otherwise rebuild them.
    _baselines: tuple[pa.Array, np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown feature variant {self.variant!r}; choose from {VARIANTS}")
        self._index_baselines()

    def _index_baselines(self) -> None:
        self._baselines = (pa.array(self.keys, pa.string()), np.asarray(self.medians, dtype=np.float64),
                           np.asarray(self.spreads, dtype=np.float64))

    @property
    def names(self) -> list[str]:
        if self.variant == "thesis":
            return list(SERVICE_TIME_ONLY)
        if self.variant in RELATIVE_VARIANTS:
            extra = ["z_duration_beyond_siblings"] if self.variant == "relative-siblings" else []
            return [*RELATIVE_COLUMNS, *extra, "unknown_operation", "recent_z_self_time"]
        z_names = [f"z_{name}" for name in BASELINE_COLUMNS]
        return [*DEFAULT_FEATURES, "log_wait_us", *z_names, "unknown_operation", "recent_z_self_time"]

    @property
    def baseline_columns(self) -> tuple[str, ...]:
        return BASELINE_COLUMNS + STRUCTURE_COLUMNS if self.variant in RELATIVE_VARIANTS else BASELINE_COLUMNS

    @property
    def num_features(self) -> int:
        return len(self.names)

    def fit(self, forest: SpanForest, paths: CriticalPaths | None = None) -> FeatureEncoder:
        """Per-operation baselines from (normal) traces: median and p90 - median of log times."""
        columns = _columns(forest, paths)
        names = list(self.baseline_columns)
        frame = pd.DataFrame({name: columns[name] for name in names})
        frame["key"] = _operation_keys(forest)
        grouped = frame.groupby("key", sort=True)
        median = grouped.median()
        spread = (grouped.quantile(0.9) - median).clip(lower=MIN_SPREAD)
        self.keys = median.index.tolist()
        self.medians = median[names].to_numpy().tolist()
        self.spreads = spread[names].to_numpy().tolist()
        self._index_baselines()
        return self

    def transform(self, forest: SpanForest, paths: CriticalPaths | None = None,
                  services: np.ndarray | None = None, past: Mapping[str, np.ndarray] | None = None,
                  context: SpanForest | None = None) -> np.ndarray:
        """float32 [num_spans, num_features], in `names` order (`services`: node services, if known;
        `past`: the stream's earlier visits per service; `context`: the recorded stream's other
        traces, history only, with `past` None; see the module's docstring)."""
        keys = _operation_key_array(forest)  # read twice below: made once
        columns = _columns(forest, paths, keys)
        if self.variant == "thesis":
            return _stack(columns, SERVICE_TIME_ONLY)
        if not self.keys:
            raise ValueError("FeatureEncoder is not fitted: call fit() on normal traces first")
        position = self._positions(forest, keys)
        z, known = self._z_scores(position, columns)
        columns.update({f"z_{name}": z[:, i] for i, name in enumerate(self.baseline_columns)})
        columns["unknown_operation"] = (~known).astype(np.float64)
        if services is None:
            services = node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False)
        if past is None:
            visits = [services, _trace_starts(forest), z[:, 0]]
            if context is not None:  # after the forest's nodes: a trace start both share sorts the forest's first
                visits = [np.concatenate(pair) for pair in zip(visits, self._visits(context), strict=True)]
            columns["recent_z_self_time"] = self._recent(*visits)[: forest.num_spans]
        else:
            columns["recent_z_self_time"] = self._recent_after(forest, z[:, 0], services, past)
        if self.variant in RELATIVE_VARIANTS:
            columns.update(_relative_columns(forest, columns, z, self._raw_deltas(position, columns)))
            columns["z_duration_beyond_siblings"] = beyond_siblings(forest.parent, z[:, 1])
        return _stack(columns, self.names)

    def _positions(self, forest: SpanForest, keys: pa.Array | None = None) -> np.ndarray:
        """Each span's operation among the baselines' keys, -1 where unknown (looked up in Arrow:
        pandas' `get_indexer` on Python strings, twice per batch, was ~7% of the consumer's diagnosing);
        `keys`: the forest's `operation_key_array`, when made already."""
        known, _, _ = self._baselines
        keys = _operation_key_array(forest) if keys is None else keys
        return pc.index_in(keys, value_set=known).fill_null(-1).to_numpy(zero_copy_only=False)

    def _raw_deltas(self, position: np.ndarray, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Child count and repeated share minus the operation's normal median (0 where unknown)."""
        _, medians, _ = self._baselines
        known = position >= 0
        deltas = {}
        for name, target in (("log_children", "children_delta"), ("repeated_share", "repeated_delta")):
            i = self.baseline_columns.index(name)
            delta = np.zeros(len(position))
            delta[known] = columns[name][known] - medians[position[known], i]
            deltas[target] = delta
        return deltas

    def to_state(self) -> dict:
        return {"variant": self.variant, "history": self.history, "keys": self.keys,
                "medians": self.medians, "spreads": self.spreads, "names": self.names}

    @classmethod
    def from_state(cls, state: dict) -> FeatureEncoder:
        """The encoder saved by `to_state`; ValueError when it was saved with other features."""
        state = dict(state)
        saved_names = state.pop("names", None)
        encoder = cls(**state)
        if saved_names != encoder.names:
            raise ValueError(f"the checkpoint's features {saved_names} differ from this bmeg's {encoder.names}")
        return encoder

    def _visits(self, context: SpanForest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(service, trace start, self-time z-score) of each node of `context`."""
        services = node_services(context, storage_nodes=True).to_numpy(zero_copy_only=False)
        z, _ = self._z_scores(self._positions(context), NodeColumns(context), count=1)
        return services, _trace_starts(context), z[:, 0]

    def _z_scores(self, position: np.ndarray, columns: Mapping[str, np.ndarray],
                  count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Robust z-scores of the first `count` baseline columns (all by default), and which nodes' operations are known."""
        _, medians, spreads = self._baselines
        names = self.baseline_columns[:count]
        known = position >= 0
        values = np.stack([columns[name] for name in names], axis=1)
        median = medians[position[known]][:, : len(names)]
        spread = spreads[position[known]][:, : len(names)]
        z = np.zeros_like(values)
        z[known] = np.clip((values[known] - median) / spread, -Z_LIMIT, Z_LIMIT)
        return z, known

    def _recent(self, services: np.ndarray, trace_start: np.ndarray, z_self: np.ndarray) -> np.ndarray:
        """Per visit (node), the mean z-score of its service over its last `history` visits, in
        time order (by trace start; a trace's own nodes in their order)."""
        codes, _ = pd.factorize(services)
        order = np.lexsort((trace_start, codes))  # by service, then time
        group = codes[order]
        first = np.r_[0, np.flatnonzero(group[1:] != group[:-1]) + 1]
        group_start = np.repeat(first, np.diff(np.r_[first, len(order)]))
        position = np.arange(len(order))
        window_start = np.maximum(group_start, position - self.history + 1)
        running = np.r_[0.0, np.cumsum(z_self[order])]
        recent = np.empty(len(order))
        recent[order] = (running[position + 1] - running[window_start]) / (position + 1 - window_start)
        return recent

    def _recent_after(self, forest: SpanForest, z_self: np.ndarray, services: np.ndarray,
                      past: Mapping[str, np.ndarray]) -> np.ndarray:
        """Like `_recent`, each trace alone after `past`: the mean over the service's visits in
        the trace up to the node, preceded by its latest visits in `past`, `history` in all."""
        codes, names = pd.factorize(services)
        order = np.lexsort((np.arange(len(codes)), codes, forest.trace_index))  # by trace, service, node
        group = forest.trace_index[order] * len(names) + codes[order]
        first = np.r_[0, np.flatnonzero(group[1:] != group[:-1]) + 1]
        group_start = np.repeat(first, np.diff(np.r_[first, len(order)]))
        position = np.arange(len(order))
        own = np.minimum(position - group_start + 1, self.history)  # this trace's visits in the window
        running = np.r_[0.0, np.cumsum(z_self[order])]
        own_sum = running[position + 1] - running[position + 1 - own]
        # each service's latest past visits, newest first, as cumulative sums: tail[k] = sum of the last k
        latest = [np.asarray(past.get(name, ()), dtype=np.float64)[-self.history:][::-1] for name in names]
        tails = np.concatenate([np.r_[0.0, np.cumsum(values)] for values in latest]) if latest else np.zeros(1)
        tail_start = np.r_[0, np.cumsum([len(values) + 1 for values in latest])][:-1].astype(np.int64)
        available = np.array([len(values) for values in latest], dtype=np.int64)
        code = codes[order]
        taken = np.minimum(available[code], self.history - own)
        recent = np.empty(len(order))
        recent[order] = (own_sum + tails[tail_start[code] + taken]) / (own + taken)
        return recent


def _trace_starts(forest: SpanForest) -> np.ndarray:
    """Each node's trace's start (its root's)."""
    return forest.start_ns[forest.root][forest.trace_index]


def _columns(forest: SpanForest, paths: CriticalPaths | None, keys: pa.Array | None = None) -> dict[str, np.ndarray]:
    """The graph stage's columns plus `log_wait_us` (start minus the parent's start, 0 at roots)
    and the structure columns: `explained_share` (1 - self time / duration), `log_children`
    (log1p of the child count), `repeated_share` (share of children whose (service, operation)
    a sibling also has), `cp_share` (exclusive critical-path time over the trace's end-to-end time).
    `keys`: the forest's `operation_key_array`, when made already."""
    columns = base_columns(forest, paths)
    parent = forest.parent
    has_parent = parent >= 0
    wait_us = np.zeros(forest.num_spans)
    wait_us[has_parent] = (forest.start_ns[has_parent] - forest.start_ns[parent[has_parent]]) / 1e3
    columns["log_wait_us"] = np.log1p(np.maximum(wait_us, 0.0))
    duration = np.maximum(columns["duration_us"], 1e-3)
    columns["explained_share"] = np.clip(1.0 - columns["self_time_us"] / duration, 0.0, 1.0)
    children = np.bincount(parent[has_parent], minlength=forest.num_spans).astype(np.float64)
    columns["log_children"] = np.log1p(children)
    child = np.flatnonzero(has_parent)
    # numbered by Arrow's hashing: np.unique sorted Python strings (~15% of a batch), pandas hashed them
    keys = _operation_key_array(forest) if keys is None else keys
    key_code = pc.dictionary_encode(keys.take(pa.array(child))).indices.to_numpy(zero_copy_only=False)
    # children repeating a sibling's key = children - distinct (parent, key) pairs under each
    # parent: one sort of integers (a pandas groupby cost ~10 µs a trace)
    keys = int(key_code.max(initial=0)) + 1
    distinct = np.bincount(np.unique(parent[child] * keys + key_code) // keys, minlength=forest.num_spans)
    columns["repeated_share"] = (children - distinct) / np.maximum(children, 1.0)
    root_us = np.maximum(columns["duration_us"][forest.root][forest.trace_index], 1e-3)
    columns["cp_share"] = np.clip(columns["cp_exclusive_us"] / root_us, 0.0, 1.0)
    return columns


def _relative_columns(forest: SpanForest, columns: dict[str, np.ndarray], z: np.ndarray,
                      deltas: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The `relative` variant's columns that are not plain z-scores (see the module docstring)."""
    parent = forest.parent
    has_parent = parent >= 0
    out = dict(deltas)
    for i, name in enumerate(("log_self_time_us", "log_duration_us")):
        values = np.zeros(forest.num_spans)
        values[has_parent] = z[parent[has_parent], i]
        out[f"parent_z_{name}"] = values
    error = pc.equal(forest.spans["status"], "error").to_numpy(zero_copy_only=False).astype(np.float64)
    child_errors = np.bincount(parent[has_parent], weights=error[has_parent], minlength=forest.num_spans)
    out["error"] = error
    out["error_origin"] = error * (child_errors == 0)
    return out


def beyond_siblings(parent: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each node's value minus the mean of its siblings' (the other nodes with its parent); the
    value itself for a root or an only child."""
    has_parent = parent >= 0
    owner = parent[has_parent]
    n = len(parent)
    total = np.bincount(owner, weights=values[has_parent], minlength=n)
    count = np.bincount(owner, minlength=n)
    out = values.astype(np.float64).copy()
    others = np.zeros(n, dtype=np.int64)
    others[has_parent] = count[owner] - 1
    with_siblings = others > 0
    sibling_sum = total[np.maximum(parent, 0)] - values
    out[with_siblings] -= sibling_sum[with_siblings] / others[with_siblings]
    return out


def _stack(columns: dict[str, np.ndarray], names) -> np.ndarray:
    return np.stack([columns[name] for name in names], axis=1).astype(np.float32)
