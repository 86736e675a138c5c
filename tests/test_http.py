"""HTTP/1.1 over raw sockets: keep-alive, HTTP/1.0, pipelining, chunked bodies,
100-continue, limits, and the error answers of the HTTP layer."""

from __future__ import annotations

import socket

import orjson

from .client import raw_exchange, split_responses

COMPLETION = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})


def request(method: str, path: str, body: bytes = b"", extra: str = "", version: str = "1.1") -> bytes:
    head = f"{method} {path} HTTP/{version}\r\nhost: x\r\n{extra}"
    if body:
        head += f"content-length: {len(body)}\r\ncontent-type: application/json\r\n"
    return head.encode() + b"\r\n" + body


def assert_error(status: int, body: bytes, expected: int) -> dict:
    assert status == expected
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == expected and error["message"]
    return error


def test_keep_alive_serves_several_requests_on_one_connection(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for _ in range(3):
            sock.sendall(request("POST", "/v1/completions", COMPLETION))
            data = b""
            while b"}}" not in data:
                data += sock.recv(65536)
            (status, body), = split_responses(data)
            assert status == 200 and orjson.loads(body)["choices"]


def test_pipelined_requests_answer_in_order(server):
    data = b"".join([request("GET", "/v1/models"), request("POST", "/v1/completions", COMPLETION),
                     request("GET", "/nope"), request("GET", "/health", extra="connection: close\r\n")])
    responses = split_responses(raw_exchange(server.port, data))
    assert [s for s, _ in responses] == [200, 200, 404, 200]
    assert orjson.loads(responses[0][1])["object"] == "list"
    assert orjson.loads(responses[1][1])["object"] == "text_completion"


def test_pipelined_malformed_request_in_the_middle(server):
    data = request("GET", "/health") + b"BLAH\x01 nonsense\r\n\r\n" + request("GET", "/health")
    raw = raw_exchange(server.port, data)
    responses = split_responses(raw)
    assert responses[0][0] == 200
    assert_error(*responses[1], 400)
    assert len(responses) == 2  # the connection closed after the 400


def test_http10_closes_after_the_response(server):
    raw = raw_exchange(server.port, request("POST", "/v1/completions", COMPLETION, version="1.0"))
    (status, body), = split_responses(raw)
    assert status == 200 and b"connection: close" in raw.lower()


def test_http10_keep_alive_when_asked(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(request("GET", "/health", extra="connection: keep-alive\r\n", version="1.0"))
            data = sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 200") and b"connection: keep-alive" in data


def test_chunked_request_body(server):
    half = len(COMPLETION) // 2
    chunks = f"{half:x}\r\n".encode() + COMPLETION[:half] + f"\r\n{len(COMPLETION) - half:x}\r\n".encode() \
        + COMPLETION[half:] + b"\r\n0\r\n\r\n"
    data = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
            b"connection: close\r\n\r\n" + chunks)
    (status, body), = split_responses(raw_exchange(server.port, data))
    assert status == 200 and orjson.loads(body)["choices"]


def test_expect_100_continue(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                     f"content-length: {len(COMPLETION)}\r\nconnection: close\r\n\r\n".encode())
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(COMPLETION)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    (status, _), = split_responses(data)
    assert status == 200


def test_garbage_gets_400_and_close(server):
    raw = raw_exchange(server.port, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n")
    (status, body), = split_responses(raw)
    assert_error(status, body, 400)


def test_unknown_path_404_and_wrong_method_405(server):
    (status, body), = split_responses(raw_exchange(server.port, request("GET", "/v2/x", extra="connection: close\r\n")))
    assert_error(status, body, 404)
    raw = raw_exchange(server.port, request("GET", "/v1/completions", extra="connection: close\r\n"))
    (status, body), = split_responses(raw)
    assert_error(status, body, 405)
    assert b"allow: POST" in raw


def test_one_model_card_by_its_id(server):
    raw = raw_exchange(server.port, request("GET", "/v1/models/tiny", extra="connection: close\r\n"))
    (status, body), = split_responses(raw)
    assert status == 200 and orjson.loads(body)["id"] == "tiny" and orjson.loads(body)["object"] == "model"
    (status, body), = split_responses(raw_exchange(server.port, request("GET", "/v1/models/gpt-9",
                                                                        extra="connection: close\r\n")))
    assert_error(status, body, 404)


def test_browsers_may_call_the_api(server):
    # A CORS preflight names the method and headers the page will send; any origin may, as in vLLM.
    raw = raw_exchange(server.port, request("OPTIONS", "/v1/chat/completions", extra=(
        "origin: http://app.example\r\naccess-control-request-method: POST\r\n"
        "access-control-request-headers: authorization, content-type\r\nconnection: close\r\n")))
    head = raw.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 200") and b"access-control-allow-origin: *" in head
    assert b"access-control-allow-methods: post" in head
    assert b"access-control-allow-headers: authorization, content-type" in head
    raw = raw_exchange(server.port, request("POST", "/v1/completions", COMPLETION,
                                            extra="origin: http://app.example\r\nconnection: close\r\n"))
    assert raw.startswith(b"HTTP/1.1 200") and b"access-control-allow-origin: *" in raw.partition(b"\r\n\r\n")[0]
    raw = raw_exchange(server.port, request("POST", "/v1/completions", COMPLETION, extra="connection: close\r\n"))
    assert b"access-control" not in raw  # not a browser: no CORS headers


def test_body_over_the_limit_413(server):
    data = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 999999999\r\n\r\n"
    (status, body), = split_responses(raw_exchange(server.port, data))
    assert_error(status, body, 413)


def test_headers_too_large_431(server):
    data = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70000 + b"\r\n\r\n"
    (status, body), = split_responses(raw_exchange(server.port, data))
    assert_error(status, body, 431)


def send_in_pieces(port: int, head: bytes, piece: bytes, total: int) -> bytes:
    """Send head, then piece after piece (each its own write) up to total bytes, then read until
    the server closes. Sending stops early if the server has already answered and closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head)
        try:
            for _ in range(total // len(piece)):
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_a_header_value_streamed_in_pieces_gets_431_at_the_limit(server):
    # The line never ends: llhttp never hands it over, so only counting bytes as they arrive sees it
    # (without that, the value grew until the 30 s read timeout answered 408).
    raw = send_in_pieces(server.port, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ", b"a" * 8192, 1 << 20)
    (status, body), = split_responses(raw)
    assert_error(status, body, 431)


def test_a_trailer_value_streamed_in_pieces_gets_431_at_the_limit(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n%b\r\n0\r\nx-trailer: " % (len(COMPLETION), COMPLETION))
    raw = send_in_pieces(server.port, head, b"a" * 8192, 1 << 20)
    (status, body), = split_responses(raw)
    assert_error(status, body, 431)


def test_a_head_under_the_limit_arriving_in_pieces_is_served(server):
    data = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-big: " + b"a" * 60000 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(0, len(data), 1000):
            sock.sendall(data[i:i + 1000])
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    assert split_responses(raw)[0][0] == 200


def test_pipelined_bodies_larger_than_the_header_limit_are_not_counted_as_heads(server):
    # Large bodies and the next request's head share reads: only a head's own bytes count.
    body = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 1, "user": "u" * 30000})
    one = request("POST", "/v1/completions", body)
    raw = raw_exchange(server.port, one * 5 + request("GET", "/health", extra="connection: close\r\n"))
    assert [status for status, _ in split_responses(raw)] == [200] * 6


def test_content_length_with_transfer_encoding_is_refused(server):
    data = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
            b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n")
    (status, body), = split_responses(raw_exchange(server.port, data))
    assert_error(status, body, 400)


def test_many_short_connections(server):
    for _ in range(200):
        raw = raw_exchange(server.port, request("GET", "/health", extra="connection: close\r\n"))
        assert raw.startswith(b"HTTP/1.1 200")


def test_a_deep_pipeline_pauses_reading_and_still_answers_every_request_in_order(server):
    # More than MAX_PIPELINED (32) unanswered requests: the server stops reading, then resumes.
    bodies = [orjson.dumps({"prompt": [7, i + 1], "max_tokens": 1, "temperature": 0}) for i in range(80)]
    data = b"".join(request("POST", "/v1/completions", body) for body in bodies)
    data += request("GET", "/health", extra="connection: close\r\n")
    responses = split_responses(raw_exchange(server.port, data, timeout=60))
    assert [s for s, _ in responses] == [200] * 80 + [200]
    assert all(orjson.loads(b)["usage"]["prompt_tokens"] == 2 for _, b in responses[:80])


async def test_connections_waiting_in_the_accept_queue_at_a_drain_are_answered():
    # The loop is kept from accepting (this coroutine does not yield) while clients connect and
    # send: their connections sit in the kernel's accept queue. Closing the listener would reset
    # them; stop_accepting accepts them first, and each request is answered, with a close.
    import asyncio

    from xllm_async.http.protocol import HttpLimits
    from xllm_async.http.server import HttpServer

    async def handler(req, responder):
        responder.send(200, b'{"ok":true}')

    server = HttpServer(handler, HttpLimits())
    await server.start("127.0.0.1", 0)
    clients = []
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)  # the kernel completes it
        sock.sendall(request("GET", "/anything"))
        clients.append(sock)
    server.stop_accepting()  # before the loop has run once since the connects
    while server.busy:
        await asyncio.sleep(0.01)

    def read_all(sock):
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data

    answers = await asyncio.gather(*[asyncio.to_thread(read_all, s) for s in clients])
    server.close_all()
    for sock in clients:
        sock.close()
    for data in answers:
        (status, body), = split_responses(data)
        assert status == 200 and body == b'{"ok":true}' and b"connection: close" in data.lower()
