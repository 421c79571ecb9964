"""The one span schema every reader, writer and stage uses.

A span table is a `pyarrow.Table` with exactly `SPAN_SCHEMA`. Times are integer nanoseconds
since the Unix epoch (OTLP's unit; Jaeger's microseconds convert exactly). Ids are lowercase
hex strings; `parent_id` is null for a root span.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SPAN_KINDS = ("unspecified", "internal", "server", "client", "producer", "consumer")
STATUS_CODES = ("unset", "ok", "error")

SPAN_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string(), nullable=False),
        pa.field("span_id", pa.string(), nullable=False),
        pa.field("parent_id", pa.string()),
        pa.field("service", pa.string(), nullable=False),
        pa.field("operation", pa.string(), nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False),
        pa.field("duration_ns", pa.int64(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),  # one of SPAN_KINDS
        pa.field("status", pa.string(), nullable=False),  # one of STATUS_CODES
        pa.field("peer_service", pa.string()),  # `peer.service` attribute
        pa.field("db_system", pa.string()),  # `db.system` attribute
        pa.field("instance", pa.string()),  # host / pod / replica that ran the span
    ]
)

COLUMNS = tuple(SPAN_SCHEMA.names)


def empty_span_table() -> pa.Table:
    return SPAN_SCHEMA.empty_table()


def span_table(columns: dict[str, list]) -> pa.Table:
    """Build a span table from column lists; missing optional columns become nulls/defaults."""
    n = len(columns["trace_id"])
    defaults = {"kind": "unspecified", "status": "unset"}
    arrays = []
    for field in SPAN_SCHEMA:
        values = columns.get(field.name)
        if values is None:
            values = [defaults.get(field.name)] * n
        arrays.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(arrays, schema=SPAN_SCHEMA)


def conform(table: pa.Table) -> pa.Table:
    """Cast a table with the schema's columns (any order, compatible types) to SPAN_SCHEMA."""
    missing = [name for name in COLUMNS if name not in table.column_names]
    if missing:
        raise ValueError(f"span table lacks columns {missing}; expected {list(COLUMNS)}")
    return table.select(list(COLUMNS)).cast(SPAN_SCHEMA)


def span_keys(table: pa.Table) -> np.ndarray:
    """`trace_id/span_id` of each row of a table with both columns (spans, node labels): a span's
    key across tables whose rows are in different orders."""
    return pc.binary_join_element_wise(table["trace_id"], table["span_id"], "/").to_numpy(zero_copy_only=False)


def trace_starts(spans: pa.Table) -> pa.Table:
    """Each trace of a span table and when it began (its earliest span): `trace_id`, `start_ns_min`."""
    return spans.group_by("trace_id").aggregate([("start_ns", "min")])


def traces_begun_between(spans: pa.Table, begin_ns: int | None = None, end_ns: int | None = None,
                         starts: pa.Table | None = None) -> pa.Table:
    """The spans of the traces whose earliest span began in [begin_ns, end_ns) (an open end where
    None): whole traces, none cut at the edges. `starts`: `trace_starts(spans)`, when at hand."""
    first = trace_starts(spans) if starts is None else starts
    began = first["start_ns_min"].to_numpy()
    inside = np.ones(len(began), dtype=bool)
    if begin_ns is not None:
        inside &= began >= begin_ns
    if end_ns is not None:
        inside &= began < end_ns
    return spans.filter(pc.is_in(spans["trace_id"], first["trace_id"].filter(pa.array(inside))))
