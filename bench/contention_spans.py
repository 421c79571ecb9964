"""Where a CPU fault's time lands in the faulty service's spans, on a recording or a simulation:

    python bench/contention_spans.py DATASET [DATASET ...] [--source interference] [--model RUN] [--json OUT]

DATASET is a folder with `spans.parquet` and `traces.parquet` (per-trace labels): a testbed
recording (`bmeg generate --backend testbed`) or a simulated one (`bmeg generate`, e.g. from a
bootstrap's `twin.yaml`). For every service that `--source` faults hit (default `interference`,
a CPU hog), the log2 shift of the medians between the traces labelled with that fault on it and
the dataset's fault-free traces, of: its server spans' self time (`self`), its client spans to
stores (`store_calls`: a store has no server span, so this span is the store's node in a call
graph), its client spans to services (`service_calls`) and those services' server spans
(`callee_servers`), and the client spans that call it (`calls_in`: those its server spans
answered, and those naming it as their peer service: all a store shows). Printed per dataset
and service, with the traces it had.

With `--model RUN` (a `bmeg bootstrap` or `bmeg train` run), also what that model reads there: the
medians, over the same labelled traces, of its node features' z-scores (`FEATURE_ZSCORES`, those
its encoder has) at the service's store nodes (`store:` columns) and at its own server node
(`server:`), encoded as a recorded stream is (each trace's history from the earlier ones).

Why: a hog in the service's cgroup starves its threads, so it reads each answer late and its
client spans stretch more than its self time; where the callee is a store, that stretch looks
like the store's own (docs/issue-12.md, sessions 29-30: on the testbed the hogged services'
store calls moved log2 +4.1..+12.3 at the median, their self time -1.1..+5.5; a twin with
3-ms hog slices moved them +1.1..+2.0).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from bmeg.graphs import SpanForest, assemble, node_services
from bmeg.graphs.critical_path import critical_paths
from bmeg.models.checkpoint import CheckpointError
from bmeg.models.detector import Detector

PARTS = ("self", "store_calls", "service_calls", "callee_servers", "calls_in")
#: the node features read with `--model`, where the model's encoder has them
FEATURE_ZSCORES = ("z_log_duration_us", "z_log_self_time_us", "z_log_wait_us", "z_duration_beyond_siblings")


def span_parts(spans: pd.DataFrame, service: str) -> dict[str, float]:
    """Median ns of each part (`PARTS`) of `service`'s spans in `spans` (NaN where it has none)."""
    mine = spans[spans["service"] == service]
    client = mine[mine["kind"] == "client"]
    values = {"self": mine.loc[mine["kind"] == "server", "self_ns"],
              "store_calls": client.loc[client["callee_ns"].isna(), "duration_ns"],
              "service_calls": client.loc[client["callee_ns"].notna(), "duration_ns"],
              "callee_servers": client["callee_ns"].dropna(),
              "calls_in": spans.loc[spans["answered_by"] == service, "duration_ns"]}
    return {part: float(v.median()) if len(v) else float("nan") for part, v in values.items()}


def feature_medians(detector: Detector, forest: SpanForest, nodes: np.ndarray,
                    store_calls: np.ndarray) -> Callable[[np.ndarray, str], dict[str, float]]:
    """A reader of the detector's node features over the forest (`nodes`: each span's node
    service, stores split out; `store_calls`: the client spans that reached no server span):
    for a row mask and a service, the medians of `FEATURE_ZSCORES` at its store calls and at
    its server spans."""
    x = detector.encoder.transform(forest, critical_paths(forest), nodes)
    names = [name for name in FEATURE_ZSCORES if name in detector.encoder.names]
    columns = [detector.encoder.names.index(name) for name in names]
    emitter = forest.spans["service"].to_numpy(zero_copy_only=False)
    kind = forest.spans["kind"].to_numpy(zero_copy_only=False)

    def medians(rows: np.ndarray, service: str) -> dict[str, float]:
        mine = rows & (emitter == service)
        roles = {"store": mine & store_calls, "server": mine & (kind == "server")}
        return {f"{role}:{name}": float(np.median(x[mask, column])) if mask.any() else float("nan")
                for role, mask in roles.items() for name, column in zip(names, columns)}
    return medians


