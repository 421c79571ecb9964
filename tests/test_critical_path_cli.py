"""`bmeg critical-path` on files of one and of many traces (the readers want hex ids)."""

from __future__ import annotations

import json

from click.testing import CliRunner
from builders import spans

from bmeg.cli import main
from bmeg.traces import span_table
from bmeg.traces.io import write_spans


def trace(rows, trace_id: str):
    """One trace with hex ids and times after the epoch (what the readers accept)."""
    after_epoch = [(span, parent, 10**15 + start, duration) for span, parent, start, duration in rows]
    return spans(after_epoch, trace_id)


def run(*args: str):
    return CliRunner().invoke(main, ["critical-path", *args])


def test_one_trace_prints_one_json_object(tmp_path):
    file = tmp_path / "trace.otlp.pb"
    rows = [("a", None, 0, 100_000), ("b", "a", 10_000, 50_000), ("c", "a", 20_000, 70_000)]
    write_spans(trace(rows, "0f"), file, "otlp-proto")
    result = run(str(file), "--format", "otlp-proto", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "trace_id": "0f",
        "total_us": 100.0,
        "path": [
            {"service": "svc-a", "operation": "op-a", "exclusive_us": 30.0},
            {"service": "svc-c", "operation": "op-c", "exclusive_us": 70.0},
        ],
    }


def test_many_traces_print_a_list_and_a_table(tmp_path):
    one = trace([("a", None, 0, 1000)], "aa")
    two = trace([("b", None, 0, 2000), ("c", "b", 500, 500)], "bb")
    table = span_table({name: one[name].to_pylist() + two[name].to_pylist() for name in one.column_names})
    file = tmp_path / "traces.parquet"
    write_spans(table, file, "parquet")
    paths = json.loads(run(str(file), "--json").stdout)
    assert [(p["trace_id"], p["total_us"], len(p["path"])) for p in paths] == [("aa", 1.0, 1), ("bb", 2.0, 2)]
    table_output = run(str(file)).stdout
    assert "svc-c" in table_output and "op-b" in table_output


def test_repairs_go_to_stderr_and_bad_input_is_an_error(tmp_path):
    file = tmp_path / "orphan.parquet"
    write_spans(trace([("a", None, 0, 100), ("b", "dead", 10, 10)], "01"), file, "parquet")
    result = run(str(file), "--json")
    assert result.exit_code == 0 and "not in the trace" in result.stderr
    write_spans(trace([("a", None, 0, 100), ("b", "a", 10, -10)], "01"), file, "parquet")
    result = run(str(file), "--json")
    assert result.exit_code == 1 and "span b" in result.stderr


def test_jaeger_fixture_with_duplicate_span_ids(shared_dir):
    result = run(str(shared_dir / "fixtures" / "jaeger" / "ui_01.json"), "--json")
    assert result.exit_code == 0, result.output
    assert "duplicate span id" in result.stderr
    path = json.loads(result.stdout)
    assert sum(step["exclusive_us"] for step in path["path"]) == path["total_us"]
