"""Listening socket: one HttpProtocol per accepted connection, and the
once-a-second tick that refreshes the Date header and enforces deadlines."""

from __future__ import annotations

import asyncio
import time

from .protocol import Handler, HttpLimits, HttpProtocol, ResponseListener
from .response import DateHeader


class HttpServer:
    def __init__(self, handler: Handler, limits: HttpLimits, on_response: ResponseListener | None = None) -> None:
        self.handler = handler
        self.limits = limits
        self.on_response = on_response
        self.connections: set[HttpProtocol] = set()
        self._server: asyncio.AbstractServer | None = None
        self._tick_handle: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpProtocol(self.handler, self.connections, self.limits, self.on_response),
            host, port, backlog=4096, reuse_address=True,
        )
        self._tick()

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    def _tick(self) -> None:
        DateHeader.refresh()
        now = time.monotonic()
        for conn in list(self.connections):
            conn.check_deadline(now)
        self._tick_handle = asyncio.get_running_loop().call_later(1.0, self._tick)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in self.connections:
            conn.drain()

    @property
    def busy(self) -> bool:
        """Whether a drain must wait: a connection has a request in hand, or will have one soon."""
        return any(c.drain_waits for c in self.connections)

    def close_all(self) -> None:
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        for conn in list(self.connections):
            conn.close()