def span_table(forest: SpanForest, nodes: np.ndarray) -> pd.DataFrame:
    """Per span: trace, service, kind, node service, duration, self time, the duration of the
    server span a client span reached (`callee_ns`, NaN for a store), and who answered a client
    span (`answered_by`: that server span's service, or the store the span stands for)."""
    spans = forest.spans.select(["trace_id", "service", "kind"]).to_pandas()
    spans["node"], spans["duration_ns"], spans["self_ns"] = nodes, forest.duration_ns, forest.self_time_ns
    spans["answered_by"] = spans["node"].where(spans["node"] != spans["service"])
    spans["callee_ns"] = np.nan
    called = np.flatnonzero((forest.parent >= 0) & (spans["kind"].to_numpy() == "server"))
    spans.loc[forest.parent[called], "callee_ns"] = forest.duration_ns[called]
    spans.loc[forest.parent[called], "answered_by"] = spans["service"].to_numpy()[called]
    return spans


def shifts(folder: Path, source: str, detector: Detector | None = None) -> pd.DataFrame:
    """Per service `source` faults hit in the dataset at `folder`: the traces labelled so, and
    each part's log2 shift of the median against the fault-free traces (with `detector`, the
    medians of its features there too: `feature_medians`)."""
    traces = pq.read_table(folder / "traces.parquet", columns=["trace_id", "fault_source", "fault_services"]).to_pandas()
    forest = assemble(pq.read_table(folder / "spans.parquet"), on_bad_trace="drop")
    nodes = node_services(forest, storage_nodes=True).to_numpy(zero_copy_only=False)
    spans = span_table(forest, nodes)
    fault_free = spans[spans["trace_id"].isin(traces.loc[traces["fault_source"] == "none", "trace_id"])]
    hit = traces[traces["fault_source"] == source].explode("fault_services")
    store_calls = ((spans["kind"] == "client") & spans["callee_ns"].isna()).to_numpy()
    read = None if detector is None else feature_medians(detector, forest, nodes, store_calls)
    rows = []
    for service, labelled in hit.groupby("fault_services"):
        faulty = spans["trace_id"].isin(labelled["trace_id"]).to_numpy()
        normal, during = span_parts(fault_free, service), span_parts(spans[faulty], service)
        rows.append({"service": service, "traces": len(labelled),
                     **{part: float(np.log2(during[part] / normal[part])) if normal[part] > 0 and during[part] > 0
                        else float("nan") for part in PARTS},
                     **({} if read is None else read(faulty, service))})
    return pd.DataFrame(rows, columns=list(rows[0]) if rows else ["service", "traces", *PARTS])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("datasets", nargs="+", type=Path)
    parser.add_argument("--source", default="interference", help="the fault source whose targets are read")
    parser.add_argument("--model", type=Path, help="a run: also the medians of its node features' z-scores")
    parser.add_argument("--json", type=Path, help="write the tables here as JSON")
    args = parser.parse_args()
    try:  # a missing or unreadable file, or a run that is not a model: one line, not a traceback
        detector = None if args.model is None else Detector.load(args.model, device="cpu")
        tables = {folder: shifts(folder, args.source, detector) for folder in args.datasets}
    except (OSError, pa.ArrowException, CheckpointError) as error:
        parser.error(str(error))
    out = {}
    for folder, table in tables.items():
        out[str(folder)] = table.to_dict(orient="records")
        print(f"{folder} ({args.source}: log2 shift of the median against fault-free traces)")
        print(table.round(2).to_string(index=False) if len(table) else "  no such faults")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
