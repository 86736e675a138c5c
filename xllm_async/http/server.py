"""Listening socket: one HttpProtocol per accepted connection, and the
once-a-second tick that refreshes the Date header and enforces deadlines."""

from __future__ import annotations

import asyncio
import os
import socket
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
        self._draining = False
        self._adopting: list[asyncio.Task] = []  # connections accepted at the drain, being set up

    def _new_connection(self) -> HttpProtocol:
        conn = HttpProtocol(self.handler, self.connections, self.limits, self.on_response)
        if self._draining:
            conn.drain()
        return conn

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._new_connection, host, port, backlog=4096,
                                                reuse_address=True)
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
        """Stop listening, for a drain. Connections the kernel has completed but the loop has not
        accepted yet are accepted first: closing the listener would reset them, under requests
        their clients (a balancer) may have sent already."""
        self._draining = True
        for conn in self.connections:
            conn.drain()
        if self._server is None:
            return
        pending = [sock for listener in self._server.sockets for sock in _accept_waiting(listener)]
        self._server.close()
        loop = asyncio.get_running_loop()
        self._adopting = [loop.create_task(loop.connect_accepted_socket(self._new_connection, sock))
                          for sock in pending]

    @property
    def busy(self) -> bool:
        """Whether a drain must wait: a connection has a request in hand, or will have one soon."""
        return any(not t.done() for t in self._adopting) or any(c.drain_waits for c in self.connections)

    def close_all(self) -> None:
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        for conn in list(self.connections):
            conn.close()


def _accept_waiting(listener) -> list[socket.socket]:
    """Every connection waiting in a listening socket's accept queue, without blocking."""
    own = socket.socket(fileno=os.dup(listener.fileno()))  # a socket object of our own; the loop keeps its
    own.setblocking(False)
    accepted = []
    try:
        while True:
            sock, _ = own.accept()
            sock.setblocking(False)
            accepted.append(sock)
    except OSError:  # BlockingIOError: none left. Anything else: what is left is reset, as before
        pass
    finally:
        own.close()
    return accepted
