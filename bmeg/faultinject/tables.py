"""Turn a simulated episode into Arrow tables: spans (SPAN_SCHEMA), trace labels, node labels.

Columns are built in bulk: ids from one block of random bytes, names through dictionary
arrays, times as integer nanoseconds from the episode's epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.faultinject.labels import EpisodeLabels
from bmeg.faultinject.simulator import SimulationResult
from bmeg.traces.schema import SPAN_SCHEMA

NORMAL = "none"

TRACES_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string(), nullable=False),
        pa.field("request_type", pa.string(), nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False),
        pa.field("duration_ns", pa.int64(), nullable=False),
        pa.field("error", pa.bool_(), nullable=False),
        pa.field("anomalous", pa.bool_(), nullable=False),
        pa.field("fault_kind", pa.string(), nullable=False),  # single / multiple / cascading / none
        pa.field("fault_source", pa.string(), nullable=False),  # e.g. interference, "a+b" if several
        pa.field("fault_services", pa.list_(pa.string()), nullable=False),
        pa.field("episode", pa.int32(), nullable=False),
    ]
)
NODES_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string(), nullable=False),
        pa.field("span_id", pa.string(), nullable=False),
        pa.field("service", pa.string(), nullable=False),  # the store for a storage client span
        pa.field("bottleneck", pa.bool_(), nullable=False),
    ]
)


@dataclass
class EpisodeTables:
    spans: pa.Table
    traces: pa.Table
    nodes: pa.Table


def _hex_ids(rng: np.random.Generator, count: int, nbytes: int) -> pa.Array:
    chunks = np.frombuffer(rng.bytes(nbytes * count).hex().encode(), dtype=f"S{2 * nbytes}")
    return pa.array(chunks, type=pa.binary()).cast(pa.string())


def _names(indices: np.ndarray, names: list, mask: np.ndarray | None = None) -> pa.Array:
    codes = pa.array(indices.astype(np.int32), mask=mask)
    return pa.DictionaryArray.from_arrays(codes, pa.array(names, type=pa.string())).cast(pa.string())


def _remap(old_indices: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """New positions of kept rows; -1 for rows dropped."""
    new = np.full(len(keep), -1, dtype=np.int64)
    new[keep] = np.arange(int(keep.sum()))
    return np.where(old_indices >= 0, new[np.maximum(old_indices, 0)], -1)


def episode_tables(
    result: SimulationResult,
    labels: EpisodeLabels,
    keep_traces: np.ndarray,
    episode: int,
    epoch_ns: int,
    rng: np.random.Generator,
) -> EpisodeTables:
    """Tables for the traces `keep_traces` (sorted trace indices) of one episode."""
    trace_keep = np.zeros(len(result.trace_start), dtype=bool)
    trace_keep[keep_traces] = True
    span_keep = trace_keep[result.span_trace]
    trace_ids = _hex_ids(rng, len(keep_traces), 16)
    span_count = int(span_keep.sum())
    span_ids = _hex_ids(rng, span_count, 8)

    span_trace = _remap(result.span_trace[span_keep], trace_keep)
    parent = _remap(result.span_parent[span_keep], span_keep)
    start = result.span_start[span_keep]
    peer = result.span_peer[span_keep]
    is_store = peer >= 0
    spans = pa.Table.from_arrays(
        [
            pc.take(trace_ids, pa.array(span_trace)),
            span_ids,
            pc.take(span_ids, pa.array(parent, mask=parent < 0)),
            _names(result.span_service[span_keep], result.services),
            _names(result.span_operation[span_keep], result.operations),
            pa.array(epoch_ns + np.rint(start).astype(np.int64)),
            pa.array(np.rint(result.span_end[span_keep] - start).astype(np.int64)),
            _names(result.span_kind[span_keep], ["server", "client"]),  # SERVER=0, CLIENT=1
            _names(result.span_error[span_keep].astype(np.int8), ["unset", "error"]),
            _names(np.maximum(peer, 0), result.services, mask=~is_store),
            _names(np.maximum(peer, 0), result.storage, mask=~is_store),
            _names(result.span_instance[span_keep], result.instances),
        ],
        schema=SPAN_SCHEMA,
    )
    node_service = np.where(is_store, peer, result.span_service[span_keep])
    nodes = pa.Table.from_arrays(
        [spans["trace_id"], spans["span_id"], _names(node_service, result.services),
         pa.array(labels.span_bottleneck[span_keep])],
        schema=NODES_SCHEMA,
    )
    traces = pa.Table.from_arrays(
        [
            trace_ids,
            _names(result.trace_request[keep_traces], result.requests),
            pa.array(epoch_ns + np.rint(result.trace_start[keep_traces]).astype(np.int64)),
            pa.array(np.rint(result.trace_end[keep_traces] - result.trace_start[keep_traces]).astype(np.int64)),
            pa.array(_root_errors(result)[keep_traces]),
            pa.array(labels.trace_anomalous[keep_traces]),
            *_fault_columns(result, labels, keep_traces),
            pa.array(np.full(len(keep_traces), episode, dtype=np.int32)),
        ],
        schema=TRACES_SCHEMA,
    )
    return EpisodeTables(spans, traces, nodes)


def spans_of(result: SimulationResult, epoch_ns: int = 0, seed: int = 0) -> pa.Table:
    """Every trace of an episode as a span table, without labels (e.g. to compare with real traces)."""
    traces, spans = len(result.trace_start), len(result.span_trace)
    unlabelled = EpisodeLabels(np.zeros(spans, dtype=bool), np.zeros(traces, dtype=bool), [()] * traces)
    return episode_tables(result, unlabelled, np.arange(traces), 0, epoch_ns, np.random.default_rng(seed)).spans


def _root_errors(result: SimulationResult) -> np.ndarray:
    roots = np.flatnonzero(result.span_parent < 0)
    errors = np.zeros(len(result.trace_start), dtype=bool)
    errors[result.span_trace[roots]] = result.span_error[roots]
    return errors


def _fault_columns(result: SimulationResult, labels: EpisodeLabels, keep_traces: np.ndarray) -> list[pa.Array]:
    kinds, sources, services = [], [], []
    for trace in keep_traces.tolist():
        faults = [result.faults[i] for i in labels.trace_faults[trace]]
        kinds.append("+".join(sorted({f.kind for f in faults})) or NORMAL)
        sources.append("+".join(sorted({f.source for f in faults})) or NORMAL)
        services.append(sorted({f.service for f in faults}))
    return [pa.array(kinds, pa.string()), pa.array(sources, pa.string()), pa.array(services, pa.list_(pa.string()))]
