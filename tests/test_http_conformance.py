# ruff: noqa: E501  (the table of rules below is one row a line)
"""Request framing as RFC 9112 (HTTP/1.1) and RFC 9110 (semantics) require of a server,
over raw sockets against a real server. httptools (llhttp) refuses bad syntax itself;
xllm_async/http/protocol.py checks the rest in its callbacks.

| rule (server side) | where | behaviour | test |
|---|---|---|---|
| a request-line that is not HTTP/1.x grammar | 9112 §3 (SHOULD 400) | 400, close | test_a_request_line_that_is_not_http_1_gets_400_and_a_close |
| an HTTP version we do not support | 9110 §15.6.6, 9112 §2.3 | 505, close (1.2-1.9 too: llhttp cannot read them as 1.1) | test_an_unsupported_version_gets_505_and_a_close |
| HTTP/1.1 without Host | 9112 §3.2 MUST | 400 | test_http11_without_host_gets_400 |
| more than one Host | 9112 §3.2 MUST | 400 | test_two_host_headers_get_400 |
| a Host with an invalid value | 9112 §3.2 MUST | 400 | test_an_invalid_host_gets_400 |
| HTTP/1.0 needs no Host | 9112 §3.2 | served | test_http10_without_host_is_served |
| absolute-form request-target | 9112 §3.2.2 MUST accept | served | test_an_absolute_form_target_is_accepted |
| request-target longer than we parse | 9112 §3 MUST | 414, close | test_a_request_target_too_long_gets_414 |
| whitespace between field name and colon | 9112 §5.1 MUST | 400, close | test_malformed_framing_gets_400_and_a_close[space-before-colon] |
| obs-fold (header line folding) | 9112 §5.2 MUST (reject or replace) | 400 saying so, close | test_obs_fold_gets_400_saying_so |
| bare CR | 9112 §2.2 MUST (invalid or SP) | 400, close | test_malformed_framing_gets_400_and_a_close[bare-cr-*] |
| whitespace between start-line and first field | 9112 §2.2 MUST (reject or skip) | 400, close | test_malformed_framing_gets_400_and_a_close[space-after-start-line] |
| Content-Length with Transfer-Encoding | 9112 §6.3 MUST close (MAY reject) | 400, close | test_malformed_framing_gets_400_and_a_close[cl-and-te*] |
| invalid Content-Length, duplicates, lists | 9112 §6.3 MUST, 9110 §8.6 | 400, close | test_malformed_framing_gets_400_and_a_close[cl-*] |
| Transfer-Encoding whose last coding is not chunked | 9112 §6.3 MUST | 400, close | test_malformed_framing_gets_400_and_a_close[te-*] |
| empty elements in the Transfer-Encoding list | 9110 §5.6.1 MUST ignore | before chunked: served; after it: 400 from llhttp, close (never read as another framing) | test_empty_transfer_coding_elements_are_ignored |
| a transfer coding we do not implement before chunked | 9112 §6.1 (SHOULD 501) | 501, close | test_an_unknown_transfer_coding_gets_501_and_a_close |
| Transfer-Encoding in an HTTP/1.0 request | 9112 §6.1 MUST (faulty framing, close) | 400, close | test_transfer_encoding_on_http10_is_faulty_framing |
| chunk extensions | 9112 §7.1.1 MUST ignore | served | test_chunk_extensions_are_ignored |
| trailer fields | 9110 §6.5.1 MUST NOT merge into headers | ignored | test_trailer_fields_are_not_merged_into_the_headers |
| "close" connection option | 9112 §9.6 MUST close, MUST NOT process later requests | answered, then closed | test_no_request_after_connection_close_is_processed |
| pipelined responses in order | 9112 §9.3.2 MUST | in order | test_http.py::test_pipelined_requests_answer_in_order |
| 100-continue in HTTP/1.0 | 9110 §10.1.1 MUST ignore | no 100 | test_http10_expect_100_continue_is_ignored |
| GET and HEAD supported; no content in a HEAD answer | 9110 §9.1, §9.3.2 MUST | headers only, an error's too | test_head_gets_the_headers_and_no_content, test_a_refused_head_gets_headers_only |
| Date on every answer | 9110 §6.6.1 MUST | date header | test_every_answer_carries_a_date |
| no Transfer-Encoding to an HTTP/1.0 client | 9112 §6.1 MUST NOT | close-delimited stream | test_a_stream_to_http10_is_close_delimited |
| a request cut short by the client's FIN | 9112 §8 (incomplete message) | 400, close | test_a_request_cut_short_by_a_half_close_gets_400 |
| a client that half-closes still reads | 9112 §9.6 | whole answer (after 100 Continue probes), then close | test_a_half_closed_client_gets_the_whole_answer |
| unsolicited 1xx before the final answer | 9110 §15.2 MUST parse; none to HTTP/1.0 | 100 Continue probes a FIN'd client | test_robustness.py::test_a_client_that_closes_before_its_answer_has_its_generation_aborted |
| empty lines before a request-line | 9112 §2.2 SHOULD ignore | ignored | test_robustness.py::test_newline_flood_does_not_hurt |
| a body over the limit | 9110 §15.5.14 | 413 | test_http.py::test_body_over_the_limit_413 |
| an unknown method | 9110 §9.1 (SHOULD 501) | 400 from llhttp; a known one on a wrong route 405 | test_http.py::test_unknown_path_404_and_wrong_method_405 |
"""

