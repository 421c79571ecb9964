"""The model side of a served request: request bodies in, one `Diagnosis` (or a refusal) each out.

It runs where the model runs (a thread of the server, or the model's own process, see
`bmeg.serving.model_process`), so the server's event loop only moves bytes: parsing a
30-span trace costs about as much as the event loop's whole HTTP work for it.

Requests are diagnosed together in one model call when they can be: not when they share a
trace id (their spans would merge) and not beyond `max_batch_spans`. When a combined call
fails, each of its requests is diagnosed alone, so one bad trace fails only its own request.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from bmeg.diagnosis import Diagnosis
from bmeg.mitigation.planner import suggest
from bmeg.traces import TraceInputError, read_spans_bytes


@dataclass(frozen=True)
class Payload:
    body: bytes
    media_type: str


@dataclass(frozen=True)
class Limits:
    max_spans: int  # per request
    max_batch_spans: int  # per model call


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


def diagnose_payloads(model, payloads: list[Payload], window: bool, limits: Limits) -> list[Answer | Exception]:
    """Each payload's answer or error (mostly `RequestRefused`), in order; `model` is a
    `bmeg.serving.model.DiagnosisModel`."""
    answers: list[Answer | Exception | None] = [None] * len(payloads)
    parsed: list[tuple[int, pa.Table, frozenset[str]]] = []
    for i, payload in enumerate(payloads):
        try:
            spans = parse(payload, limits.max_spans)
        except RequestRefused as refusal:
            answers[i] = refusal
            continue
        parsed.append((i, spans, frozenset(pc.unique(spans["trace_id"]).to_pylist())))
    for group in _model_calls(parsed, limits.max_batch_spans):
        for i, answer in _diagnose_group(model, group, window):
            answers[i] = answer
    return answers


def parse(payload: Payload, max_spans: int) -> pa.Table:
    try:
        spans = read_spans_bytes(payload.body, payload.media_type)
    except TraceInputError as error:
        raise RequestRefused(400, f"malformed trace payload: {error}") from None
    if spans.num_rows == 0:
        raise RequestRefused(400, "the payload holds no spans")
    if spans.num_rows > max_spans:
        raise RequestRefused(413, f"{spans.num_rows} spans is over the limit of {max_spans} per request")
    return spans


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
