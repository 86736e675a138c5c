"""One asyncio.Protocol per connection: its life (accepted, half-closed, lost), its deadlines,
and its answers, one at a time and in order.

Reading requests off the bytes is RequestReader's (request.py), which this class extends: the
parser calls back into the same object, with no layer between. Requests pipelined on one
connection are answered one at a time, in order; reading pauses when too many wait, and resumes
as they are answered.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable

from ..errors import ApiError
from .request import HttpRequest, Refusal, RequestReader
from .response import CONTINUE, JSON, HeadResponder, Responder, render

log = logging.getLogger("xllm_async.http")

MAX_PIPELINED = 32  # unanswered requests per connection before we stop reading
# A connection accepted this recently without a request yet is about to send one (a balancer opens
# a connection to send a request): a drain waits for it rather than close it under that request.
FIRST_REQUEST_GRACE = 2.0


class HttpLimits:
    """Sizes and timeouts that protect the server from its clients."""

    __slots__ = ("max_body", "max_connections", "read_timeout", "keep_alive_timeout", "write_timeout", "send_buffer")

    def __init__(self, max_body: int = 16 << 20, max_connections: int = 2048, read_timeout: float = 30.0,
                 keep_alive_timeout: float = 30.0, write_timeout: float = 30.0, send_buffer: int = 0) -> None:
        self.max_body = max_body
        self.max_connections = max_connections
        self.read_timeout = read_timeout  # a request must arrive whole within this (slowloris)
        self.keep_alive_timeout = keep_alive_timeout  # an idle connection is closed after this
        self.write_timeout = write_timeout  # a client that stops reading a stream is dropped after this
        self.send_buffer = send_buffer  # SO_SNDBUF of each connection; 0: the kernel sizes it


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]
# Told about every finished response (request is None for one we could not parse).
ResponseListener = Callable[["HttpRequest | None", Responder], None]


class HttpProtocol(RequestReader, asyncio.Protocol):
    """One connection: reads its requests (RequestReader) and runs the handler for each in turn."""

    def __init__(self, handler: Handler, connections: set, limits: HttpLimits,
                 on_response: ResponseListener | None = None) -> None:
        RequestReader.__init__(self, limits.max_body)
        self._handler = handler
        self._on_response = on_response
        self._connections = connections
        self._limits = limits
        # One deadline, checked by the server's once-a-second sweep instead of a timer per request.
        self._deadline = 0.0
        self._deadline_kind = ""
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._client = ""
        self._pipeline: deque = deque()  # HttpRequest or Refusal, waiting their turn
        self._current: Responder | None = None
        self._request: HttpRequest | None = None
        self._task: asyncio.Task | None = None
        self._reading_paused = False
        self.writing_paused = False
        self._writable: asyncio.Future | None = None
        self.closed = False
        self._peer_done = False  # the client shut its sending side: it sends no more requests
        self._accepted_at = 0.0

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        if len(self._connections) >= self._limits.max_connections:
            # Refuse cleanly and cheaply rather than let connections starve the loop.
            error = ApiError(503, "Too many open connections; retry later")
            transport.write(render(503, error.body(), JSON, False, b"retry-after: 1\r\n"))
            # Like _linger: end our side, ignore the request, close shortly (not tracked by the sweep).
            self._stop_reading = self.closed = True
            transport.write_eof()
            self._loop.call_later(1.0, transport.abort)
            return
        if self._limits.send_buffer:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._limits.send_buffer)
        peer = transport.get_extra_info("peername")
        self._client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
        self._connections.add(self)
        self._accepted_at = self._loop.time()
        self._set_deadline("idle", self._limits.keep_alive_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._deadline_kind = ""
        self._connections.discard(self)
        self._pipeline.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the handler's cleanup aborts its engine work
        self._wake_writer()

    def eof_received(self) -> bool:
        """The client shut its sending side. One that half-closed (shutdown(SHUT_WR), nc -N) still
        reads, and what it asked for is answered in full; then the connection closes. One that
        closed (an SDK's timeout) is gone, and its generation must not run on for nobody. Both
        send the same FIN: only a write tells them apart, so _probe writes one."""
        self._peer_done = True
        if self._receiving and not self._stop_reading:  # cut short: it can never complete
            self._receiving = False
            self._deadline_kind = ""
            self._fail(ApiError(400, "The client shut its side of the connection before the request was complete"))
        if not self.busy:
            self.close()  # nothing to answer
        else:
            self._probe()
        return True  # keep the transport open for writing

    def _probe(self) -> None:
        """While a half-closed client's answer has not begun, an interim 100 Continue, which every
        HTTP/1.1 client skips (RFC 9110 §15.2), at once and then each sweep. A client that closed
        answers it with a reset, and the next write fails: connection_lost, and the handler's
        cancellation aborts its engine work, within about a second."""
        current = self._current
        if current is not None and current.bytes_sent == 0 and self._request is not None and self._request.http11:
            self._transport.write(CONTINUE)  # (no 1xx to an HTTP/1.0 client: RFC 9110 §15.2)

    def pause_writing(self) -> None:
        self.writing_paused = True
        self._set_deadline("write", self._limits.write_timeout)

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._deadline_kind = ""
        self._wake_writer()

    # --- deadlines ---

    def _set_deadline(self, kind: str, seconds: float) -> None:
        self._deadline_kind = kind
        self._deadline = time.monotonic() + seconds

    def check_deadline(self, now: float) -> None:
        """Called once a second by the server: act on an expired deadline."""
        if self._peer_done and not self.closed:
            self._probe()
        if not self._deadline_kind or now < self._deadline or self.closed:
            return
        kind, self._deadline_kind = self._deadline_kind, ""
        if kind == "read":
            self._fail(ApiError(408, f"Request not received within {self._limits.read_timeout} s"))
        elif kind == "write":  # the client stopped reading: drop what is buffered, close() would wait for it
            self.closed = True
            self._transport.abort()
        else:  # an idle keep-alive connection
            self.close()

    # --- answering, in order ---

    def _enqueue(self, entry) -> None:
        if self._current is None:
            self._start(entry)
            return
        self._pipeline.append(entry)
        if len(self._pipeline) >= MAX_PIPELINED and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()

    def _start(self, entry) -> None:
        if isinstance(entry, Refusal):
            error = entry.error
            self._request = None
            self._current = (HeadResponder if entry.head else Responder)(self, keep_alive=False, http11=True)
            self._current.send(error.status, error.body(), headers=error.headers)
            return
        last = self._stop_reading and not self._pipeline  # reading stopped, nothing after it
        responder = (Responder if entry.method != "HEAD" else HeadResponder)(
            self, entry.keep_alive and not last, entry.http11)
        self._request = entry
        self._current = responder
        self._task = self._loop.create_task(self._handler(entry, responder))
        self._task.add_done_callback(lambda task: self._check_answered(task, responder))

    def _check_answered(self, task: asyncio.Task, responder: Responder) -> None:
        # The last guard of "every request gets exactly one answer".
        if task.cancelled() or responder.finished or self.closed:
            return
        exc = task.exception()
        log.error("handler ended without a response", exc_info=exc)
        if responder.started:
            self.close()
        else:
            error = ApiError(500, "Internal server error")
            responder.send(500, error.body())

    def response_done(self, responder: Responder) -> None:
        if self._on_response is not None:
            self._on_response(self._request, responder)
        self._current = None
        self._request = None
        self._task = None
        if self._pipeline and responder.keep_alive:
            self._start(self._pipeline.popleft())
        elif not responder.keep_alive or self._stop_reading or self._peer_done:
            # The last answer: no other request was or will be read on this connection.
            if self._stop_reading and not self._peer_done and self._transport.can_write_eof():
                self._linger()
            else:
                self.close()
            return
        elif not self._deadline_kind:
            self._set_deadline("idle", self._limits.keep_alive_timeout)
        if self._reading_paused and len(self._pipeline) < MAX_PIPELINED // 2:
            self._reading_paused = False
            self._transport.resume_reading()

    def drain(self) -> None:
        """The server stopped accepting connections and is shutting down. A request that reached
        this connection is still answered (a balancer may have sent it a moment before its health
        check saw the drain), with Connection: close; no request after it is read."""
        self._draining = True

    @property
    def busy(self) -> bool:
        """A request is being answered or waits its turn on this connection."""
        return self._current is not None or bool(self._pipeline)

    @property
    def drain_waits(self) -> bool:
        """A drain must not close this connection yet: a request is being answered, waits, is
        being received, or is about to come on a connection just accepted."""
        if self.closed:
            return False
        if self.busy or (self._receiving and not self._stop_reading):
            return True
        return self._requests == 0 and self._loop.time() - self._accepted_at < FIRST_REQUEST_GRACE

    # --- used by Responder ---

    def write(self, data: bytes) -> None:
        if not self.closed:
            self._transport.write(data)

    async def wait_writable(self) -> None:
        if self.closed:
            raise ConnectionResetError("client disconnected")
        self._writable = self._loop.create_future()
        await self._writable

    def _wake_writer(self) -> None:
        if self._writable is not None and not self._writable.done():
            if self.closed:
                self._writable.set_exception(ConnectionResetError("client disconnected"))
            else:
                self._writable.set_result(None)
        self._writable = None

    def _linger(self) -> None:
        """Close after an error while the client may still be sending: closing
        with unread input would send a reset that can destroy our answer, so
        end our side, discard what still comes, and close soon after."""
        self._transport.write_eof()
        self._set_deadline("idle", 2.0)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._transport.close()

