import gzip
import io

import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmeg.traces import SPAN_SCHEMA, ColumnMapping, TraceInputError, read_spans, write_spans
from bmeg.traces.tables import NEZHA, detect_mapping

NEZHA_CSV = b"""TraceID,SpanID,ParentID,PodName,OperationName,StartTimeUnixNano,EndTimeUnixNano,Duration
01DB723F5DE73F1E,ab872b6a0755789d,root,frontend-579b9bff58-t2dbm,hipstershop.Frontend/Recv.,1661273974730641486,1661273975415194516,684553
01db723f5de73f1e,1234567812345678,ab872b6a0755789d,cartservice-579f59597d-wc2lz,hipstershop.CartService/GetCart,1661273974743287108,1661273974749644874,6357
"""

OWN_CSV = b"""id,parent,svc,op,begin_ms,took_ms
aa,,web,GET,1000,5
bb,aa,db,SELECT,1001,2
"""
OWN_MAPPING = ColumnMapping(
    trace_id="id", span_id="id", parent_id="parent", operation="op", service="svc",
    start="begin_ms", duration="took_ms", time_unit="ms", duration_unit="ms",
)  # fmt: skip


def test_nezha_layout_is_detected_and_services_come_from_pod_names():
    table = read_spans(NEZHA_CSV, "csv")
    assert table.schema == SPAN_SCHEMA
    root, child = table.to_pylist()
    assert root["trace_id"] == "01db723f5de73f1e"  # lowercased
    assert (root["parent_id"], child["parent_id"]) == (None, "ab872b6a0755789d")
    assert (root["service"], child["service"]) == ("frontend", "cartservice")
    assert child["instance"] == "cartservice-579f59597d-wc2lz"
    assert root["duration_ns"] == 1661273975415194516 - 1661273974730641486  # exact, from the end time
    assert (root["kind"], root["status"]) == ("unspecified", "unset")


def test_gzipped_csv_and_suffix_detection(tmp_path):
    path = tmp_path / "17_00_trace.csv.gz"
    path.write_bytes(gzip.compress(NEZHA_CSV))
    assert read_spans(path).equals(read_spans(NEZHA_CSV, "csv"))
    assert read_spans(gzip.compress(NEZHA_CSV)).num_rows == 2  # text header sniffed under gzip


def test_custom_mapping_with_units_and_empty_root_parent():
    table = read_spans(OWN_CSV, "csv", mapping=OWN_MAPPING)
    assert table["start_ns"].to_pylist() == [1_000_000_000, 1_001_000_000]
    assert table["duration_ns"].to_pylist() == [5_000_000, 2_000_000]
    assert table["parent_id"].to_pylist() == [None, "aa"]
    assert table["service"].to_pylist() == ["web", "db"]


def test_unknown_layout_and_bad_mappings_are_trace_input_errors():
    with pytest.raises(TraceInputError, match="unknown span table layout"):
        read_spans(OWN_CSV, "csv")
    with pytest.raises(TraceInputError, match="unknown column mapping 'zipkin'"):
        read_spans(OWN_CSV, "csv", mapping="zipkin")
    with pytest.raises(TraceInputError, match="EndTimeUnixNano.*of the mapping are not in the table"):
        read_spans(OWN_CSV.replace(b"begin_ms", b"StartTimeUnixNano"), "csv", mapping=NEZHA)
    with pytest.raises(TraceInputError, match="needs an `end` or a `duration`"):
        ColumnMapping(trace_id="a", span_id="b", parent_id="c", operation="d", start="e", service="f")
    with pytest.raises(TraceInputError, match="unknown time unit"):
        ColumnMapping(trace_id="a", span_id="b", parent_id="c", operation="d", start="e", end="f",
                      service="g", time_unit="fortnight")  # fmt: skip


@pytest.mark.parametrize(
    "row, message",
    [
        (b"cc,aa,web,GET,,5", "no start time"),
        (b"cc,aa,web,GET,-4,5", "negative start time"),
        (b"cc,aa,web,GET,9223372036854775,5", "overflows int64"),
        (b"xyz,aa,web,GET,1000,5", "not a lowercase hex id"),
        (b",aa,web,GET,1000,5", "no trace id"),
        (b"cc,aa,web,GET,1000,-1", "ends before it starts"),
        (b"cc,aa,web,GET,1000,five", "cannot read span CSV"),
    ],
)
def test_bad_rows_are_named(row, message):
    with pytest.raises(TraceInputError, match=message) as caught:
        read_spans(OWN_CSV + row + b"\n", "csv", mapping=OWN_MAPPING)
    if "cannot read" not in message and "trace id" not in message:
        assert caught.value.span_id == row.split(b",")[0].decode()


