"""Micro-batching: requests that arrive while the model is busy are diagnosed in one call.

A detector call has a fixed cost (graph assembly, two GNN passes, the SVM) that dwarfs the
per-trace cost, and the model runs one call at a time. So one worker takes every request
queued, concatenates their spans, diagnoses them together and hands each request its own
traces back. Nothing waits on purpose: an idle server diagnoses a lone request at once.
Requests are not mixed when they share a trace id (their spans would merge) or ask for a
window ranking (which is over their own traces only).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from bmeg.diagnosis import Diagnosis
from bmeg.serving.model import ModelSlot


@dataclass
class _Request:
    spans: pa.Table
    window: bool
    trace_ids: frozenset[str]
    done: asyncio.Future = field(repr=False)


class MicroBatcher:
    def __init__(self, slot: ModelSlot, max_batch_spans: int):
        self.slot = slot
        self.max_batch_spans = max_batch_spans
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._held: _Request | None = None  # taken from the queue but left for the next batch
        self._worker: asyncio.Task | None = None

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    async def diagnose(self, spans: pa.Table, window: bool) -> Diagnosis:
        """Queue one request's spans; raises what diagnosing them alone would raise."""
        trace_ids = frozenset(pc.unique(spans["trace_id"]).to_pylist())
        request = _Request(spans, window, trace_ids, asyncio.get_running_loop().create_future())
        await self._queue.put(request)
        return await request.done

    async def _run(self) -> None:
        while True:
            batch = await self._next_batch()
            live = [request for request in batch if not request.done.done()]  # drop those timed out
            if live:
                await self._diagnose(live)

    async def _next_batch(self) -> list[_Request]:
        first = self._held or await self._queue.get()
        self._held = None
        batch, spans, seen = [first], first.spans.num_rows, set(first.trace_ids)
        while not first.window and not self._queue.empty():
            request = self._queue.get_nowait()
            fits = spans + request.spans.num_rows <= self.max_batch_spans
            if request.window or not fits or not seen.isdisjoint(request.trace_ids):
                self._held = request
                break
            batch.append(request)
            spans += request.spans.num_rows
            seen |= request.trace_ids
        return batch

    async def _diagnose(self, batch: list[_Request]) -> None:
        if len(batch) == 1:
            await self._diagnose_alone(batch[0])
            return
        try:
            combined = await asyncio.to_thread(
                self.slot.diagnose, pa.concat_tables([request.spans for request in batch]), False)
        except Exception:  # noqa: BLE001 - one request's bad trace must not fail the others: retry each alone
            for request in batch:
                await self._diagnose_alone(request)
            return
        for request in batch:
            _settle(request, result=_part(combined, request.trace_ids))

    async def _diagnose_alone(self, request: _Request) -> None:
        try:
            result = await asyncio.to_thread(self.slot.diagnose, request.spans, request.window)
        except Exception as error:  # noqa: BLE001 - handed to the request's caller, which maps it to a status
            _settle(request, error=error)
            return
        _settle(request, result=result)


def _part(diagnosis: Diagnosis, trace_ids: frozenset[str]) -> Diagnosis:
    return diagnosis.model_copy(update={"traces": [t for t in diagnosis.traces if t.trace_id in trace_ids]})


def _settle(request: _Request, result: Diagnosis | None = None, error: Exception | None = None) -> None:
    if request.done.done():  # its caller gave up (timeout, disconnect)
        return
    if error is not None:
        request.done.set_exception(error)
    else:
        request.done.set_result(result)
