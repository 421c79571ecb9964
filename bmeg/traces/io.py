"""One entry point for reading and writing spans in any supported format.

File formats: `otlp-proto`, `otlp-json`, `jaeger-json`, `zipkin-json`, `csv`, `parquet`.
Without a format, it is detected: Parquet by its `PAR1` magic; JSON by a leading `{` or `[`
(the flavour by its keys: OTLP `resourceSpans` (Tempo's `batches`, Jaeger api_v3's `result`),
Jaeger's query API `data`/`traceID`+`spans`, a Jaeger `model.Span` `traceId`+`spanId`, Zipkin
v2 `traceId`+`id`); CSV by a `.csv`/`.csv.gz` suffix or a text header line; otherwise protobuf.
Gzipped input (by its magic bytes) is decompressed first, to at most `MAX_INFLATED_BYTES`.

Messages (an HTTP body, a Kafka message) are read by `read_spans_bytes`: by the encoding the
Collector's Kafka exporter was configured with (`ENCODINGS`), else by a content type, else by
`detect_encoding`, which looks at the bytes' structure without decoding them:

- JSON (a leading `{`/`[`) is told apart by its keys; the three JSON encodings are read by
  their keys whatever name they came with, the names of the JSON flavours overlapping
  (`jaeger_json` is a jsonpb `model.Span`, `jaeger-json` the query API's traces; both read).
- protobuf: a message whose top level holds only field 1 (length-delimited) is an OTLP
  request (`resource_spans`) or a Zipkin `ListOfSpans` (`spans`): its first element decides,
  `ResourceSpans` having only fields 1-3 (length-delimited), a Zipkin span a kind, times or
  other fields up to 13. A top level with other fields is a Jaeger `model.Span` (fields 1-12,
  its span id present).

The consumer's hot path is `otlp_proto`: `detect_encoding(data, expected="otlp_proto")` checks
that encoding first, which costs a scan of the message's top-level fields.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from bmeg.traces.errors import TraceInputError
from bmeg.traces.jaeger import (
    is_jaeger_document,
    is_jaeger_model_document,
    jaeger_json_to_table,
    read_jaeger_model_json,
    read_jaeger_proto,
    table_to_jaeger_json,
)
from bmeg.traces.otlp import (
    is_otlp_json_document,
    otlp_json_to_table,
    read_otlp_proto,
    table_to_otlp_json,
    to_otlp_proto_bytes,
)
from bmeg.traces.schema import conform, empty_span_table
from bmeg.traces.tables import ColumnMapping, read_csv, read_parquet, write_parquet
from bmeg.traces.zipkin import is_zipkin_document, read_zipkin_proto, zipkin_json_to_table

FORMATS = ("otlp-proto", "otlp-json", "jaeger-json", "zipkin-json", "csv", "parquet")
WRITE_FORMATS = ("otlp-proto", "otlp-json", "jaeger-json", "parquet")
#: The encodings of the OpenTelemetry Collector's Kafka exporter (contrib v0.155.0).
ENCODINGS = ("otlp_proto", "otlp_json", "jaeger_proto", "jaeger_json", "zipkin_proto", "zipkin_json")
#: File suffixes read from a directory (others, e.g. READMEs and labels, are skipped).
TRACE_SUFFIXES = (".json", ".jsonl", ".ndjson", ".pb", ".proto", ".bin", ".csv", ".parquet")
CONTENT_TYPES = {
    "application/x-protobuf": "otlp-proto",
    "application/protobuf": "otlp-proto",
    "application/json": None,  # any JSON flavour, told apart by the keys
    "application/x-ndjson": None,
}
#: The most bytes gzipped input may inflate to (a 1 MB message of zeros inflates to ~1 GB).
MAX_INFLATED_BYTES = 256 * 2**20
_GZIP_MAGIC = b"\x1f\x8b"
_ANY_JSON = "json"  # detected as JSON; the flavour is told by the keys
_PROTOBUF_FIRST_TAG = b"\n"  # field 1 (resource_spans), length-delimited
#: Each encoding's reader, and what a format name or an encoding name reads as.
_PROTOBUF_READERS: dict[str, Callable[[bytes, str], pa.Table]] = {
    "otlp-proto": read_otlp_proto,
    "jaeger-proto": read_jaeger_proto,
    "zipkin-proto": read_zipkin_proto,
}
_JSON_FORMATS = ("otlp-json", "jaeger-json", "zipkin-json")


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


def read_spans_bytes(
    data: bytes,
    content_type: str | None = None,
    *,
    encoding: str | None = None,
    max_inflated_bytes: int = MAX_INFLATED_BYTES,
) -> pa.Table:
    """Read an HTTP body or a Kafka message: by `encoding` (one of `ENCODINGS`) when given,
    else by its content type (parameters are ignored), else by `detect_encoding`, else as a
    file would be read (the Jaeger query API's JSON, CSV, Parquet)."""
    if encoding is not None:
        if encoding not in ENCODINGS:
            raise TraceInputError(f"unknown encoding {encoding!r}; expected one of {list(ENCODINGS)}")
        format = encoding.replace("_", "-")
    elif content_type is not None:
        media_type = content_type.split(";")[0].strip().lower()
        if media_type not in CONTENT_TYPES:
            raise TraceInputError(f"unsupported content type {content_type!r}; expected one of {list(CONTENT_TYPES)}")
        format = CONTENT_TYPES[media_type] or _ANY_JSON
    else:
        data = _inflated(data, "<body>", max_inflated_bytes)
        try:
            format = detect_encoding(data).replace("_", "-")
        except TraceInputError:
            format = None  # no Kafka encoding: any file format (the query API's JSON, CSV, ...)
    return _read_bytes(data, format, "<body>", None, max_inflated_bytes)


def detect_encoding(data: bytes, expected: str | None = None) -> str:
    """The Kafka exporter encoding (one of `ENCODINGS`) the bytes are in, told from their
    structure (module docstring); `expected` is checked first. Gzipped bytes are not looked
    into. Raises `TraceInputError` when none fits. Telling is not validating: the reader may
    still reject the bytes."""
    if expected is not None and expected not in ENCODINGS:
        raise TraceInputError(f"unknown encoding {expected!r}; expected one of {list(ENCODINGS)}")
    order = sorted(ENCODINGS, key=lambda encoding: encoding != expected)
    json_kind: list[str | None] = []  # the JSON flavour, computed once if asked
    for encoding in order:
        if encoding.endswith("_json"):
            if not json_kind:
                json_kind.append(_json_encoding(data))
            if json_kind[0] == encoding:
                return encoding
        elif _PROTOBUF_CHECKS[encoding](data):
            return encoding
    raise TraceInputError(
        f"the bytes are in none of the encodings {list(ENCODINGS)} (first bytes {data[:16]!r})"
    )


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


def _read_bytes(
    data: bytes, format: str | None, source: str, mapping, max_inflated_bytes: int = MAX_INFLATED_BYTES
) -> pa.Table:
    """`format` is a file format or an encoding with `-` for `_`."""
    if format != "csv":  # pyarrow reads gzipped CSV itself
        data = _inflated(data, source, max_inflated_bytes)
    if format is None:
        return _read_sniffed(data, source, mapping)
    if format in _PROTOBUF_READERS:
        return _PROTOBUF_READERS[format](data, source)
    if format == "parquet":
        return read_parquet(data, source, mapping)
    if format == "csv":
        return read_csv(data, source, mapping)
    if format in (*_JSON_FORMATS, _ANY_JSON):
        return _read_json(data, format, source)
    raise TraceInputError(f"unknown trace format {format!r}; expected one of {FORMATS} or {ENCODINGS}")


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
    if format == "otlp-json":
        return otlp_json_to_table(documents, source)
    if format == "zipkin-json":
        return zipkin_json_to_table(documents, source)
    if all(is_jaeger_model_document(document) for document in documents):
        return read_jaeger_model_json(documents, source)  # the Kafka exporter's `jaeger_json`
    return jaeger_json_to_table(documents, source)


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
    flavour = _json_flavour(documents[0])
    if flavour is None:
        first = documents[0]
        keys = sorted(first)[:10] if isinstance(first, dict) else type(first).__name__
        raise TraceInputError(
            f"JSON is none of OTLP ('resourceSpans'), Jaeger ('data', 'traceID'+'spans' or "
            f"'traceId'+'spanId') and Zipkin v2 ('traceId'+'id'); got {keys} (in {source})"
        )
    return flavour


def _json_flavour(document: object) -> str | None:
    if is_otlp_json_document(document):
        return "otlp-json"
    if is_jaeger_document(document) or is_jaeger_model_document(document):
        return "jaeger-json"
    if is_zipkin_document(document):
        return "zipkin-json"
    return None


def _json_encoding(data: bytes) -> str | None:
    """The JSON encoding of a message, or None if it is no JSON of spans."""
    if data.lstrip()[:1] not in (b"{", b"["):
        return None
    try:
        documents = _json_documents(data, "<bytes>")
    except TraceInputError:
        return None
    flavour = _json_flavour(documents[0]) if documents else None
    if flavour == "jaeger-json" and not is_jaeger_model_document(documents[0]):
        return None  # the query API's JSON is no Kafka encoding (it still reads as a file)
    return flavour.replace("-", "_") if flavour else None


def _looks_like_csv_header(data: bytes) -> bool:
    """A first line of printable ASCII with commas (protobuf starts with a control byte)."""
    line = data[:4096].split(b"\n", 1)[0].rstrip(b"\r")
    return b"," in line and all(32 <= byte < 127 for byte in line)


def _inflated(data: bytes, source: str, max_bytes: int) -> bytes:
    """Gzipped data inflated (up to `max_bytes`, else an error); other data as it is."""
    if data[:2] != _GZIP_MAGIC:
        return data
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip framing
    try:
        inflated = inflater.decompress(data, max_bytes)
        if inflater.unconsumed_tail:
            raise TraceInputError(f"gzip data inflates to more than {max_bytes:,} bytes (in {source})")
        if not inflater.eof:
            raise TraceInputError(f"corrupt gzip data: truncated (in {source})")
    except zlib.error as error:
        raise TraceInputError(f"corrupt gzip data: {error} (in {source})") from None
    return inflated


# --- protobuf structure ----------------------------------------------------------------------

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MAX_FIELDS_SCANNED = 64  # enough to tell the encodings apart; the reader checks the rest


def _fields(data: bytes | memoryview) -> list[tuple[int, int, int, int]] | None:
    """The first fields of a protobuf message as (number, wire type, value start, value end),
    or None when the bytes are not protobuf (a bad tag, a length past the end)."""
    fields: list[tuple[int, int, int, int]] = []
    at, end = 0, len(data)
    while at < end and len(fields) < _MAX_FIELDS_SCANNED:
        tag, at = _varint(data, at)
        if tag is None or tag >> 3 == 0:
            return None
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _LEN:
            length, at = _varint(data, at)
            if length is None:
                return None
            after = at + length
        elif wire_type == _VARINT:
            value, after = _varint(data, at)
            if value is None:
                return None
        elif wire_type in (_I64, _I32):
            after = at + (8 if wire_type == _I64 else 4)
        else:
            return None  # groups are in none of these messages
        if after > end:
            return None
        fields.append((number, wire_type, at, after))
        at = after
    return fields


def _varint(data: bytes | memoryview, at: int) -> tuple[int | None, int]:
    # a one-byte varint (every tag here, most lengths) first: the Kafka consumer checks each
    # message's encoding, and the loop was most of that check's time
    if at < len(data) and data[at] < 0x80:
        return data[at], at + 1
    value, shift = 0, 0
    while at < len(data) and shift < 64:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return None, at


def _first_element(data: bytes) -> list[tuple[int, int, int, int]] | None:
    """The fields of the first element of a message made of field 1 only, else None."""
    top = _fields(data)
    if not top or any(number != 1 or wire_type != _LEN for number, wire_type, _, _ in top):
        return None
    _, _, start, end = top[0]
    return _fields(memoryview(data)[start:end])  # a view: the element may be megabytes


def _is_otlp_proto(data: bytes) -> bool:
    if not data:
        return True  # an empty request
    inner = _first_element(data)
    return inner is not None and all(number <= 3 and wire_type == _LEN for number, wire_type, _, _ in inner)


def _is_zipkin_proto(data: bytes) -> bool:
    inner = _first_element(data)
    return bool(inner) and all(number <= 13 for number, _, _, _ in inner or ()) and not _is_otlp_proto(data)


_JAEGER_WIRE_TYPES = {number: _LEN for number in (1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12)} | {5: _VARINT}


def _is_jaeger_proto(data: bytes) -> bool:
    top = _fields(data)
    return (
        bool(top)
        and any(number == 2 for number, _, _, _ in top or ())
        and all(_JAEGER_WIRE_TYPES.get(number) == wire_type for number, wire_type, _, _ in top or ())
    )


_PROTOBUF_CHECKS: dict[str, Callable[[bytes], bool]] = {
    "otlp_proto": _is_otlp_proto,
    "zipkin_proto": _is_zipkin_proto,
    "jaeger_proto": _is_jaeger_proto,
}