def test_parquet_from_our_writer_reads_back_directly(tmp_path):
    table = read_spans(NEZHA_CSV, "csv")
    write_spans(table, tmp_path / "spans.parquet", "parquet")
    assert read_spans(tmp_path / "spans.parquet").equals(table)
    assert detect_mapping(table.column_names, "x").start == "start_ns"


def test_parquet_in_another_layout_goes_through_a_mapping():
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": ["aa"], "parent": [None], "svc": ["web"], "op": ["GET"],
                             "begin_ms": [1000], "took_ms": [5]}), buffer)  # fmt: skip
    table = read_spans(buffer.getvalue(), mapping=OWN_MAPPING)
    assert table.to_pylist()[0]["duration_ns"] == 5_000_000


def test_nezha_fixture_minute(shared_dir):
    table = read_spans(shared_dir / "data/nezha-ob-2022-08-23/normal/17_00_trace.csv.gz")
    assert table.num_rows == 22_969
    services = set(table["service"].to_pylist())
    assert {"frontend", "cartservice", "checkoutservice", "currencyservice", "productcatalogservice"} <= services
    assert 9 <= len(services) <= 12
    assert not any("-" in service for service in services)  # pod suffixes stripped
    roots = pc.sum(pc.is_null(table["parent_id"])).as_py()
    assert 0 < roots < table.num_rows
    assert roots == pc.count_distinct(table["trace_id"]).as_py()  # one root per trace in this minute
    assert pc.min(table["duration_ns"]).as_py() >= 0


def test_parquet_columns_of_the_wrong_type_or_overflowing_sums_are_named():
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(**columns) -> bytes:
        base = {"id": ["aa"], "parent": [None], "svc": ["web"], "op": ["GET"], "begin_ms": [1000], "took_ms": [5]}
        buffer = io.BytesIO()
        pq.write_table(pa.table({**base, **columns}), buffer)
        return buffer.getvalue()

    with pytest.raises(TraceInputError, match="the start column is not whole ms"):
        read_spans(parquet(begin_ms=["soon"]), mapping=OWN_MAPPING)
    with pytest.raises(TraceInputError, match="the duration column is not whole ms"):
        read_spans(parquet(took_ms=[1.5]), mapping=OWN_MAPPING)
    with pytest.raises(TraceInputError, match="start \\+ duration overflows") as caught:
        read_spans(parquet(begin_ms=[9_000_000_000_000], took_ms=[900_000_000_000]), mapping=OWN_MAPPING)
    assert caught.value.span_id == "aa"


def test_empty_kind_and_status_cells_get_the_defaults():
    csv = b"trace_id,span_id,parent_id,service,operation,start_ns,duration_ns,kind,status,"
    csv += b"peer_service,db_system,instance\n"
    csv += b"0a,0b,,web,GET,10,5,,,,,\n0a,0c,0b,db,SELECT,11,2,CLIENT,Error,mongodb,mongodb,db-0\n"
    rows = read_spans(csv).to_pylist()
    assert [(row["kind"], row["status"]) for row in rows] == [("unspecified", "unset"), ("client", "error")]
    assert (rows[0]["peer_service"], rows[1]["peer_service"], rows[1]["instance"]) == (None, "mongodb", "db-0")


cells = st.text("0123456789abcdefxyz-root\",. \n", max_size=12) | st.integers(-(2**64), 2**64).map(str)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.lists(cells, min_size=8, max_size=8), max_size=4))
def test_random_nezha_rows_read_or_raise_trace_input_error(rows):
    body = "\n".join(",".join(row) for row in rows).encode()
    try:
        table = read_spans(NEZHA_CSV.splitlines(keepends=True)[0] + body, "csv")
    except TraceInputError:
        return
    assert table.schema == SPAN_SCHEMA


@pytest.mark.integration
def test_nezha_fault_minutes_read_as_one_table(shared_dir):
    table = read_spans(shared_dir / "data/nezha-ob-2022-08-23/fault")  # 59 gzipped CSV files
    assert table.schema == SPAN_SCHEMA
    assert 1_100_000 < table.num_rows < 1_250_000  # the README's "~1.17 M spans"
    assert "frontend" in set(table["service"].to_pylist())
