"""From a reader's raw columns to a checked span table.

Every reader ends here, so every format gets the same checks and the same error messages:
ids present and hex, a start time (0, the epoch, is a valid one: Jaeger data starts there;
the OTLP reader rejects 0 as an unset field itself), an end not before the start, times that
fit int64 nanoseconds. Readers hand over start and *end* times; the duration is computed here.
Structural problems of a trace (missing parents, cycles, duplicate ids, clock skew) are not
checked: the graph builder repairs or reports them, so readers keep such spans as they are.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bmeg.traces.errors import TraceInputError
from bmeg.traces.schema import SPAN_SCHEMA

INT64_MAX = 2**63 - 1
HEX_ID = r"^[0-9a-f]+$"
_HEX_DIGITS = b"0123456789abcdef"

#: Columns a reader hands over: the schema's, with `end_ns` in place of `duration_ns`.
RAW_COLUMNS = tuple("end_ns" if name == "duration_ns" else name for name in SPAN_SCHEMA.names)


def table_from_columns(columns: dict[str, list], source: str) -> pa.Table:
    """Build a span table from Python column lists (times as Python ints, ids as hex text)."""
    arrays = {
        name: _int64_array(values, name, columns, source)
        if name in ("start_ns", "end_ns")
        else _text_array(values, name, source)
        for name, values in columns.items()
    }
    return table_from_arrays(arrays, source)


def _text_array(values: list, name: str, source: str) -> pa.Array:
    try:
        return pa.array(values, type=pa.string())
    except UnicodeEncodeError as error:
        # JSON's escapes can spell half a surrogate pair (a lone \ud800), which no UTF-8 text holds
        raise TraceInputError(f"a span's {name} is not valid Unicode: {error.reason} (in {source})") from None


def table_from_arrays(arrays: dict[str, pa.Array | pa.ChunkedArray], source: str) -> pa.Table:
    """Build a span table from Arrow columns named as in `RAW_COLUMNS` (int64 times)."""
    missing = [name for name in RAW_COLUMNS if name not in arrays]
    if missing:
        raise ValueError(f"reader columns lack {missing}")  # a bug in a reader, not bad input
    start, end = arrays["start_ns"], arrays["end_ns"]
    raw = pa.table({name: arrays[name] for name in RAW_COLUMNS})
    _check_ids(raw, source)
    _check_times(raw, start, end, source)
    columns = {name: arrays[name] for name in SPAN_SCHEMA.names if name != "duration_ns"}
    columns["duration_ns"] = pc.subtract(end, start)  # no overflow: 0 <= start <= end
    return pa.table({name: columns[name] for name in SPAN_SCHEMA.names}).cast(SPAN_SCHEMA)


def fail(raw: pa.Table, row: int, message: str, source: str) -> None:
    """Raise a `TraceInputError` for one span (row) of `raw`, naming its trace and span."""
    trace_id = raw["trace_id"][row].as_py() or None
    span_id = raw["span_id"][row].as_py() or None
    raise TraceInputError(f"{message} (in {source})", trace_id=trace_id, span_id=span_id)


def _first(mask: pa.Array | pa.ChunkedArray) -> int | None:
    """Index of the first true value of a boolean mask (nulls count as false), or None."""
    index = pc.index(pc.fill_null(mask, False), True).as_py()
    return None if index < 0 else index


def _check_ids(raw: pa.Table, source: str) -> None:
    for name, what in (("trace_id", "trace id"), ("span_id", "span id")):
        ids = raw[name]
        row = _first(pc.or_kleene(pc.is_null(ids), pc.equal(pc.utf8_length(ids), 0)))
        if row is not None:
            fail(raw, row, f"span has no {what}", source)
    for name, what in (("trace_id", "trace id"), ("span_id", "span id"), ("parent_id", "parent id")):
        ids = raw[name]
        if _all_text_is_hex(ids):
            continue
        row = _first(pc.invert(pc.match_substring_regex(ids, HEX_ID)))
        if row is not None:
            fail(raw, row, f"{what} {ids[row].as_py()!r} is not a lowercase hex id", source)
    for name in ("service", "operation", "kind", "status"):
        row = _first(pc.is_null(raw[name]))
        if row is not None:
            fail(raw, row, f"span has no {name}", source)


def _all_text_is_hex(strings: pa.ChunkedArray) -> bool:
    """Fast path of the hex check: every byte of the strings' character data is [0-9a-f].
    (False only means "look closer": the regex then finds the offending row, if any.)"""
    for chunk in strings.chunks:
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32, count=len(chunk) + 1, offset=chunk.offset * 4)
        characters = memoryview(chunk.buffers()[2] or b"")[offsets[0] : offsets[-1]]
        if bytes(characters).translate(None, _HEX_DIGITS):  # what is left is not hex
            return False
    return True


def _check_times(raw: pa.Table, start, end, source: str) -> None:
    checks = (
        (pc.is_null(start), "span has no start time"),
        (pc.is_null(end), "span has no end time or duration"),
        (pc.less(start, 0), "span has a negative start time"),
        (pc.less(end, start), "span ends before it starts (negative duration)"),
    )
    for mask, message in checks:
        row = _first(mask)
        if row is not None:
            fail(raw, row, message, source)


def _int64_array(values: list, name: str, columns: dict[str, list], source: str) -> pa.Array:
    try:
        return pa.array(np.asarray(values, dtype=np.int64))
    except (OverflowError, ValueError, TypeError):
        row = next(
            index
            for index, value in enumerate(values)
            if not (isinstance(value, int) and -INT64_MAX - 1 <= value <= INT64_MAX)
        )
        trace_id, span_id = columns["trace_id"][row] or None, columns["span_id"][row] or None
        raise TraceInputError(
            f"{name} {values[row]!r} does not fit int64 nanoseconds (in {source})",
            trace_id=trace_id,
            span_id=span_id,
        ) from None
