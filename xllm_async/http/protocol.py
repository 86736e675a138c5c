"""One asyncio.Protocol per connection; httptools calls back into it.

Callbacks only collect the request and hand it over. Requests pipelined on one
connection are answered one at a time, in order; reading pauses when too many
wait, and resumes as they are answered.

httptools (llhttp) is a tokenizer: it refuses bad syntax (bare CR, obs-fold,
whitespace before a colon, invalid or duplicate Content-Length, Content-Length
with Transfer-Encoding, a non-final chunked) but lets through what only the
RFC's rules forbid. Those are checked here, in on_headers_complete and in the
branches for repeated fields, so a valid request pays a dict lookup or two
(tests/test_http_conformance.py lists every rule with its test).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable

import httptools

from ..errors import ApiError
from .response import CONTINUE, JSON, HeadResponder, Responder, render

log = logging.getLogger("xllm_async.http")

MAX_PIPELINED = 32  # unanswered requests per connection before we stop reading
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
# A connection accepted this recently without a request yet is about to send one (a balancer opens
# a connection to send a request): a drain waits for it rather than close it under that request.
FIRST_REQUEST_GRACE = 2.0
MAX_URL_BYTES = 16 * 1024  # a longer request-target gets 414 (RFC 9112 §3)
# Host = uri-host [ ":" port ] (RFC 9110 §7.2, RFC 3986 §3.2.2); empty is allowed (RFC 9112 §3.2).
HOST = re.compile(r"(?:\[[0-9A-Za-z:.]+\]|[0-9A-Za-z\-._~!$&'()*+,;=%]*)(?::[0-9]*)?")


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
        self._pipeline: deque = deque()  # HttpRequest or Refusal, waiting their turn
        self._current: Responder | None = None
        self._task: asyncio.Task | None = None
        self._reading_paused = False
        self._stop_reading = False  # after a parse error or an upgrade: read no more requests
        self.writing_paused = False
        self._writable: asyncio.Future | None = None
        self.closed = False
        self._url = b""
        self._headers: dict[str, str] = {}  # the request's header section
        self._fields = self._headers  # where the field lines being parsed go (trailers: elsewhere)
        self._http11 = True
        self._peer_done = False  # the client shut its sending side: it sends no more requests
        self._draining = False  # the server is shutting down: the next request read is the last
        self._valid_host = ""  # the last Host value that passed the check
        self._accepted_at = 0.0
        self._receiving = False  # a request has begun and is not complete yet
        self._requests = 0  # requests begun on this connection
        self._header_bytes = 0  # a request's field lines, counted as llhttp completes them
        # Field sections (a head, a chunked body's trailers) counted as their bytes arrive: llhttp
        # hands over a field line only once it ends, and httptools grows the line's value piece by
        # piece until then (a value streamed in pieces would cost quadratic time, and memory, until
        # the read timeout). _section numbers the sections, so a read is counted only when the
        # parser was inside one section from its start to its end.
        self._in_fields = False
        self._section = 0
        self._field_bytes = 0
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

    def data_received(self, data: bytes) -> None:
        if self._stop_reading:
            return
        section, within, idle = self._section, self._in_fields, not self._receiving
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, StopParsing):
                return
            self._fail(cause if isinstance(cause, ApiError) else ApiError(400, "Malformed HTTP request"))
            return
        except httptools.HttpParserUpgrade:
            self._stop_reading = True  # we speak HTTP/1.1 only; answer what came, then close
            return
        except httptools.HttpParserError as exc:
            self._fail(parse_error(exc))
            return
        if self._in_fields:  # a field section is still open after this read
            self._count_field_bytes(data, section, within, idle)

    def _count_field_bytes(self, data: bytes, section: int, within: bool, idle: bool) -> None:
        if within and self._section == section:
            size = len(data)  # the whole read belongs to the section that was open
        elif idle and self._section == section + 1:
            size = len(data.lstrip(b"\r\n"))  # a request began in it: all its head (llhttp skips empty lines)
        else:
            # The section began after other content of this read, at an offset llhttp does not
            # tell: counted from the next read on (this one is at most the transport's read size).
            return
        self._field_bytes += size
        if self._field_bytes > MAX_HEADER_BYTES:
            self._in_fields = False
            self._fail(ApiError(431, f"Request line and headers larger than {MAX_HEADER_BYTES} bytes"))

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

    # --- httptools callbacks: collect only ---

    def on_message_begin(self) -> None:
        if self._stop_reading:
            raise StopParsing  # after a request that closes the connection, none is processed (RFC 9112 §9.6)
        self._set_deadline("read", self._limits.read_timeout)
        self._receiving = True
        self._requests += 1
        self._url = b""
        self._headers = self._fields = {}
        self._header_bytes = 0
        self._field_bytes = 0
        self._in_fields = True
        self._section += 1
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL_BYTES:
            raise ApiError(414, f"Request target longer than {MAX_URL_BYTES} bytes")
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        fields = self._fields
        if len(fields) >= MAX_HEADERS:
            raise ApiError(431, f"More than {MAX_HEADERS} header fields")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key in fields:
            text = repeated_field(key, fields[key], text)
        fields[key] = text

    def on_headers_complete(self) -> None:
        self._in_fields = False
        headers = self._headers
        version = self._parser.get_http_version()
        if version == "1.1":
            self._http11 = True
            if "host" not in headers:
                raise ApiError(400, "HTTP/1.1 request without a Host header")
        elif version == "1.0":
            self._http11 = False
        elif version[0] == "0":  # llhttp reads a request line without a version as HTTP/0.9
            raise ApiError(400, "Not an HTTP/1.x request line")
        else:
            raise ApiError(505, f"HTTP/{version} is not supported; use HTTP/1.1")
        host = headers.get("host")
        if host is not None and host != self._valid_host:  # a connection's requests repeat their Host
            if HOST.fullmatch(host) is None:
                raise ApiError(400, "Invalid Host header")
            self._valid_host = host
        coding = headers.get("transfer-encoding")
        if coding is not None:
            self._check_transfer_coding(coding)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            raise ApiError(413, f"Request body larger than {self._max_body} bytes")
        # An HTTP/1.0 client's 100-continue expectation is ignored (RFC 9110 §10.1.1).
        if self._http11 and "expect" in headers and headers["expect"].lower() == "100-continue":
            self._transport.write(CONTINUE)

    def _check_transfer_coding(self, coding: str) -> None:
        """Transfer-Encoding (with Content-Length, llhttp has refused it already): chunked alone,
        on HTTP/1.1 only."""
        if not self._http11:
            # RFC 9112 §6.1: faulty framing in an HTTP/1.0 message; the connection cannot go on.
            raise ApiError(400, "Transfer-Encoding in an HTTP/1.0 request")
        # Empty list elements are ignored (RFC 9110 §5.6.1): ", chunked" is chunked.
        codings = [c.strip() for c in coding.lower().split(",") if c.strip()]
        if not codings or codings[-1] != "chunked":
            # RFC 9112 §6.3: the body's length cannot be known (llhttp lets some of these through).
            raise ApiError(400, f"Transfer-Encoding {coding!r} does not end with chunked")
        if len(codings) > 1:
            # RFC 9112 §6.1: a coding the server does not understand.
            raise ApiError(501, f"Transfer-Encoding {coding!r} is not supported; send chunked alone")
        self._fields = {}  # trailer fields are parsed, never merged into the headers (RFC 9110 §6.5.1)

    def on_chunk_header(self) -> None:
        # A chunk's data follows, or (after the last chunk) the trailer section: a data chunk's
        # on_body ends the section at once, trailers keep it open until the message completes.
        self._in_fields = True
        self._section += 1

    def on_chunk_complete(self) -> None:
        self._in_fields = False

    def on_body(self, body: bytes) -> None:
        self._in_fields = False
        self._body_size += len(body)
        if self._body_size > self._max_body:
            raise ApiError(413, f"Request body larger than {self._max_body} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_fields = False
        self._deadline_kind = ""  # the handler owns the time from here
        self._receiving = False
        parser = self._parser
        url = httptools.parse_url(self._url)
        keep_alive = parser.should_keep_alive()
        request = HttpRequest(
            parser.get_method().decode("ascii"), url.path.decode("latin-1"),
            url.query.decode("latin-1") if url.query else "", self._headers, b"".join(self._body),
            keep_alive, self._http11, self._client,
        )
        if not keep_alive or self._draining:
            self._stop_reading = True  # the last request of this connection
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
        # An answer to HEAD has no content, even an error's (RFC 9110 §9.3.2): a client reading it
        # by its Content-Length would take the content for the next response. (llhttp reports
        # the method once its token is read; before that, it says none is HEAD.)
        self._enqueue(Refusal(error, self._receiving and self._parser.get_method() == b"HEAD"))

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


class Refusal:
    """The answer to a request that could not be parsed, waiting its turn."""

    __slots__ = ("error", "head")

    def __init__(self, error: ApiError, head: bool) -> None:
        self.error = error
        self.head = head  # the request was a HEAD: the answer has no content


class StopParsing(Exception):
    """Raised by a callback: this connection's remaining input is not read."""


def repeated_field(name: str, first: str, value: str) -> str:
    """A field line whose name came before: combined as a list (RFC 9110 §5.3), except where
    one value is all a request may carry."""
    if name == "host":
        raise ApiError(400, "More than one Host header")  # RFC 9112 §3.2
    if name == "content-length":  # llhttp refuses these first; kept for any parser that does not
        raise ApiError(400, "More than one Content-Length header")
    return f"{first}, {value}"


def parse_error(exc: httptools.HttpParserError) -> ApiError:
    """The answer to what llhttp refused (the connection closes after it)."""
    reason = str(exc)
    if reason == "Invalid HTTP version":  # well formed, but neither 1.0 nor 1.1 (nor 0.9, 2.0: see above)
        return ApiError(505, "HTTP version not supported; use HTTP/1.1")
    if reason == "Unexpected whitespace after header value":
        reason = "obsolete line folding (obs-fold) is not accepted"  # RFC 9112 §5.2 asks to say so
    return ApiError(400, f"Malformed HTTP request: {reason}")
