"""Ingest benchmark: OTLP protobuf -> span table -> the models' graph set, on one core.

    python bench/ingest.py [--traces 20000] [--spans-per-trace 30] [--repeat 3]

Generates one `ExportTraceServiceRequest` of random but well-formed traces (random call
trees, nested times, a dozen services, some storage client spans), then times, best of
`--repeat` runs:

1. protobuf decode alone (`ExportTraceServiceRequest.FromString`, upb's C parser),
2. decode and read each span's fields from Python (the floor for any Python-level reader),
3. decode -> span table (the OTLP reader),
4. decode -> graph set, the GNNs' input (reader, `assemble`, critical paths, the models' `full`
   features from an encoder fitted beforehand on the same traces, `GraphSet`),

and prints spans/s for each and the ratio of (4) to (1) and to (2). Targets: (4) at least
150k spans/s, and at most 3x the time of (1).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pyarrow as pa
import torch
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bmeg.graphs import assemble, critical_paths
from bmeg.models.features import FeatureEncoder
from bmeg.models.graphset import GraphSet
from bmeg.traces import span_table
from bmeg.traces.otlp import read_otlp_proto, to_otlp_proto_bytes

SERVICES = [
    f"{name}-service"
    for name in (
        "compose-post", "text", "user", "media", "unique-id", "url-shorten", "user-mention",
        "post-storage", "user-timeline", "home-timeline", "social-graph",
    )
]
STORE_CALLS = ["mongo_insert_client", "redis_get_client", "mmc_mget_client"]


def random_traces(num_traces: int, spans_per_trace: int, seed: int = 0) -> pa.Table:
    """Random call trees: span i calls from one of the few spans before it; times nest."""
    rng = np.random.default_rng(seed)
    shape = (num_traces, spans_per_trace)
    position = np.arange(spans_per_trace)
    parent = np.maximum(position - 1 - rng.integers(0, 4, size=shape), 0)
    parent[:, 0] = -1
    start = np.zeros(shape, dtype=np.int64)
    duration = np.zeros(shape, dtype=np.int64)
    start[:, 0] = 1_700_000_000_000_000_000 + rng.integers(0, 10**12, size=num_traces)
    duration[:, 0] = rng.lognormal(np.log(10e6), 0.5, size=num_traces).astype(np.int64)
    rows = np.arange(num_traces)
    for i in range(1, spans_per_trace):  # parents come first, so their times are known
        up_start, up_duration = start[rows, parent[:, i]], duration[rows, parent[:, i]]
        start[:, i] = up_start + (rng.random(num_traces) * 0.5 * up_duration).astype(np.int64)
        duration[:, i] = (rng.uniform(0.05, 0.5, num_traces) * up_duration).astype(np.int64)
    service_index = rng.integers(0, len(SERVICES), size=shape)
    is_store_call = (rng.random(shape) < 0.3) & (position > 0)
    services = np.array(SERVICES)[service_index]
    operations = np.where(
        is_store_call,
        np.array(STORE_CALLS)[service_index % len(STORE_CALLS)],
        np.char.add(np.char.replace(services, "-service", ""), "_server"),
    )
    ids = rng.integers(0, 2**63, size=shape, dtype=np.int64)
    span_ids = np.array([f"{value:016x}" for value in ids.ravel()]).reshape(shape)
    trace_numbers = rng.integers(0, 2**63, size=num_traces, dtype=np.int64)
    trace_ids = np.array([f"{value:032x}" for value in trace_numbers])
    parent_ids = np.where(parent >= 0, span_ids[rows[:, None], np.maximum(parent, 0)], None)
    parent_ids[:, 0] = None
    return span_table(
        {
            "trace_id": np.repeat(trace_ids, spans_per_trace).tolist(),
            "span_id": span_ids.ravel().tolist(),
            "parent_id": parent_ids.ravel().tolist(),
            "service": services.ravel().tolist(),
            "operation": operations.ravel().tolist(),
            "start_ns": start.ravel().tolist(),
            "duration_ns": duration.ravel().tolist(),
            "kind": np.where(is_store_call | (position % 2 == 1), "client", "server").ravel().tolist(),
        }
    )


def touch_every_span(payload: bytes) -> int:
    """Decode and read the fields a reader needs from every span: the floor of any Python reader."""
    request = ExportTraceServiceRequest.FromString(payload)
    count = 0
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                span.trace_id, span.span_id, span.parent_span_id, span.name
                span.start_time_unix_nano, span.end_time_unix_nano, span.kind
                count += 1
    return count


def graph_set(payload: bytes, encoder: FeatureEncoder) -> GraphSet:
    """What the detector builds before its GNNs run: spans -> forest -> features -> graph set."""
    forest = assemble(read_otlp_proto(payload))
    return GraphSet.from_forest(forest, encoder.transform(forest, critical_paths(forest)))


def best_time(step, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=20_000)
    parser.add_argument("--spans-per-trace", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)

    table = random_traces(args.traces, args.spans_per_trace)
    payload = to_otlp_proto_bytes(table)
    spans = table.num_rows
    size = len(payload) / 2**20
    print(f"{args.traces} traces x {args.spans_per_trace} spans = {spans} spans, {size:.1f} MiB OTLP protobuf")

    encoder = FeatureEncoder("full").fit(assemble(table))  # training's work, not timed
    steps = {
        "protobuf decode alone": lambda: ExportTraceServiceRequest.FromString(payload),
        "decode + touch each span in Python": lambda: touch_every_span(payload),
        "decode -> span table": lambda: read_otlp_proto(payload),
        "decode -> graph set (GNN input)": lambda: graph_set(payload, encoder),
    }
    seconds = {name: best_time(step, args.repeat) for name, step in steps.items()}
    for name, took in seconds.items():
        print(f"{name:34s} {took:7.3f} s  {spans / took:12,.0f} spans/s")
    decode, built = seconds["protobuf decode alone"], seconds["decode -> graph set (GNN input)"]
    floor = seconds["decode + touch each span in Python"]
    print(f"graph set / decode time ratio: {built / decode:.1f}x  (target <= 3x; graph set >= 150,000 spans/s)")
    print(f"graph set / (decode + touch each span) ratio: {built / floor:.1f}x")


if __name__ == "__main__":
    main()
