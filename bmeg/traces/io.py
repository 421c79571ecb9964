"""One entry point for reading and writing spans in any supported format.

Formats: `otlp-proto`, `otlp-json`, `jaeger-json`, `csv`, `parquet`. Without a format, it is
detected: Parquet by its `PAR1` magic; JSON by a leading `{` or `[` (OTLP vs Jaeger by the
keys); CSV by a `.csv`/`.csv.gz` suffix or a text header line; otherwise protobuf.
Gzipped input (by its magic bytes) is decompressed first.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from bmeg.traces.errors import TraceInputError
from bmeg.traces.jaeger import is_jaeger_document, jaeger_json_to_table, table_to_jaeger_json
from bmeg.traces.otlp import otlp_json_to_table, read_otlp_proto, table_to_otlp_json, to_otlp_proto_bytes
from bmeg.traces.schema import conform, empty_span_table
from bmeg.traces.tables import ColumnMapping, read_csv, read_parquet, write_parquet

FORMATS = ("otlp-proto", "otlp-json", "jaeger-json", "csv", "parquet")
WRITE_FORMATS = ("otlp-proto", "otlp-json", "jaeger-json", "parquet")
#: File suffixes read from a directory (others, e.g. READMEs and labels, are skipped).
TRACE_SUFFIXES = (".json", ".jsonl", ".ndjson", ".pb", ".proto", ".bin", ".csv", ".parquet")
CONTENT_TYPES = {
    "application/x-protobuf": "otlp-proto",
    "application/protobuf": "otlp-proto",
    "application/json": None,  # OTLP/JSON or Jaeger JSON, told apart by the keys
    "application/x-ndjson": None,
}
_GZIP_MAGIC = b"\x1f\x8b"
_ANY_JSON = "json"  # detected as JSON; the flavour is told by the keys
_PROTOBUF_FIRST_TAG = b"\n"  # field 1 (resource_spans), length-delimited


def read_spans(
    source: str | Path | bytes, format: str | None = None, *, mapping: ColumnMapping | str | None = None
) -> pa.Table:
    """Read spans from a path, bytes, or a directory (its trace files, concatenated).

    `mapping` applies to CSV and Parquet (default: detected from the header).
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _read_bytes(bytes(source), format, "<bytes>", mapping)
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and _is_trace_file(p))
        if not files:
            raise TraceInputError(f"no trace files ({', '.join(TRACE_SUFFIXES)}) in directory {path}")
        return pa.concat_tables([read_spans(file, format, mapping=mapping) for file in files])
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TraceInputError(f"cannot read {path}: {error.strerror}") from None
    return _read_bytes(data, format or _format_from_suffix(path), str(path), mapping)


def read_spans_bytes(data: bytes, content_type: str) -> pa.Table:
    """Read an HTTP body or a Kafka message by its content type (parameters are ignored)."""
    media_type = content_type.split(";")[0].strip().lower()
    if media_type not in CONTENT_TYPES:
        raise TraceInputError(f"unsupported content type {content_type!r}; expected one of {list(CONTENT_TYPES)}")
    return _read_bytes(data, CONTENT_TYPES[media_type] or _ANY_JSON, "<body>", None)


def write_spans(table: pa.Table, path_or_buffer: str | Path | BinaryIO, format: str) -> None:
    """Write a span table in one of `WRITE_FORMATS` (Jaeger JSON keeps microseconds only)."""
    table = conform(table)
    if format == "parquet":
        write_parquet(table, str(path_or_buffer) if isinstance(path_or_buffer, Path) else path_or_buffer)
        return
    if format == "otlp-proto":
        data = to_otlp_proto_bytes(table)
    elif format == "otlp-json":
        data = json.dumps(table_to_otlp_json(table), ensure_ascii=False).encode()
    elif format == "jaeger-json":
        data = json.dumps(table_to_jaeger_json(table), ensure_ascii=False).encode()
    else:
        raise ValueError(f"cannot write format {format!r}; expected one of {WRITE_FORMATS}")
    if isinstance(path_or_buffer, (str, Path)):
        Path(path_or_buffer).write_bytes(data)
    else:
        path_or_buffer.write(data)


