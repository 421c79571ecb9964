"""uvicorn, configured against slow clients (`bmeg serve`).

uvicorn drops idle kept-alive connections (`timeout_keep_alive`) but gives a request that is
still arriving all the time it wants: 400 connections trickling a byte every 5 s were all held.
`DeadlineProtocol` (uvicorn's httptools protocol) gives each request `read_timeout_s` from its
first byte, or from the connection's start for a connection that sends nothing, until its
headers *and* body are in; a client slower than that is disconnected (the app sees the
disconnect). `limit_concurrency` answers 503 to connections beyond `max_connections`.
"""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bmeg.serving.settings import ServingSettings


class DeadlineProtocol(HttpToolsProtocol):
    read_timeout_s = 30.0  # set per server by `config`

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request within %g s", self.read_timeout_s)
            self.transport.close()


def config(app, host: str, port: int, settings: ServingSettings, **options) -> uvicorn.Config:
    """uvicorn's configuration for `app` with the settings' timeouts and connection limit."""
    protocol = type("Deadline", (DeadlineProtocol,), {"read_timeout_s": settings.request_read_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, timeout_keep_alive=int(settings.keep_alive_timeout_s),
                          limit_concurrency=settings.max_connections, **options)
