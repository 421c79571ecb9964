"""The model side of a served request: request bodies in, one `Diagnosis` (or a refusal) each out.

It runs where the model runs (a thread of the server, or the model's own process, see
`bmeg.serving.model_process`), so the server's event loop only moves bytes: parsing a
30-span trace costs about as much as the event loop's whole HTTP work for it.

Requests are diagnosed together in one model call when they can be: not when they share a
trace id (their spans would merge) and not beyond `max_batch_spans`. When a combined call
fails, each of its requests is diagnosed alone, so one bad trace fails only its own request;
parsing is per request too, and whatever it raises (a reader's `RecursionError` included)
answers that request alone.

Before parsing, a body is inflated only when its `Content-Encoding` says gzip (bounded:
`bmeg.serving.limits`); a body that starts with gzip's magic without the header is refused,
never inflated. JSON is checked for nesting depth and number length first; after parsing, the
spans and traces per request are counted, and span names and times are checked for what the
graph code cannot take (control characters, which it uses as separators; times past 2^62 ns,
whose clock-skew repair would overflow int64). Each refusal names its limit.

A request of more than `split_spans` spans (not in window mode) is answered with its `Parts`:
its traces in groups of about `split_spans` spans, which the caller queues again one after the
other, so requests that arrive meanwhile are diagnosed between them (`merge` joins the answers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from bmeg.diagnosis import Diagnosis
from bmeg.mitigation.planner import suggest
from bmeg.serving.limits import GZIP_MAGIC, BadEncoding, LimitExceeded, check_json, inflate
from bmeg.traces import TraceInputError, read_spans_bytes
from bmeg.traces.io import CONTENT_TYPES

log = logging.getLogger(__name__)

#: Latest span time accepted (2^62 ns: the year 2116); sums of two such times stay within int64.
MAX_TIME_NS = 2**62
#: Characters refused in service and operation names: the graph code joins names with control characters.
_CONTROL = "[\\x00-\\x1f\\x7f]"


@dataclass(frozen=True)
class Payload:
    body: bytes
    media_type: str
    content_encoding: str | None = None
    spans: pa.Table | None = None  # a part of a split request: parsed already


@dataclass(frozen=True)
class Limits:
    max_spans: int  # per request
    max_batch_spans: int  # per model call
    max_traces: int = 10_000  # per request
    max_body_bytes: int = 16 * 1024 * 1024  # after decompression
    max_json_depth: int = 64
    max_json_number_digits: int = 40
    split_spans: int | None = None  # larger requests are answered with their Parts


@dataclass(frozen=True)
class Parts:
    """A large request's traces in groups, to be diagnosed one after the other."""

    tables: list[pa.Table]


class RequestRefused(Exception):
    """A request answered with an HTTP error status and a message that says why."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message)  # both in args: the exception crosses process boundaries
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Answer:
    diagnosis: Diagnosis
    spans: pa.Table  # the request's spans, for the call graphs of the web page


def diagnose_payloads(model, payloads: list[Payload], window: bool, limits: Limits) -> list[Answer | Parts | Exception]:
    """Each payload's answer, parts or error (mostly `RequestRefused`), in order; `model` is a
    `bmeg.serving.model.DiagnosisModel`."""
    answers: list[Answer | Parts | Exception | None] = [None] * len(payloads)
    parsed: list[tuple[int, pa.Table, frozenset[str]]] = []
    for i, payload in enumerate(payloads):
        try:
            spans = payload.spans if payload.spans is not None else parse(payload, limits)
        except RequestRefused as refusal:
            answers[i] = refusal
            continue
        except Exception as error:  # noqa: BLE001 - a reader's failure is its own request's alone
            log.warning("reading a request failed: %r", error)
            answers[i] = RequestRefused(400, f"malformed trace payload: {type(error).__name__}: {str(error)[:300]}")
            continue
        if payload.spans is None and not window and limits.split_spans and spans.num_rows > limits.split_spans:
            answers[i] = Parts(split(spans, limits.split_spans))
            continue
        parsed.append((i, spans, frozenset(pc.unique(spans["trace_id"]).to_pylist())))
    for group in _model_calls(parsed, limits.max_batch_spans):
        for i, answer in _diagnose_group(model, group, window):
            answers[i] = answer
    return answers


def parse(payload: Payload, limits: Limits) -> pa.Table:
    """The request's spans, or `RequestRefused` naming the limit or the fault."""
    try:
        body = inflate(payload.body, payload.content_encoding, limits.max_body_bytes)
        if body[:2] == GZIP_MAGIC:
            raise RequestRefused(400, "the body is gzip-compressed but its Content-Encoding does not say so: "
                                      "send `Content-Encoding: gzip` (it is inflated only then, within the limit)")
        if CONTENT_TYPES.get(payload.media_type, "json") is None:  # a JSON media type
            check_json(body, limits.max_json_depth, limits.max_json_number_digits)
    except LimitExceeded as error:
        raise RequestRefused(413 if error.limit == "max_body_bytes" else 400, error.message) from None
    except BadEncoding as error:
        raise RequestRefused(415 if "unsupported" in str(error) else 400, str(error)) from None
    try:
        spans = read_spans_bytes(body, payload.media_type)
    except TraceInputError as error:
        raise RequestRefused(400, f"malformed trace payload: {error}") from None
    if spans.num_rows == 0:
        raise RequestRefused(400, "the payload holds no spans")
    if spans.num_rows > limits.max_spans:
        raise RequestRefused(413, f"{spans.num_rows} spans is over the limit of {limits.max_spans} per request "
                                  "(BMEG_MAX_SPANS)")
    traces = pc.count_distinct(spans["trace_id"]).as_py()
    if traces > limits.max_traces:
        raise RequestRefused(413, f"{traces} traces is over the limit of {limits.max_traces} per request "
                                  "(BMEG_MAX_TRACES)")
    _check_spans(spans)
    return spans