def _read_bytes(data: bytes, format: str | None, source: str, mapping) -> pa.Table:
    if data[:2] == _GZIP_MAGIC and format != "csv":  # pyarrow reads gzipped CSV itself
        data = _gunzip(data, source)
    if format is None:
        return _read_sniffed(data, source, mapping)
    if format == "otlp-proto":
        return read_otlp_proto(data, source)
    if format == "parquet":
        return read_parquet(data, source, mapping)
    if format == "csv":
        return read_csv(data, source, mapping)
    if format in ("otlp-json", "jaeger-json", _ANY_JSON):
        return _read_json(data, format, source)
    raise TraceInputError(f"unknown trace format {format!r}; expected one of {FORMATS}")


def _read_sniffed(data: bytes, source: str, mapping) -> pa.Table:
    if data[:4] == b"PAR1":
        return read_parquet(data, source, mapping)
    if data.lstrip()[:1] in (b"{", b"["):
        try:
            return _read_json(data, _ANY_JSON, source)
        except TraceInputError as json_error:
            # A protobuf message starts with a newline byte (its first field's tag); the
            # length byte after it may read as "{" or "[". Such input gets a second chance.
            if data[:1] != _PROTOBUF_FIRST_TAG:
                raise
            try:
                return read_otlp_proto(data, source)
            except TraceInputError:
                raise json_error from None
    if _looks_like_csv_header(data):
        return read_csv(data, source, mapping)
    return read_otlp_proto(data, source)


def _read_json(data: bytes, format: str, source: str) -> pa.Table:
    documents = _json_documents(data, source)
    if not documents:
        return empty_span_table()
    if format == _ANY_JSON:
        format = _json_format(documents, source)
    reader = otlp_json_to_table if format == "otlp-json" else jaeger_json_to_table
    return reader(documents, source)


def _format_from_suffix(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith((".csv", ".csv.gz")):
        return "csv"
    if name.endswith(".parquet"):
        return "parquet"
    return None  # JSON flavours and protobuf are told by the content


def _is_trace_file(path: Path) -> bool:
    name = path.name.lower().removesuffix(".gz")
    return name.endswith(TRACE_SUFFIXES)


def _json_documents(data: bytes, source: str) -> list:
    """One JSON document, or JSON lines (one document per non-empty line)."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise TraceInputError(f"JSON input is not UTF-8: {error} (in {source})") from None
    try:
        return [json.loads(text)]
    except json.JSONDecodeError as error:
        if error.msg != "Extra data":
            raise TraceInputError(f"invalid JSON: {error} (in {source})") from None
    documents = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                documents.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise TraceInputError(f"invalid JSON on line {number}: {error} (in {source})") from None
    return documents


def _json_format(documents: list, source: str) -> str:
    first = documents[0]
    if isinstance(first, dict) and "resourceSpans" in first:
        return "otlp-json"
    if is_jaeger_document(first):
        return "jaeger-json"
    keys = sorted(first)[:10] if isinstance(first, dict) else type(first).__name__
    raise TraceInputError(
        f"JSON is neither OTLP ('resourceSpans') nor Jaeger ('data' or 'traceID'+'spans'); got {keys} (in {source})"
    )


def _looks_like_csv_header(data: bytes) -> bool:
    """A first line of printable ASCII with commas (protobuf starts with a control byte)."""
    line = data[:4096].split(b"\n", 1)[0].rstrip(b"\r")
    return b"," in line and all(32 <= byte < 127 for byte in line)


def _gunzip(data: bytes, source: str) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as error:
        raise TraceInputError(f"corrupt gzip data: {error} (in {source})") from None
