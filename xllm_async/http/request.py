"""Requests read off a connection's bytes: the httptools callbacks that collect them, and the
HTTP/1.1 framing rules and size limits they are checked against.

httptools (llhttp) is a tokenizer: it refuses bad syntax (bare CR, obs-fold, whitespace before a
colon, invalid or duplicate Content-Length, Content-Length with Transfer-Encoding, a non-final
chunked) but lets through what only the RFC's rules forbid. Those are checked here, in
on_headers_complete and in the branches for repeated fields, so a valid request pays a dict lookup
or two (tests/test_http_conformance.py lists every rule with its test).
"""

from __future__ import annotations

import re
import time

import httptools

from ..errors import ApiError
from .response import CONTINUE

MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
MAX_URL_BYTES = 16 * 1024  # a longer request-target gets 414 (RFC 9112 §3)
# Host = uri-host [ ":" port ] (RFC 9110 §7.2, RFC 3986 §3.2.2); empty is allowed (RFC 9112 §3.2).
HOST = re.compile(r"(?:\[[0-9A-Za-z:.]+\]|[0-9A-Za-z\-._~!$&'()*+,;=%]*)(?::[0-9]*)?")


class HttpRequest:
    """One whole request, as the handler gets it."""

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


class Refusal:
    """The answer to a request that could not be parsed, waiting its turn."""

    __slots__ = ("error", "head")

    def __init__(self, error: ApiError, head: bool) -> None:
        self.error = error
        self.head = head  # the request was a HEAD: the answer has no content


class StopParsing(Exception):
    """Raised by a callback: this connection's remaining input is not read."""


class RequestReader:
    """The parser's callback target: collects each request of a connection and checks its
    framing. Callbacks only collect and check; each whole request, or the Refusal of one that
    could not be read, goes to `_enqueue`.

    The connection (HttpProtocol, a subclass) provides `_enqueue(entry)`, `_set_deadline(kind,
    seconds)` and `_deadline_kind`, `_limits`, `_transport` and `_client`."""

    def __init__(self, max_body: int) -> None:
        self._max_body = max_body
        self._parser = httptools.HttpRequestParser(self)
        self._stop_reading = False  # after a parse error or an upgrade: read no more requests
        self._draining = False  # the server is shutting down: the next request read is the last
        self._url = b""
        self._headers: dict[str, str] = {}  # the request's header section
        self._fields = self._headers  # where the field lines being parsed go (trailers: elsewhere)
        self._http11 = True
        self._valid_host = ""  # the last Host value that passed the check
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

    def _fail(self, error: ApiError) -> None:
        """A request we cannot parse: answer it in its turn, then close."""
        self._stop_reading = True
        # An answer to HEAD has no content, even an error's (RFC 9110 §9.3.2): a client reading it
        # by its Content-Length would take the content for the next response. llhttp's method is
        # this request's once its target has begun (before that, it is the previous request's).
        head = self._receiving and bool(self._url) and self._parser.get_method() == b"HEAD"
        self._enqueue(Refusal(error, head))

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
            check_transfer_coding(coding, self._http11)
            self._fields = {}  # trailer fields are parsed, never merged into the headers (RFC 9110 §6.5.1)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            raise ApiError(413, f"Request body larger than {self._max_body} bytes")
        # An HTTP/1.0 client's 100-continue expectation is ignored (RFC 9110 §10.1.1).
        if self._http11 and "expect" in headers and headers["expect"].lower() == "100-continue":
            self._transport.write(CONTINUE)

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


def check_transfer_coding(coding: str, http11: bool) -> None:
    """Transfer-Encoding (with Content-Length, llhttp has refused it already): chunked alone, on
    HTTP/1.1 only."""
    if not http11:
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
