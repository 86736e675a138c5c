"""One asyncio.Protocol per connection; httptools calls back into it.

Callbacks only collect the request and hand it over. Requests pipelined on one
connection are answered one at a time, in order; reading pauses when too many
wait, and resumes as they are answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import httptools

from ..errors import ApiError
from .response import CONTINUE, JSON, Responder, render

log = logging.getLogger("xllm_async.http")

MAX_PIPELINED = 32  # unanswered requests per connection before we stop reading
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100


class HttpLimits:
    """Sizes and timeouts that protect the server from its clients."""

    __slots__ = ("max_body", "max_connections", "read_timeout", "keep_alive_timeout", "write_timeout")

    def __init__(self, max_body: int = 16 << 20, max_connections: int = 2048, read_timeout: float = 30.0,
                 keep_alive_timeout: float = 30.0, write_timeout: float = 30.0) -> None:
        self.max_body = max_body
        self.max_connections = max_connections
        self.read_timeout = read_timeout  # a request must arrive whole within this (slowloris)
        self.keep_alive_timeout = keep_alive_timeout  # an idle connection is closed after this
        self.write_timeout = write_timeout  # a client that stops reading a stream is dropped after this


class HttpRequest:
    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive", "http11", "received", "client")

    def __init__(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes,
                 keep_alive: bool, http11: bool, client: str = "") -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers  # lower-case names
        self.body = body
        self.keep_alive = keep_alive
        self.http11 = http11
        self.received = time.monotonic()  # the whole request is in: latencies count from here
        self.client = client


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]
# Told about every finished response (request is None for one we could not parse).
ResponseListener = Callable[["HttpRequest | None", Responder], None]


class HttpProtocol(asyncio.Protocol):
    """Parses requests off one connection and runs the handler for each in turn."""

    def __init__(self, handler: Handler, connections: set, limits: HttpLimits,
                 on_response: ResponseListener | None = None) -> None:
        self._handler = handler
        self._on_response = on_response
        self._request: HttpRequest | None = None
        self._connections = connections
        self._limits = limits
        self._max_body = limits.max_body
        # One deadline, checked by the server's once-a-second sweep instead of a timer per request.
        self._deadline = 0.0
        self._deadline_kind = ""
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._client = ""
        self._pipeline: deque = deque()  # HttpRequest or ApiError, waiting their turn
        self._current: Responder | None = None
        self._task: asyncio.Task | None = None
        self._reading_paused = False
        self._stop_reading = False  # after a parse error or an upgrade: read no more requests
        self.writing_paused = False
        self._writable: asyncio.Future | None = None
        self.closed = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0

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
        peer = transport.get_extra_info("peername")
        self._client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
        self._connections.add(self)
        self._set_deadline("idle", self._limits.keep_alive_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._deadline_kind = ""
        self._connections.discard(self)
        self._pipeline.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the handler's cleanup aborts its engine work
        self._wake_writer()

    def data_received(self, data: bytes) -> None:
        if self._stop_reading:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, ApiError) else ApiError(400, "Malformed HTTP request"))
        except httptools.HttpParserUpgrade:
            self._stop_reading = True  # we speak HTTP/1.1 only; answer what came, then close
        except httptools.HttpParserError as exc:
            self._fail(ApiError(400, f"Malformed HTTP request: {exc}"))

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

    # --- httptools callbacks: collect only ---

    def on_message_begin(self) -> None:
        self._set_deadline("read", self._limits.read_timeout)
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        if len(self._headers) >= MAX_HEADERS:
            raise ApiError(431, f"More than {MAX_HEADERS} header fields")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key == "content-length" and key in self._headers and self._headers[key] != text:
            raise ApiError(400, "Conflicting Content-Length headers")
        self._headers[key] = text

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            raise ApiError(413, f"Request body larger than {self._max_body} bytes")
        if self._headers.get("expect", "").lower() == "100-continue":
            self._transport.write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._max_body:
            raise ApiError(413, f"Request body larger than {self._max_body} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._deadline_kind = ""  # the handler owns the time from here
        parser = self._parser
        url = httptools.parse_url(self._url)
        request = HttpRequest(
            parser.get_method().decode("ascii"), url.path.decode("latin-1"),
            url.query.decode("latin-1") if url.query else "", self._headers, b"".join(self._body),
            parser.should_keep_alive(), parser.get_http_version() == "1.1", self._client,
        )
        self._enqueue(request)

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_HEADER_BYTES:
            raise ApiError(431, f"Request line and headers larger than {MAX_HEADER_BYTES} bytes")

    # --- answering, in order ---

    def _enqueue(self, entry) -> None:
        if self._current is None:
            self._start(entry)
            return
        self._pipeline.append(entry)
        if len(self._pipeline) >= MAX_PIPELINED and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()

    def _fail(self, error: ApiError) -> None:
        """A request we cannot parse: answer it in its turn, then close."""
        self._stop_reading = True
        self._enqueue(error)

    def _start(self, entry) -> None:
        if isinstance(entry, ApiError):
            self._request = None
            self._current = Responder(self, keep_alive=False, http11=True)
            self._current.send(entry.status, entry.body(), headers=entry.headers)
            return
        responder = Responder(self, entry.keep_alive and not self._stop_reading, entry.http11)
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
        if not responder.keep_alive:
            if self._stop_reading and self._transport.can_write_eof():
                self._linger()
            else:
                self.close()
            return
        if self._pipeline:
            self._start(self._pipeline.popleft())
        elif not self._deadline_kind:
            self._set_deadline("idle", self._limits.keep_alive_timeout)
        if self._reading_paused and len(self._pipeline) < MAX_PIPELINED // 2:
            self._reading_paused = False
            self._transport.resume_reading()

    @property
    def busy(self) -> bool:
        """A request is being answered or waits its turn on this connection."""
        return self._current is not None or bool(self._pipeline)

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