from __future__ import annotations

import socket

import orjson
import pytest

from .client import split_responses

COMPLETION = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})


def exchange(port: int, data: bytes, half_close: bool = False) -> bytes:
    """Send raw bytes and read until the server closes; fails if it does not within 10 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):  # a TimeoutError here: the server kept the connection open
            chunks.append(chunk)
    return b"".join(chunks)


def answer_then_close(port: int, data: bytes, expected: int) -> bytes:
    """The one answer to data, with the expected status and an error body; the server then closes."""
    (status, body), = split_responses(exchange(port, data))
    assert status == expected, body
    if expected >= 400:
        error = orjson.loads(body)["error"]
        assert error["code"] == expected and error["message"]
    return body


def post(body: bytes = COMPLETION, extra: bytes = b"", version: bytes = b"1.1", host: bytes = b"host: x\r\n") -> bytes:
    return (b"POST /v1/completions HTTP/" + version + b"\r\n" + host + extra
            + b"content-length: %d\r\n\r\n" % len(body) + body)


def chunked(body: bytes, version: bytes = b"1.1", coding: bytes = b"chunked", trailer: bytes = b"",
            extension: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/" + version + b"\r\nhost: x\r\ntransfer-encoding: " + coding
            + b"\r\nconnection: close\r\n\r\n" + b"%x%b\r\n%b\r\n0\r\n%b\r\n" % (len(body), extension, body, trailer))


# --- the request line ---

@pytest.mark.parametrize("line", [b"GET /health\r\n\r\n", b"GET /health http/1.1\r\nhost: x\r\n\r\n",
                                  b"GET /health FOO/1.1\r\nhost: x\r\n\r\n", b"GET /health HTTP/1\r\nhost: x\r\n\r\n",
                                  b"GET /health HTTP/1.x\r\nhost: x\r\n\r\n", b"GET /health HTTP/10.0\r\n\r\n",
                                  b"GET /a b HTTP/1.1\r\nhost: x\r\n\r\n"],
                         ids=["no-version", "lower-case", "not-http", "no-minor", "letter", "two-digits", "space"])
def test_a_request_line_that_is_not_http_1_gets_400_and_a_close(server, line):
    answer_then_close(server.port, line + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", 400)


@pytest.mark.parametrize("version", [b"2.0", b"3.0", b"9.9", b"1.2", b"0.1"])
def test_an_unsupported_version_gets_505_and_a_close(server, version):
    data = b"GET /health HTTP/" + version + b"\r\nhost: x\r\n\r\nGET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    answer_then_close(server.port, data, 505)


def test_a_request_target_too_long_gets_414(server):
    answer_then_close(server.port, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nhost: x\r\n\r\n", 414)


def test_an_absolute_form_target_is_accepted(server):
    data = b"GET http://x/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    (status, _), = split_responses(exchange(server.port, data))
    assert status == 200


# --- Host ---

def test_http11_without_host_gets_400(server):
    body = answer_then_close(server.port, b"GET /health HTTP/1.1\r\n\r\n", 400)
    assert b"Host" in body


def test_two_host_headers_get_400(server):
    answer_then_close(server.port, b"GET /health HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", 400)
    answer_then_close(server.port, b"GET /health HTTP/1.0\r\nhost: x\r\nhost: x\r\n\r\n", 400)


@pytest.mark.parametrize("host", [b"a b", b"x/y", b"user@x", b"x:8o", b"[::1"])
def test_an_invalid_host_gets_400(server, host):
    answer_then_close(server.port, b"GET /health HTTP/1.1\r\nhost: " + host + b"\r\n\r\n", 400)


@pytest.mark.parametrize("host", [b"", b"127.0.0.1:8000", b"[::1]:80", b"my-host.example", b"xn--bcher-kva.de"])
def test_valid_hosts_are_served(server, host):
    data = b"GET /health HTTP/1.1\r\nhost: " + host + b"\r\nconnection: close\r\n\r\n"
    assert split_responses(exchange(server.port, data))[0][0] == 200


def test_http10_without_host_is_served(server):
    assert split_responses(exchange(server.port, b"GET /health HTTP/1.0\r\n\r\n"))[0][0] == 200


# --- field lines and framing that llhttp refuses ---

MALFORMED = {
    "space-before-colon": b"GET /health HTTP/1.1\r\nhost : x\r\n\r\n",
    "space-after-start-line": b"GET /health HTTP/1.1\r\n x: y\r\nhost: x\r\n\r\n",
    "bare-cr-in-value": b"GET /health HTTP/1.1\r\nhost: x\r\nx-a: 1\r2\r\n\r\n",
    "bare-cr-after-line": b"GET /health HTTP/1.1\rhost: x\r\n\r\n",
    "cl-and-te": post(extra=b"transfer-encoding: chunked\r\n"),
    "cl-and-te-identity": post(extra=b"transfer-encoding: identity\r\n"),
    "cl-twice-same": post(extra=b"content-length: %d\r\n" % len(COMPLETION)),
    "cl-list": post(extra=b"content-length: 5, 5\r\n"),
    "cl-plus": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: +5\r\n\r\nhello",
    "cl-negative": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n",
    "cl-overflow": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999999999999999\r\n\r\n",
    "te-gzip-alone": chunked(COMPLETION, coding=b"gzip"),
    "te-chunked-then-gzip": chunked(COMPLETION, coding=b"chunked, gzip"),
    "te-chunked-twice": chunked(COMPLETION, coding=b"chunked, chunked"),
    "bad-chunk-size": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_framing_gets_400_and_a_close(server, name):
    # A valid request follows in the same write: the server must not read it.
    answer_then_close(server.port, MALFORMED[name] + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", 400)


def test_obs_fold_gets_400_saying_so(server):
    body = answer_then_close(server.port, b"GET /health HTTP/1.1\r\nhost: x\r\nx-a: 1\r\n  2\r\n\r\n", 400)
    assert b"folding" in body


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"identity, chunked"])
def test_an_unknown_transfer_coding_gets_501_and_a_close(server, coding):
    answer_then_close(server.port, chunked(COMPLETION, coding=coding), 501)
    # The same codings on two field lines are one list.
    split = chunked(COMPLETION, coding=coding.split(b",")[0] + b"\r\ntransfer-encoding: chunked")
    answer_then_close(server.port, split, 501)


@pytest.mark.parametrize("coding", [b",chunked", b", chunked", b" , ,chunked", b",\r\ntransfer-encoding: chunked"])
def test_empty_transfer_coding_elements_are_ignored(server, coding):
    (status, body), = split_responses(exchange(server.port, chunked(COMPLETION, coding=coding)))
    assert status == 200 and orjson.loads(body)["choices"]


@pytest.mark.parametrize("coding", [b"chunked, ", b"chunked,,"])
def test_empty_transfer_coding_elements_after_chunked_get_400(server, coding):
    # llhttp refuses these before our callbacks see them; the body is never read under another framing.
    answer_then_close(server.port, chunked(COMPLETION, coding=coding) + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", 400)


def test_transfer_encoding_on_http10_is_faulty_framing(server):
    data = chunked(COMPLETION, version=b"1.0").replace(b"connection: close", b"connection: keep-alive")
    answer_then_close(server.port, data + b"GET /health HTTP/1.0\r\n\r\n", 400)


def test_chunk_extensions_are_ignored(server):
    (status, body), = split_responses(exchange(server.port, chunked(COMPLETION, extension=b";foo=bar;baz")))
    assert status == 200 and orjson.loads(body)["choices"]


def test_trailer_fields_are_not_merged_into_the_headers(server):
    # Merged, a trailer Host would be a second Host (400) and a trailer Content-Type would count.
    data = chunked(COMPLETION, trailer=b"host: elsewhere\r\nx-request-id: from-trailer\r\n")
    raw = exchange(server.port, data)
    (status, _), = split_responses(raw)
    assert status == 200 and b"from-trailer" not in raw


# --- connection management ---

def test_no_request_after_connection_close_is_processed(server):
    data = (b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            + post(extra=b"x-request-id: must-not-run\r\n"))
    raw = exchange(server.port, data)
    (status, _), = split_responses(raw)
    assert status == 200 and b"connection: close" in raw
    assert "must-not-run" not in server.log()


def test_http10_expect_100_continue_is_ignored(server):
    raw = exchange(server.port, post(version=b"1.0", extra=b"expect: 100-continue\r\n"))
    assert raw.startswith(b"HTTP/1.1 200") and b" 100 " not in raw.split(b"\r\n")[0]


def test_head_gets_the_headers_and_no_content(server):
    get_raw = exchange(server.port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    raw = exchange(server.port, b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
                                b"HEAD /nope HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    models, _, rest = raw.partition(b"\r\n\r\n")
    assert models.startswith(b"HTTP/1.1 200") and b"content-length: " in models
    assert models.split(b"\r\n")[1:3] == get_raw.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:3]  # type, length
    assert rest.startswith(b"HTTP/1.1 404") and rest.endswith(b"\r\n\r\n")  # the next answer, no content


@pytest.mark.parametrize("data", [b"HEAD /health HTTP/1.1\r\n\r\n", b"HEAD /health HTTP/1.1\r\nhost: a b\r\n\r\n",
                                  b"HEAD /health HTTP/1.1\r\nhost: x\r\nx: " + b"a" * 70000 + b"\r\n\r\n"],
                         ids=["no-host", "bad-host", "431"])
def test_a_refused_head_gets_headers_only(server, data):
    # (found by tests/test_fuzz.py: the error's content followed, to be read as the next response)
    raw = exchange(server.port, data)
    head, _, content = raw.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")) and b"content-length: " in head
    assert content == b""


def test_the_refusal_of_garbage_after_a_head_has_its_content(server):
    # (found by tests/test_fuzz.py: llhttp still named the HEAD's method while refusing what followed)
    raw = exchange(server.port, b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n{\"prompt\": [1]}")
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    (status, body), = split_responses(rest)
    assert status == 400 and orjson.loads(body)["error"]["code"] == 400


def test_every_answer_carries_a_date(server):
    for data in (b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", b"GET /nope HTTP/1.1\r\nhost: x\r\n\r\n",
                 b"GET /health HTTP/1.1\r\n\r\n"):
        raw = exchange(server.port, data, half_close=True)
        assert b"\r\ndate: " in raw.partition(b"\r\n\r\n")[0]


def test_a_stream_to_http10_is_close_delimited(server):
    body = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 3, "stream": True})
    raw = exchange(server.port, post(body, version=b"1.0"))
    head, _, content = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    assert content.count(b"data: {") == 3 and content.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("data", [
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + COMPLETION,
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{\"pro",
], ids=["short-body", "unfinished-chunks"])
def test_a_request_cut_short_by_a_half_close_gets_400(server, data):
    raw = exchange(server.port, data, half_close=True)
    (status, body), = split_responses(raw)
    assert status == 400 and b"before the request was complete" in body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_half_closed_client_gets_the_whole_answer(server, stream):
    # Held: the client's FIN is in before the first token exists, so the answer is written
    # entirely to a client that has shut its sending side.
    body = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 20, "ignore_eos": True, "stream": stream,
                         **({"stream_options": {"include_usage": True}} if stream else {})})
    data = post(body) + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"  # a pipelined one is answered too
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        with server.hold("prefill"):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            server.hold.wait_held("prefill")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    # Until its answer began, the server probed with interim answers (is the client still there?).
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    probes = 0
    while raw.startswith(interim, probes * len(interim)):
        probes += 1
    assert probes >= 1
    first, _, health = raw[probes * len(interim):].rpartition(b"HTTP/1.1 200 OK\r\n")
    # The pipelined request is probed too if a sweep comes while it waits for its turn (a slow host):
    # interim answers between the two final ones, never inside one.
    while first.endswith(interim):
        first = first[:-len(interim)]
    assert interim not in first
    assert first.startswith(b"HTTP/1.1 200") and health  # both answered, then the server closed
    if stream:
        # Every token was generated (a token whose text is held back sends no event of its own).
        assert b'"completion_tokens":20' in first and first.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    else:
        (status, answer), = split_responses(first)
        assert orjson.loads(answer)["usage"]["completion_tokens"] == 20
