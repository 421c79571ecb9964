"""Micro-batching: requests that arrive while the model is busy are diagnosed in one call.

A detector call has a fixed cost (graph assembly, two GNN passes, the SVM) that dwarfs the
per-trace cost, and the model runs one call at a time. So one worker takes every request
queued and hands their bodies to the model side together (`bmeg.serving.payloads`), which
parses them, diagnoses them in as few calls as it may and answers each request alone.
Under load, model calls start at most every `min_interval_s` (the worker lingers to let a
batch fill, like Triton's queue delay); an idle server diagnoses a lone request at once,
because the previous call started long ago. A request asking for a window ranking (which is
over its own traces only) is never batched with others.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from bmeg.serving.model import ModelSlot
from bmeg.serving.payloads import Answer, Limits, Parts, Payload


@dataclass
class _Request:
    payload: Payload
    window: bool
    done: asyncio.Future = field(repr=False)


class MicroBatcher:
    def __init__(self, slot: ModelSlot, limits: Limits, max_batch_bytes: int, min_interval_s: float = 0.0):
        self.slot = slot
        self.limits = limits
        self.max_batch_bytes = max_batch_bytes
        self.min_interval_s = min_interval_s
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._held: _Request | None = None  # taken from the queue but left for the next batch
        self._last_call = float("-inf")  # loop time the latest model call started
        self._worker: asyncio.Task | None = None

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    async def diagnose(self, payload: Payload, window: bool) -> Answer | Parts:
        """Queue one request's body; its answer (or, for a large one, its `Parts` to queue again);
        raises what the model side answered for it (mostly `RequestRefused`)."""
        request = _Request(payload, window, asyncio.get_running_loop().create_future())
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
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self._last_call + self.min_interval_s - loop.time())  # no wait when idle
        self._last_call = loop.time()
        batch, size = [first], len(first.payload.body)
        while not first.window and not self._queue.empty():
            request = self._queue.get_nowait()
            if request.window or size + len(request.payload.body) > self.max_batch_bytes:
                self._held = request
                break
            batch.append(request)
            size += len(request.payload.body)
        return batch

    async def _diagnose(self, batch: list[_Request]) -> None:
        payloads = [request.payload for request in batch]
        try:
            answers = await asyncio.to_thread(self.slot.diagnose_payloads, payloads, batch[0].window, self.limits)
        except Exception as error:  # noqa: BLE001 - no model, or its process died: every request hears why
            answers = [error] * len(batch)
        for request, answer in zip(batch, answers, strict=True):
            _settle(request, answer)


def _settle(request: _Request, answer: Answer | Parts | Exception) -> None:
    if request.done.done():  # its caller gave up (timeout, disconnect)
        return
    if isinstance(answer, Exception):
        request.done.set_exception(answer)
    else:
        request.done.set_result(answer)
