import pyarrow as pa
import pytest

from bmeg.traces import SPAN_SCHEMA, TraceInputError, conform, span_table


def test_span_table_fills_optional_columns():
    table = span_table(
        {
            "trace_id": ["t1"],
            "span_id": ["s1"],
            "service": ["nginx"],
            "operation": ["GET /"],
            "start_ns": [1_000],
            "duration_ns": [500],
        }
    )
    assert table.schema == SPAN_SCHEMA
    row = table.to_pylist()[0]
    assert row["parent_id"] is None
    assert row["kind"] == "unspecified"
    assert row["status"] == "unset"


def test_conform_reorders_and_rejects_missing_columns():
    table = span_table({"trace_id": ["t"], "span_id": ["s"], "service": ["a"], "operation": ["o"],
                        "start_ns": [0], "duration_ns": [1]})
    reordered = table.select(list(reversed(table.column_names)))
    assert conform(reordered).schema == SPAN_SCHEMA
    with pytest.raises(ValueError, match="lacks columns"):
        conform(pa.table({"trace_id": ["t"]}))


def test_trace_input_error_names_trace_and_span():
    error = TraceInputError("duplicate span id", trace_id="abc", span_id="01")
    assert str(error) == "trace abc, span 01: duplicate span id"
    assert error.trace_id == "abc"
