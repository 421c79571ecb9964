"""Span tables from CSV (plain or gzipped) and Parquet, through a column mapping.

A `ColumnMapping` says which source column holds each schema field, the time units, the
value that marks a root span's parent, and whether the service comes from a Kubernetes pod
name. Built-in mappings: `bmeg` (our own column names, e.g. Parquet written by `write_spans`)
and `nezha` (the Nezha Online Boutique dataset); the layout is detected from the header when
no mapping is given. Reading is vectorised (pyarrow.csv, pyarrow.compute): no Python per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from bmeg.traces.build import fail, table_from_arrays
from bmeg.traces.errors import TraceInputError
from bmeg.traces.schema import SPAN_KINDS, STATUS_CODES

#: Nanoseconds per unit of a time column.
TIME_UNITS = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}
#: The fields of a ColumnMapping that name source columns.
COLUMN_FIELDS = (
    "trace_id", "span_id", "parent_id", "operation", "start", "end", "duration",
    "service", "instance", "kind", "status", "peer_service", "db_system",
)  # fmt: skip
#: A pod name is `<deployment>-<replica set hash>-<pod hash>`; the service is the deployment.
POD_SUFFIX = r"-[^-]+-[^-]+$"


@dataclass(frozen=True)
class ColumnMapping:
    """Which source column is each schema field, and how to convert it.

    Give `end` or `duration` (or both: `end` wins, being exact). Optional fields left as None
    become nulls, or the schema's defaults for `kind` ("unspecified") and `status` ("unset").
    """

    trace_id: str
    span_id: str
    parent_id: str
    operation: str
    start: str
    end: str | None = None
    duration: str | None = None
    service: str | None = None
    instance: str | None = None
    kind: str | None = None
    status: str | None = None
    peer_service: str | None = None
    db_system: str | None = None
    time_unit: str = "ns"  # of `start` and `end`
    duration_unit: str = "ns"
    root_parent: str = ""  # the parent value of a root span (an empty cell always is one)
    service_from_pod: bool = False  # service = `instance` column without its pod suffix

    def __post_init__(self) -> None:
        if self.end is None and self.duration is None:
            raise TraceInputError("a column mapping needs an `end` or a `duration` column")
        if self.service is None and not (self.service_from_pod and self.instance):
            raise TraceInputError("a column mapping needs a `service` column, or `service_from_pod` with `instance`")
        for unit in (self.time_unit, self.duration_unit):
            if unit not in TIME_UNITS:
                raise TraceInputError(f"unknown time unit {unit!r}; expected one of {list(TIME_UNITS)}")

    def source_columns(self) -> dict[str, str]:
        """Mapping field -> source column, for the fields that are set."""
        return {field: getattr(self, field) for field in COLUMN_FIELDS if getattr(self, field)}


BMEG = ColumnMapping(
    trace_id="trace_id", span_id="span_id", parent_id="parent_id", operation="operation",
    start="start_ns", duration="duration_ns", service="service", instance="instance",
    kind="kind", status="status", peer_service="peer_service", db_system="db_system",
)  # fmt: skip
NEZHA = ColumnMapping(
    trace_id="TraceID", span_id="SpanID", parent_id="ParentID", operation="OperationName",
    start="StartTimeUnixNano", end="EndTimeUnixNano", duration="Duration", duration_unit="us",
    instance="PodName", service_from_pod=True, root_parent="root",
)  # fmt: skip
MAPPINGS = {"bmeg": BMEG, "nezha": NEZHA}


def detect_mapping(columns: list[str], source: str) -> ColumnMapping:
    """The built-in mapping whose columns the header has."""
    for mapping in MAPPINGS.values():
        if set(mapping.source_columns().values()) <= set(columns):
            return mapping
    raise TraceInputError(
        f"unknown span table layout, columns {columns} (in {source}); pass a ColumnMapping "
        f"or one of {list(MAPPINGS)}"
    )


def resolve_mapping(mapping: ColumnMapping | str | None, columns: list[str], source: str) -> ColumnMapping:
    if mapping is None:
        return detect_mapping(columns, source)
    if isinstance(mapping, str):
        if mapping not in MAPPINGS:
            raise TraceInputError(f"unknown column mapping {mapping!r}; built-in: {list(MAPPINGS)}")
        mapping = MAPPINGS[mapping]
    absent = sorted(set(mapping.source_columns().values()) - set(columns))
    if absent:
        raise TraceInputError(f"columns {absent} of the mapping are not in the table {columns} (in {source})")
    return mapping


def read_csv(data: bytes, source: str, mapping: ColumnMapping | str | None = None) -> pa.Table:
    """Read CSV bytes (gzip is detected from the content) into a span table."""
    try:
        chosen = resolve_mapping(mapping, _csv_header(data), source)
        table = pa_csv.read_csv(
            _csv_stream(data),
            convert_options=pa_csv.ConvertOptions(
                include_columns=list(dict.fromkeys(chosen.source_columns().values())),
                column_types=_csv_types(chosen),
                strings_can_be_null=True,  # empty cells are nulls: no parent, no peer service
            ),
        )
    except (pa.ArrowException, OSError, UnicodeDecodeError) as error:
        raise TraceInputError(f"cannot read span CSV: {error} (in {source})") from None
    return map_columns(table, chosen, source)


def read_parquet(data: bytes, source: str, mapping: ColumnMapping | str | None = None) -> pa.Table:
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as error:
        raise TraceInputError(f"cannot read span Parquet: {error} (in {source})") from None
    return map_columns(table, resolve_mapping(mapping, table.column_names, source), source)


def write_parquet(table: pa.Table, sink) -> None:
    pq.write_table(table, sink)


def map_columns(table: pa.Table, mapping: ColumnMapping, source: str) -> pa.Table:
    """Apply a mapping to a source table, then check it like any reader's output."""
    column = {field: table[name] for field, name in mapping.source_columns().items()}
    try:
        arrays = {
            "trace_id": _hex_ids(column["trace_id"]),
            "span_id": _hex_ids(column["span_id"]),
            "parent_id": _parent_ids(column["parent_id"], mapping.root_parent),
            "operation": pc.fill_null(_text(column["operation"]), ""),
            "instance": _text(column["instance"]) if "instance" in column else _nulls(table),
            "kind": _lower_or(column.get("kind"), "unspecified", table),  # an empty cell: the default
            "status": _lower_or(column.get("status"), "unset", table),
            "peer_service": _text(column["peer_service"]) if "peer_service" in column else _nulls(table),
            "db_system": _text(column["db_system"]) if "db_system" in column else _nulls(table),
        }
        arrays["service"] = (
            _text(column["service"])
            if "service" in column
            else pc.replace_substring_regex(arrays["instance"], POD_SUFFIX, "")
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        raise TraceInputError(f"span table columns of the wrong type: {error} (in {source})") from None
    arrays["start_ns"] = _nanoseconds(column["start"], mapping.time_unit, "start", arrays, source)
    if "end" in column:
        arrays["end_ns"] = _nanoseconds(column["end"], mapping.time_unit, "end", arrays, source)
    else:
        duration = _nanoseconds(column["duration"], mapping.duration_unit, "duration", arrays, source)
        arrays["end_ns"] = _end_from_duration(arrays["start_ns"], duration, arrays, source)
    _check_values(arrays, source)
    return table_from_arrays(arrays, source)


def _csv_stream(data: bytes) -> pa.NativeFile:
    return pa.input_stream(pa.BufferReader(data), compression="gzip" if data[:2] == b"\x1f\x8b" else None)


def _csv_header(data: bytes) -> list[str]:
    return pa_csv.open_csv(_csv_stream(data), read_options=pa_csv.ReadOptions(block_size=1 << 16)).schema.names


def _csv_types(mapping: ColumnMapping) -> dict[str, pa.DataType]:
    """Read ids and names as text (an all-digit hex id would otherwise become a number)."""
    types = {name: pa.string() for name in mapping.source_columns().values()}
    for name in (mapping.start, mapping.end, mapping.duration):
        if name:
            types[name] = pa.int64()
    return types


def _text(array) -> pa.ChunkedArray:
    return pc.cast(array, pa.string())


def _hex_ids(array) -> pa.ChunkedArray:
    return pc.utf8_lower(_text(array))


def _parent_ids(array, root_parent: str) -> pa.ChunkedArray:
    ids = _hex_ids(array)
    is_root = pc.or_kleene(pc.equal(ids, root_parent.lower()), pc.equal(ids, ""))
    return pc.if_else(is_root, pa.scalar(None, pa.string()), ids)


def _nulls(table: pa.Table) -> pa.Array:
    return pa.nulls(table.num_rows, pa.string())


def _lower_or(array, default: str, table: pa.Table):
    if array is None:
        return pa.array([default] * table.num_rows, pa.string())
    return pc.fill_null(pc.utf8_lower(_text(array)), default)


def _nanoseconds(array, unit: str, what: str, arrays: dict, source: str):
    try:
        times = pc.cast(array, pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        raise TraceInputError(f"the {what} column is not whole {unit}: {error} (in {source})") from None
    try:
        return pc.multiply_checked(times, TIME_UNITS[unit])
    except pa.ArrowInvalid:
        limit = (2**63 - 1) // TIME_UNITS[unit]
        row = pc.index(pc.greater(pc.abs(times), limit), True).as_py()
        _fail(arrays, row, f"{what} {times[row].as_py()} {unit} overflows int64 ns", source)


def _end_from_duration(start, duration, arrays: dict, source: str):
    try:
        return pc.add_checked(start, duration)
    except pa.ArrowInvalid:
        pairs = enumerate(zip(start.to_pylist(), duration.to_pylist(), strict=True))
        row = next(i for i, (a, b) in pairs if a is not None and b is not None and not -(2**63) <= a + b < 2**63)
        _fail(arrays, row, "start + duration overflows int64 ns", source)


def _fail(arrays: dict, row: int, message: str, source: str) -> None:
    fail(pa.table({"trace_id": arrays["trace_id"], "span_id": arrays["span_id"]}), row, message, source)


def _check_values(arrays: dict, source: str) -> None:
    for name, allowed in (("kind", SPAN_KINDS), ("status", STATUS_CODES)):
        bad = pc.invert(pc.is_in(arrays[name], value_set=pa.array(allowed)))
        row = pc.index(pc.fill_null(bad, True), True).as_py()
        if row >= 0:
            _fail(arrays, row, f"{name} {arrays[name][row].as_py()!r} is not one of {allowed}", source)

