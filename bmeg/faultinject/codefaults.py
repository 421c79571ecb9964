"""Code faults: a service that returns early or throws, applied to fault-free spans, with labels.

The simulator slows services down; it has no code. A code fault changes what a service does,
not how fast, so it is applied to the spans of a fault-free episode (`apply_code_fault`). In a
`return` fault the service returns early from a share of its requests: those server spans make
none of their calls (the calls' spans and everything under them vanish) and end after their
own work; the time saved comes off every span above them, and what started after them starts
that much earlier, as if the request had run that way. An `exception` fault does the same and
sets the error status on the service's span and, as instrumented callers record a failed call,
on every span above it.

Labels follow `bmeg.faultinject.labels`' rule, what the fault did to the spans: a hit server
span is a bottleneck node when the trace shows the fault (an error, or calls that vanished;
an early return from a span that calls nothing changes nothing a trace records), and a trace
is anomalous when it has such a node. `code_fault_dataset` writes a labelled dataset of such
episodes in the layout of `bmeg.datasets` (one shard), so that a model trained on it sees
structure change, not only slowness: `bmeg bootstrap` trains on it beside the latency
campaigns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bmeg.faultinject.simulator import simulate
from bmeg.faultinject.spec import TopologySpec
from bmeg.faultinject.tables import NODES_SCHEMA, TRACES_SCHEMA, spans_of
from bmeg.graphs import assemble, node_services
from bmeg.graphs.features import self_time_ns
from bmeg.graphs.rpc import span_roles
from bmeg.traces.schema import SPAN_SCHEMA, span_keys

CODE_FAULTS = ("return", "exception")
#: Shares of the faulty service's requests a training episode's fault hits (drawn uniformly).
TRAINING_SHARE = (0.2, 0.9)
#: Bounds of the simulated seconds of a training episode (each has one fault for its whole
#: length): one round over every (service, kind) simulates about the traces asked for.
EPISODE_S = (0.2, 10.0)
#: Rounds over every (service, kind) at most (only traces that visit the service are kept).
MAX_ROUNDS = 10
#: A shard's episodes start here (2025-01-01), apart from the latency campaigns' (2024).
EPOCH_NS = 1_735_689_600 * 10**9
EPISODE_GAP_NS = 3600 * 10**9


@dataclass(frozen=True)
class CodeFault:
    spans: pa.Table  # the changed spans (only traces that visit the service)
    bottleneck: np.ndarray  # bool per row of `spans`: a hit span whose change shows


def apply_code_fault(spans: pa.Table, service: str, kind: str, share: float, rng: np.random.Generator) -> CodeFault:
    """`spans` with a `return` or `exception` fault in `service` (see the module docstring).
    Only traces that visit the service are kept: the others cannot show the fault."""
    if kind not in CODE_FAULTS:
        raise ValueError(f"unknown code fault {kind!r}; choose from {CODE_FAULTS}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the share of requests a code fault hits must be in [0, 1], not {share}")
    forest = assemble(spans, on_bad_trace="drop")
    is_server, _ = span_roles(forest)
    names = forest.spans["service"].to_numpy(zero_copy_only=False)
    hit = is_server & (names == service) & (rng.random(forest.num_spans) < share)
    visited = np.zeros(forest.num_traces, dtype=bool)
    visited[forest.trace_index[names == service]] = True
    gone = np.zeros(forest.num_spans, dtype=bool)  # below a hit span
    for row in np.argsort(forest.depth, kind="stable"):  # parents before children
        parent = forest.parent[row]
        gone[row] = parent >= 0 and (gone[parent] or hit[parent])
    has_parent = forest.parent >= 0
    children = np.bincount(forest.parent[has_parent], minlength=forest.num_spans)
    duration = forest.duration_ns.copy()
    start = forest.start_ns.copy()
    short = np.maximum(self_time_ns(forest), 1000)
    for row in np.flatnonzero(hit & ~gone)[::-1]:  # latest first in each trace: earlier ends stay valid
        saved = duration[row] - short[row]
        end = start[row] + duration[row]
        rows = np.arange(forest.trace_offsets[forest.trace_index[row]], forest.trace_offsets[forest.trace_index[row] + 1])
        start[rows[start[rows] >= end]] -= saved
        ancestor = forest.parent[row]
        while ancestor >= 0:
            duration[ancestor] -= saved
            ancestor = forest.parent[ancestor]
        duration[row] = short[row]
    status = forest.spans["status"].to_numpy(zero_copy_only=False).copy()
    if kind == "exception":
        failed = hit.copy()
        for row in np.argsort(-forest.depth, kind="stable"):  # children before parents
            if failed[row] and forest.parent[row] >= 0:
                failed[forest.parent[row]] = True
        status[failed] = "error"
    shows = hit & ~gone & ((children > 0) | (kind == "exception"))
    keep = ~gone & visited[forest.trace_index]
    table = forest.spans
    for name, values in (("start_ns", start), ("duration_ns", duration)):
        table = table.set_column(table.schema.get_field_index(name), table.schema.field(name), pa.array(values))
    table = table.set_column(table.schema.get_field_index("status"), table.schema.field("status"),
                             pa.array(status, pa.string()))
    return CodeFault(table.filter(pa.array(keep)), shows[keep])


def code_fault_dataset(spec: TopologySpec, out: str | Path, traces: int, seed: int = 0) -> dict:
    """Write a labelled dataset of code-fault episodes of `spec` into `out` (spans, traces and
    nodes tables and a `dataset.json` card): short episodes, each with one code fault (every
    (service, kind) in turn, in a shuffled order; a share drawn from `TRAINING_SHARE`), until
    every (service, kind) had an episode and `traces` traces are kept. Returns the card."""
    if traces < 1:
        raise ValueError(f"a code-fault dataset needs at least one trace, not {traces}")
    rng = np.random.default_rng(seed)
    targets = spec.code_services()
    if not targets:
        raise ValueError(f"topology {spec.name!r} has no service a code fault could hit")
    combos = [(service, kind) for service in targets for kind in CODE_FAULTS]
    combos = [combos[i] for i in rng.permutation(len(combos))]
    seconds = float(np.clip(traces / (len(combos) * spec.workload.rate), *EPISODE_S))
    tables: list[tuple[pa.Table, pa.Table, pa.Table]] = []
    kept = episode = 0
    while (kept < traces or episode < len(combos)) and episode < MAX_ROUNDS * len(combos):
        service, kind = combos[episode % len(combos)]
        episode_seed = seed * 100_003 + episode
        normal = spans_of(simulate(spec, [], seconds, episode_seed), EPOCH_NS + episode * EPISODE_GAP_NS, episode_seed)
        if normal.num_rows:
            fault = apply_code_fault(normal, service, kind, float(rng.uniform(*TRAINING_SHARE)), rng)
            if fault.spans.num_rows:
                tables.append(_episode_tables(fault, service, episode))
                kept += tables[-1][1].num_rows
        episode += 1
    if not tables:
        raise ValueError(f"no trace of {spec.name!r} visits a service a code fault could hit")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, index in (("spans", 0), ("traces", 1), ("nodes", 2)):
        pq.write_table(pa.concat_tables([t[index] for t in tables]), out / f"{name}.parquet")
    trace_table = pa.concat_tables([t[1] for t in tables])
    anomalous = int(pc.sum(trace_table["anomalous"]).as_py() or 0)
    card = {"name": f"{spec.name}-code-faults-s{seed}", "backend": "simulator (code faults applied to spans)",
            "topology": {"name": spec.name, "services": list(spec.services)},
            "scenario": {"name": "code", "kind": "single", "kinds": list(CODE_FAULTS), "share": list(TRAINING_SHARE)},
            "traces": trace_table.num_rows, "anomalous_traces": anomalous,
            "normal_traces": trace_table.num_rows - anomalous, "episodes": episode, "seed": seed}
    (out / "dataset.json").write_text(json.dumps(card, indent=2))
    return card


def _episode_tables(fault: CodeFault, service: str, episode: int) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(spans, traces, nodes) of one episode in the dataset layout."""
    forest = assemble(fault.spans, on_bad_trace="drop")
    # the forest orders spans by trace: the labels follow the rows of `fault.spans`
    row = pd.Index(span_keys(fault.spans)).get_indexer(span_keys(forest.spans))
    bottleneck = fault.bottleneck[row]
    anomalous = np.zeros(forest.num_traces, dtype=bool)
    anomalous[forest.trace_index[bottleneck]] = True
    root = forest.root
    nodes = pa.Table.from_arrays(
        [forest.spans["trace_id"], forest.spans["span_id"], node_services(forest, storage_nodes=True),
         pa.array(bottleneck)], schema=NODES_SCHEMA)
    traces = pa.Table.from_arrays(
        [pa.array(forest.trace_ids, pa.string()), forest.spans["operation"].take(pa.array(root)),
         pa.array(forest.start_ns[root]), pa.array(forest.duration_ns[root]),
         pa.array(pc.equal(forest.spans["status"], "error").to_numpy(zero_copy_only=False)[root]),
         pa.array(anomalous), pa.array(np.where(anomalous, "single", "none").astype(object), pa.string()),
         pa.array(np.where(anomalous, "code", "none").astype(object), pa.string()),
         pa.array([[service] if flag else [] for flag in anomalous], pa.list_(pa.string())),
         pa.array(np.full(forest.num_traces, episode, dtype=np.int32))],
        schema=TRACES_SCHEMA)
    spans = forest.spans.select(SPAN_SCHEMA.names).cast(SPAN_SCHEMA)
    return spans, traces, nodes
