import io
import json

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from builders import in_order, span_tables

from bmeg.traces import (
    SPAN_SCHEMA,
    WRITE_FORMATS,
    TraceInputError,
    read_spans,
    read_spans_bytes,
    to_otlp_proto_bytes,
    write_spans,
)


@pytest.mark.parametrize("format", WRITE_FORMATS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_writer_round_trips_every_field(format, data):
    table = data.draw(span_tables(time_step=1000 if format == "jaeger-json" else 1))
    buffer = io.BytesIO()
    write_spans(table, buffer, format)
    assert in_order(read_spans(buffer.getvalue())).equals(in_order(table))
    assert in_order(read_spans(buffer.getvalue(), format)).equals(in_order(table))


def test_files_and_directories(tmp_path):
    table = pa.Table.from_pylist(
        [dict(trace_id="0a" * 16, span_id="0b" * 8, parent_id=None, service="web", operation="GET /",
              start_ns=1_000_000, duration_ns=7_000, kind="server", status="ok", peer_service=None,
              db_system=None, instance="web-0")],
        schema=SPAN_SCHEMA,
    )  # fmt: skip
    for format, name in zip(WRITE_FORMATS, ("a.pb", "b.json", "c.json", "d.parquet"), strict=True):
        write_spans(table, tmp_path / name, format)
    (tmp_path / "README.md").write_text("not a trace")
    assert read_spans(tmp_path).equals(pa.concat_tables([table] * 4))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceInputError, match="no trace files"):
        read_spans(tmp_path / "empty")
    with pytest.raises(TraceInputError, match="cannot read"):
        read_spans(tmp_path / "missing.json")


def test_read_spans_bytes_by_content_type(shared_dir):
    document = (shared_dir / "fixtures/otlp/trace.json").read_bytes()
    from_json = read_spans_bytes(document, "application/json; charset=utf-8")
    assert from_json.num_rows == 1
    assert read_spans_bytes(to_otlp_proto_bytes(from_json), "application/x-protobuf").equals(from_json)
    jaeger = (shared_dir / "fixtures/jaeger/ui_01.json").read_bytes()
    assert read_spans_bytes(jaeger, "application/json").num_rows == 5
    with pytest.raises(TraceInputError, match="unsupported content type"):
        read_spans_bytes(document, "text/plain")
    with pytest.raises(TraceInputError, match="invalid JSON"):
        read_spans_bytes(b"{\"resourceSpans\": ", "application/json")


@pytest.mark.parametrize(
    "data, message",
    [
        (b'{"resourceSpans": [', "invalid JSON"),
        (b'{"hello": "world"}', "JSON is none of OTLP"),
        (b"[1, 2, 3]", "JSON is none of OTLP"),
        (b"\x1f\x8b\x08garbage", "corrupt gzip"),
        (b"PAR1 not really parquet", "cannot read span Parquet"),
    ],
)
def test_bad_input_is_a_trace_input_error(data, message):
    with pytest.raises(TraceInputError, match=message):
        read_spans(data)


def test_protobuf_whose_length_byte_reads_as_a_brace_is_not_taken_for_json():
    table = pa.Table.from_pylist([dict(trace_id="aa", span_id="bb", parent_id=None, service="s" * 24, operation="o",
                                       start_ns=1, duration_ns=1, kind="server", status="ok", peer_service=None,
                                       db_system=None, instance=None)], schema=SPAN_SCHEMA)  # fmt: skip
    data = to_otlp_proto_bytes(table)
    assert data[:2] == b"\n["  # 91 bytes long
    assert read_spans(data).equals(table)


def test_unknown_format_is_named():
    with pytest.raises(TraceInputError, match="unknown trace format 'zipkin'"):
        read_spans(b"{}", "zipkin")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
id_like = st.text("0123456789abcdefABCDEFxz", max_size=34)
otlp_like = st.fixed_dictionaries(
    {
        "resourceSpans": st.lists(
            st.fixed_dictionaries(
                {"scopeSpans": st.lists(st.fixed_dictionaries({"spans": st.lists(st.dictionaries(
                    st.sampled_from(["traceId", "spanId", "parentSpanId", "name", "kind", "startTimeUnixNano",
                                     "endTimeUnixNano", "status", "attributes"]),
                    id_like | json_values, max_size=9), max_size=3)}), max_size=2)}  # fmt: skip
            ),
            max_size=2,
        )
    }
)
jaeger_like = st.fixed_dictionaries(
    {
        "traceID": id_like,
        "processes": st.dictionaries(st.sampled_from(["p1", "p2"]), json_values, max_size=2),
        "spans": st.lists(st.dictionaries(
            st.sampled_from(["traceID", "spanID", "references", "startTime", "duration", "tags", "processID"]),
            id_like | json_values, max_size=7), max_size=3),  # fmt: skip
    }
)


def read_or_reject(data: bytes, format: str | None = None) -> None:
    """Any input either reads into a span table or raises TraceInputError: nothing else."""
    try:
        table = read_spans(data, format)
    except TraceInputError:
        return
    assert table.schema == SPAN_SCHEMA


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=200), format=st.sampled_from([None, *WRITE_FORMATS, "csv"]))
def test_random_bytes_never_crash(data, format):
    read_or_reject(data, format)


@settings(max_examples=150, deadline=None)
@given(document=json_values | otlp_like | jaeger_like, format=st.sampled_from([None, "otlp-json", "jaeger-json"]))
@example(document={"resourceSpans": [{"scopeSpans": [{"spans": [{"kind": float("inf")}]}]}]}, format=None)  # CI's find
@example(document={"data": [{"spans": [{"duration": float("-inf")}]}]}, format="jaeger-json")
def test_random_json_never_crashes(document, format):
    read_or_reject(json.dumps(document).encode(), format)


@settings(max_examples=100, deadline=None)
@given(table=span_tables(), cut=st.integers(0, 400), flip=st.integers(0, 400))
def test_damaged_protobuf_never_crashes(table, cut, flip):
    data = bytearray(to_otlp_proto_bytes(table))
    if data:
        data[flip % len(data)] ^= 0x5A
    read_or_reject(bytes(data[: max(cut, 1)]), "otlp-proto")
