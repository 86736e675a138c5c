"""Response bytes: precomputed status lines and headers, the Date header
refreshed once a second, and the per-request Responder the handler writes to."""

from __future__ import annotations

import http
import time
from email.utils import formatdate

JSON = b"application/json"
SSE = b"text/event-stream"
TEXT = b"text/plain; version=0.0.4; charset=utf-8"

STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}
KEEP_ALIVE = b"connection: keep-alive\r\n"
CLOSE = b"connection: close\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class DateHeader:
    """`date: ...\\r\\n`, rebuilt once a second by the server's tick instead of per response."""

    value = b""

    @classmethod
    def refresh(cls) -> None:
        cls.value = b"date: " + formatdate(time.time(), usegmt=True).encode() + b"\r\n"


DateHeader.refresh()


def render(status: int, body: bytes, content_type: bytes, keep_alive: bool, headers: bytes = b"") -> bytes:
    """A whole response as one bytes object (one transport.write)."""
    return b"".join((
        STATUS_LINES[status], b"content-type: ", content_type, b"\r\ncontent-length: ",
        str(len(body)).encode(), b"\r\n", DateHeader.value, KEEP_ALIVE if keep_alive else CLOSE,
        headers, b"\r\n", body,
    ))


class Responder:
    """The one response to one request: either send() once, or start_stream(),
    write()... and end(). The connection decides what happens after it."""

    __slots__ = ("_conn", "keep_alive", "_chunked", "_head", "started", "finished", "status", "bytes_sent",
                 "headers", "record")

    def __init__(self, conn, keep_alive: bool, http11: bool) -> None:
        self._conn = conn
        self.keep_alive = keep_alive
        self._chunked = http11  # HTTP/1.0 has no chunked encoding: stream until close
        self._head = b""  # stream headers, sent with the first data to save a write
        self.started = False
        self.finished = False
        self.status = 0
        self.bytes_sent = 0
        self.headers = b""  # header lines the handler wants on whatever response goes out
        self.record = None  # what the handler notes for the access log

    def send(self, status: int, body: bytes, content_type: bytes = JSON, headers: bytes = b"") -> None:
        self.status = status
        self.started = True
        self._finish(render(status, body, content_type, self.keep_alive, self.headers + headers))

    def start_stream(self, status: int = 200, content_type: bytes = SSE, headers: bytes = b"") -> None:
        if not self._chunked:
            self.keep_alive = False
        self.status = status
        self.started = True
        self._head = b"".join((
            STATUS_LINES[status], b"content-type: ", content_type, b"\r\ncache-control: no-cache\r\n",
            b"transfer-encoding: chunked\r\n" if self._chunked else b"", DateHeader.value,
            KEEP_ALIVE if self.keep_alive else CLOSE, self.headers, headers, b"\r\n",
        ))

    def write(self, data: bytes) -> None:
        if data:
            self._write(self._frame(data))

    def end(self, data: bytes = b"") -> None:
        """The last data and the end of the stream, in one write."""
        last = self._frame(data) if data else b""
        self._finish(last + b"0\r\n\r\n" if self._chunked else last)

    async def drain(self) -> None:
        """Wait until the client has read enough; free when it keeps up."""
        if self._conn.writing_paused:
            await self._conn.wait_writable()

    def _frame(self, data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data

    def _write(self, data: bytes) -> None:
        if self._head:
            data, self._head = self._head + data, b""
        self.bytes_sent += len(data)
        self._conn.write(data)

    def _finish(self, data: bytes) -> None:
        if self.finished:
            return
        self._write(data)
        self.finished = True
        self._conn.response_done(self)


class HeadResponder(Responder):
    """The answer to a HEAD request: the header section GET's would have, and no content,
    which would otherwise be read as the start of the next response (RFC 9110 §9.3.2)."""

    __slots__ = ()

    def send(self, status: int, body: bytes, content_type: bytes = JSON, headers: bytes = b"") -> None:
        self.status = status
        self.started = True
        whole = render(status, body, content_type, self.keep_alive, self.headers + headers)
        self._finish(whole[:len(whole) - len(body)])

    def _frame(self, data: bytes) -> bytes:
        return b""  # a stream's content is left out too

    def end(self, data: bytes = b"") -> None:
        self._finish(b"")