def _check_spans(spans: pa.Table) -> None:
    for column in ("service", "operation"):
        bad = pc.match_substring_regex(spans[column], _CONTROL)
        if pc.any(bad).as_py():
            name = spans[column].filter(bad)[0].as_py()
            raise RequestRefused(422, f"invalid trace: a {column} name holds a control character: {name[:100]!r}")
    end = pc.add_checked(spans["start_ns"], pc.max_element_wise(spans["duration_ns"], 0))
    if pc.any(pc.or_(pc.less(spans["start_ns"], 0), pc.greater(end, MAX_TIME_NS))).as_py():
        raise RequestRefused(422, "invalid trace: a span starts before 1970 or ends after 2^62 ns (2116), "
                                  "past what clock-skew repair can shift within int64")


def split(spans: pa.Table, max_spans: int) -> list[pa.Table]:
    """The spans in groups of whole traces, each of at most `max_spans` spans (or one larger trace)."""
    trace_ids = spans["trace_id"].combine_chunks()
    counts = pc.value_counts(trace_ids)
    groups, group, size = [], [], 0
    for item in counts.to_pylist():
        if group and size + item["counts"] > max_spans:
            groups.append(group)
            group, size = [], 0
        group.append(item["values"])
        size += item["counts"]
    groups.append(group)
    return [spans.filter(pc.is_in(trace_ids, pa.array(ids, pa.string()))) for ids in groups]


def merge(answers: list[Answer]) -> Answer:
    """One answer from the answers of a request's parts, in order."""
    first = answers[0].diagnosis
    traces = [trace for answer in answers for trace in answer.diagnosis.traces]
    return Answer(first.model_copy(update={"traces": traces}),
                  pa.concat_tables([answer.spans for answer in answers]))


def _model_calls(parsed: list[tuple[int, pa.Table, frozenset[str]]], max_batch_spans: int):
    """Requests in groups of disjoint trace ids and at most `max_batch_spans` spans (a larger request alone)."""
    group, spans, seen = [], 0, set()
    for request in parsed:
        _, table, trace_ids = request
        if group and (spans + table.num_rows > max_batch_spans or not seen.isdisjoint(trace_ids)):
            yield group
            group, spans, seen = [], 0, set()
        group.append(request)
        spans += table.num_rows
        seen |= trace_ids
    if group:
        yield group


def _diagnose_group(model, group, window: bool) -> list[tuple[int, Answer | Exception]]:
    spans = group[0][1] if len(group) == 1 else pa.concat_tables([table for _, table, _ in group])
    try:
        combined = model.diagnose(spans, window=window)
    except Exception as error:  # noqa: BLE001 - answered to its own request only
        if len(group) > 1:
            return [answer for request in group for answer in _diagnose_group(model, [request], window)]
        if isinstance(error, TraceInputError):
            error = RequestRefused(422, f"invalid trace: {error}")
        return [(group[0][0], error)]
    if len(group) == 1:
        return [(group[0][0], Answer(suggest(combined), spans))]
    return [(i, Answer(suggest(_part(combined, trace_ids)), table)) for i, table, trace_ids in group]


def _part(diagnosis: Diagnosis, trace_ids: frozenset[str]) -> Diagnosis:
    return diagnosis.model_copy(update={"traces": [t for t in diagnosis.traces if t.trace_id in trace_ids]})
