"""Overload, impatient clients, slow clients, hostile input: every case gets a
defined answer over a real socket and the server keeps serving."""

from __future__ import annotations

import contextlib
import http.client
import select
import socket
import struct
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from .client import get, post, raw_exchange, split_responses
from .conftest import ServerProcess, start_together
from .hold import wait_until
from .test_observability import sample_value, scrape

KEY = "s3cret-key"
AUTH = {"authorization": f"Bearer {KEY}"}
LONG = {"prompt": [11] * 10, "max_tokens": 240, "ignore_eos": True, "temperature": 0}
# The strict server's and the slow readers' socket buffers, set explicitly: what the kernel would
# size itself (net.ipv4.tcp_wmem, tcp_rmem) can hold a whole stream on some hosts.
SEND_BUFFER = 16384
# Whatever keeps a slot busy is held there (server.hold), never sized to outlast a timeout.
HOLDER = {"prompt": [11] * 10, "max_tokens": 3, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def strict(tiny_model_dir):
    """One slot, a tiny queue, short timeouts, small send buffers and an API key."""
    server = ServerProcess(["--model", tiny_model_dir, "--concurrent-execute-stream-num", "1",
                            "--max-queued-requests", "32", "--queue-timeout", "2", "--read-timeout", "1",
                            "--keep-alive-timeout", "1.5", "--write-timeout", "1", "--api-key", KEY,
                            "--max-connections", "64", "--send-buffer-bytes", str(SEND_BUFFER)])
    yield server
    server.stop()


def call(server, body, path="/v1/completions"):
    return post(server.port, path, body, headers=AUTH)


def metric(server, family: str, sample: str | None = None, **labels) -> float:
    return sample_value(scrape(server.port), family, sample or family, default=0, **labels)


def aborts(server) -> float:
    return metric(server, "xllm:request_success", "xllm:request_success_total", finished_reason="abort")


@contextlib.contextmanager
def slot_held(server, body=HOLDER):
    """A request started on the (one) slot and held there in its prefill for the block's
    length; yields its future, which completes once the block ends."""
    with server.hold("prefill"):
        future = ThreadPoolExecutor(1).submit(call, server, body)
        server.hold.wait_held("prefill")
        yield future


def reset(sock: socket.socket) -> None:
    """Close with a reset, as a client that is gone (a plain close is a FIN: only a half-close,
    whose client still reads, and is answered in full)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def send_request(port: int, body: dict, headers: dict = AUTH) -> socket.socket:
    """One whole request on a connection of its own (answered, then closed); no waiting."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    payload = orjson.dumps(body)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\n{head}connection: close\r\n"
                 f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    (status, body), = split_responses(data)
    return status, orjson.loads(body)


# --- access ---

def test_api_key_guards_v1_routes_but_not_health(strict):
    assert post(strict.port, "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 401
    status, body, headers = post(strict.port, "/v1/completions", {"prompt": [1], "max_tokens": 1},
                                 headers={"authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["code"] == 401 and "bearer" in headers["www-authenticate"].lower()
    assert call(strict, {"prompt": [1], "max_tokens": 1})[0] == 200
    assert get(strict.port, "/health")[0] == 200


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info", "/version", "/v1/models"])
def test_api_key_guards_every_route_that_tells_about_the_deployment(strict, path):
    # /server_info names the model's and the item table's paths: as much the key's to guard as /v1/.
    status, body, _ = get(strict.port, path)
    assert status == 401 and orjson.loads(body)["error"]["code"] == 401 and b"model" not in body.lower()
    conn = http.client.HTTPConnection("127.0.0.1", strict.port, timeout=30)
    conn.request("GET", path, headers=AUTH)
    assert conn.getresponse().status == 200
    conn.close()


def test_health_and_metrics_need_no_api_key(strict):
    # A balancer's health check and a metrics scraper carry no key (as README says).
    assert get(strict.port, "/health")[0] == 200
    status, body, _ = get(strict.port, "/metrics")
    assert status == 200 and b"xllm:" in body


# --- overload ---

def test_full_queue_gets_503_and_admitted_requests_finish(strict):
    small = {"prompt": [3] * 5, "max_tokens": 2, "ignore_eos": True}
    with slot_held(strict) as holder:
        # 32 wait (the queue's limit) behind the held slot. Sent from one thread in a few
        # milliseconds: far inside the 2 s queue timeout, so none has expired to make room.
        admitted = [send_request(strict.port, small) for _ in range(32)]
        wait_until(lambda: metric(strict, "xllm:num_requests_waiting") == 32, what="32 waiting")
        status, body, headers = post(strict.port, "/v1/completions", small, headers=AUTH)
        assert status == 503 and headers["retry-after"] == "1" and body["error"]["code"] == 503
    status, body, _ = holder.result()
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    for sock in admitted:
        status, body = read_answer(sock)
        assert status in (200, 408)  # a slow machine may have let some wait past the timeout
        if status == 200:
            assert body["usage"]["completion_tokens"] == 2


def test_a_request_larger_than_the_whole_queue_gets_400_not_a_retry(strict):
    # 33 sequences never fit a 32-deep queue: a 503 would have the client retry forever.
    for body, param in (({"prompt": [[5, 6]] * 33, "max_tokens": 1}, "prompt"),
                        ({"prompt": [5, 6], "max_tokens": 1, "n": 33}, "n")):
        status, answer, headers = call(strict, body)
        assert status == 400 and "retry-after" not in headers, answer
        assert answer["error"]["param"] == param and "XLLM_MAX_QUEUED_REQUESTS" in answer["error"]["message"]
    assert call(strict, {"prompt": [[5, 6]] * 32, "max_tokens": 1})[0] == 200


def test_request_waiting_past_its_deadline_gets_408_and_is_never_computed(strict):
    prompt_before = metric(strict, "xllm:prompt_tokens", "xllm:prompt_tokens_total")
    with slot_held(strict) as holder:  # the slot stays busy until the 408 is in
        status, body, _ = call(strict, {"prompt": [5] * 33, "max_tokens": 1})
        assert status == 408 and "waited" in body["error"]["message"]
    assert holder.result()[0] == 200
    # Only the holder's 10 prompt tokens were computed, never the 33.
    assert metric(strict, "xllm:prompt_tokens", "xllm:prompt_tokens_total") == prompt_before + 10


# --- impatient and slow clients ---

def open_stream(port: int, body: dict, headers: dict = AUTH, path: str = "/v1/completions",
                receive_buffer: int = 0) -> socket.socket:
    sock = socket.socket()
    if receive_buffer:  # before connect, so that the advertised window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    payload = orjson.dumps({**body, "stream": True})
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\n{head}content-length: {len(payload)}\r\n\r\n"
                 .encode() + payload)
    return sock


@pytest.mark.parametrize("config", ["fixed_steps-N2", "continuous-N1"])
def test_disconnect_mid_generation_stops_the_work(servers, config):
    server = servers(config)
    aborts_before = aborts(server)
    with server.hold("decode"):  # the first token comes out of the prefill; the decode waits
        sock = open_stream(server.port, LONG, headers={})
        data = b""
        while b"data: " not in data:
            data += sock.recv(65536)
        server.hold.wait_held("decode")
        gen_at_close = metric(server, "xllm:generation_tokens", "xllm:generation_tokens_total")
        reset(sock)
        wait_until(lambda: aborts(server) == aborts_before + 1, what="the abort")
    wait_until(lambda: metric(server, "xllm:num_requests_running") == 0, what="an idle server")
    gen_after = metric(server, "xllm:generation_tokens", "xllm:generation_tokens_total")
    assert gen_after - gen_at_close <= 1  # at most the step that was held, of the 240 asked for
    assert aborts(server) == aborts_before + 1
    assert post(server.port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200


def test_disconnect_while_waiting_is_never_computed(strict):
    prompt_before = metric(strict, "xllm:prompt_tokens", "xllm:prompt_tokens_total")
    aborts_before = aborts(strict)
    with slot_held(strict) as holder:
        sock = open_stream(strict.port, {"prompt": [9] * 21, "max_tokens": 1})
        wait_until(lambda: metric(strict, "xllm:num_requests_waiting") == 1, what="the request waiting")
        reset(sock)
        wait_until(lambda: aborts(strict) == aborts_before + 1, what="the abort")
    assert holder.result()[0] == 200
    # Only the holder's 10 prompt tokens were computed, never the 21.
    assert metric(strict, "xllm:prompt_tokens", "xllm:prompt_tokens_total") == prompt_before + 10


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_closes_before_its_answer_has_its_generation_aborted(strict, stream):
    # A plain close sends a FIN, as a half-close does (and as an SDK's timeout does): the server
    # probes with 100 Continue, gets the reset, and drops the work (half-closed clients that
    # still read: test_http_conformance.py::test_a_half_closed_client_gets_the_whole_answer).
    prompt_before = metric(strict, "xllm:prompt_tokens", "xllm:prompt_tokens_total")
    aborts_before = aborts(strict)
    body = {"prompt": [9] * 21, "max_tokens": 1}
    with slot_held(strict) as holder:
        sock = open_stream(strict.port, body) if stream else send_request(strict.port, body)
        wait_until(lambda: metric(strict, "xllm:num_requests_waiting") == 1, what="the request waiting")
        sock.close()
        wait_until(lambda: aborts(strict) == aborts_before + 1, what="the abort")
    assert holder.result()[0] == 200
    assert metric(strict, "xllm:prompt_tokens", "xllm:prompt_tokens_total") == prompt_before + 10


def test_requests_whose_clients_left_free_their_queue_places_at_once(strict):
    # SDK timeouts with retries would otherwise fill the queue with their own dead entries (503s).
    aborts_before = aborts(strict)
    body = {"prompt": [9] * 5, "max_tokens": 1}
    with slot_held(strict) as holder:
        gone = [send_request(strict.port, body) for _ in range(32)]
        wait_until(lambda: metric(strict, "xllm:num_requests_waiting") == 32, what="a full queue")
        for sock in gone:
            sock.close()
        wait_until(lambda: aborts(strict) == aborts_before + 32, what="the aborts")
        wait_until(lambda: metric(strict, "xllm:num_requests_waiting") == 0, what="an empty queue")
        late = send_request(strict.port, body)  # admitted while the slot is still held
        wait_until(lambda: metric(strict, "xllm:num_requests_waiting") == 1, what="the late request waiting")
    assert holder.result()[0] == 200 and read_answer(late)[0] == 200


def test_stream_whose_client_stops_reading_is_ended(strict):
    before = aborts(strict)
    # 32 x 190 events with 20 logprobs each are over 10 MB: far more than the socket buffers hold
    # (set small on both ends: SEND_BUFFER on the server's, 4 KB on the client's). The decode is
    # held after them, so the server must find the client stopped reading while the generation is
    # still unfinished, however fast the machine computes.
    with strict.hold("decode", passes=190):
        sock = open_stream(strict.port, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                                         "n": 32, "logprobs": True, "top_logprobs": 20, "ignore_eos": True,
                                         "temperature": 0},
                           path="/v1/chat/completions", receive_buffer=4096)
        try:
            wait_until(lambda: aborts(strict) >= before + 32, what="the dropped stream")  # its sequences aborted
        finally:
            sock.close()
    assert call(strict, {"prompt": [1], "max_tokens": 1})[0] == 200


def test_slowloris_headers_get_408(strict):
    # Header lines keep coming, one at a time, and the request never completes: bytes arriving do
    # not extend the 1 s read timeout. (The pause between lines only paces the trickle; the 60 s
    # socket timeout is the guard against a server that never answers.)
    with socket.create_connection(("127.0.0.1", strict.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while not select.select([sock], [], [], 0.1)[0]:  # until the server answers
                sock.sendall(b"x-slow: 1\r\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    (status, body), = split_responses(data)
    assert status == 408 and orjson.loads(body)["error"]["code"] == 408


def test_slowloris_body_gets_408(strict):
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    assert split_responses(data)[0][0] == 408


def test_idle_keep_alive_connection_is_closed(strict):
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert sock.recv(4096) == b""  # closed by the server, well before the socket's 10 s timeout


def test_connection_cap_refuses_cleanly(strict):
    idle = [socket.create_connection(("127.0.0.1", strict.port)) for _ in range(64)]
    answers = []

    def refused() -> bool:  # probes get 200 until the server has taken all 64 in
        raw = raw_exchange(strict.port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answers[:] = split_responses(raw)
        return answers[0][0] == 503

    try:
        wait_until(refused, what="the connection cap")
        assert orjson.loads(answers[0][1])["error"]["code"] == 503
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: get(strict.port, "/health")[0] == 200, what="serving again")


# --- hostile input ---

HOSTILE = [
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!", 400),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
     + b"".join(b"100000\r\n" + b"a" * 0x100000 + b"\r\n" for _ in range(17)) + b"0\r\n\r\n", 413),
    (b"GET /health HTTP/1.1\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(150)) + b"\r\n", 431),
    (b"GET /health HTTP/9.9\r\n\r\n", 505),
    (b"\x00\x01\x02\x03\r\n\r\n", 400),
]


@pytest.mark.parametrize("data,expected", HOSTILE)
def test_hostile_http_gets_its_status_and_a_close(strict, data, expected):
    raw = raw_exchange(strict.port, data)
    status, body = split_responses(raw)[0]
    assert status == expected
    assert orjson.loads(body)["error"]["code"] == expected
    assert get(strict.port, "/health")[0] == 200


@pytest.mark.parametrize("body", [
    b"[" * 5000 + b"]" * 5000,
    b'{"prompt": [1], "max_tokens": NaN}',
    b'{"prompt": [1], "temperature": Infinity}',
    b'{"prompt": "\xc3\x28"}',
])
def test_hostile_json_gets_400(strict, body):
    status, answer, _ = post(strict.port, "/v1/completions", body, headers=AUTH)
    assert status == 400 and answer["error"]["code"] == 400


def test_newline_flood_does_not_hurt(strict):
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        for _ in range(50):
            sock.sendall(b"\r\n" * 2000)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


def test_health_answers_while_every_slot_is_busy(strict):
    with slot_held(strict) as holder:  # the slot stays busy until every answer is in
        for _ in range(5):
            assert get(strict.port, "/health", timeout=10)[0] == 200
    assert holder.result()[0] == 200


# --- shutdown ---

def admitted(server, count: int) -> None:
    """Until `count` one-sequence requests are in: held in a prefill or waiting for a slot."""
    wait_until(lambda: server.hold.held("prefill") >= 1 and server.hold.held("prefill")
               + metric(server, "xllm:num_requests_waiting") == count, what=f"{count} requests admitted")


# Each drain test's own server (its drain ends it), the four started together (start_together).
DRAIN_SERVERS = {
    "in flight": ["--drain-timeout", "60"],
    "late request": ["--drain-timeout", "60", "--concurrent-execute-stream-num", "2"],
    "fresh connection": ["--drain-timeout", "60"],
    "drain time over": ["--drain-timeout", "0.2", "--concurrent-execute-stream-num", "1"],
}


@pytest.fixture(scope="module")
def drain_servers(tiny_model_dir):
    started = start_together(*((["--model", tiny_model_dir, *args], None) for args in DRAIN_SERVERS.values()))
    yield dict(zip(DRAIN_SERVERS, started))
    for server in started:
        server.stop()


def test_sigterm_drains_in_flight_requests_then_exits_zero(drain_servers):
    server = drain_servers["in flight"]
    pool = ThreadPoolExecutor(3)
    balancer = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)  # a kept-alive prober
    balancer.connect()
    with server.hold("prefill"):  # in flight until the drain has been seen
        futures = [pool.submit(post, server.port, "/v1/completions", HOLDER) for _ in range(3)]
        admitted(server, 3)
        server.proc.terminate()

        def draining() -> bool:
            balancer.request("GET", "/health")
            response = balancer.getresponse()
            response.read()
            return response.status == 503

        wait_until(draining, what="503 from /health")  # told to stop sending while we drain
        assert _try_health(server.port) is None  # and no new connections are accepted
    for future in futures:
        status, body, _ = future.result()
        assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert server.proc.wait(30) == 0
    server.stop()


def test_a_request_that_reaches_a_draining_server_is_served_and_closes_its_connection(drain_servers):
    # A balancer may send a request on a connection it opened just before the drain began (its
    # health check has not seen the 503 yet): it gets its answer, not an error, and the connection
    # closes after it.
    server = drain_servers["late request"]
    pool = ThreadPoolExecutor(2)
    late = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    late.request("GET", "/health")  # open before the drain, kept alive
    assert late.getresponse().read() == b""
    with server.hold("prefill"):  # keeps the drain going until the late request is in
        # A generation longer than a short batch: the late request starts beside it on slot 1, where
        # the hold sees it (beside a short one on every core, it would wait in the queue, unseen).
        held = pool.submit(post, server.port, "/v1/completions", {**HOLDER, "max_tokens": 8})
        admitted(server, 1)
        server.proc.terminate()
        wait_until(lambda: _try_health(server.port) is None, what="the listener closed")

        def send_late():
            late.request("POST", "/v1/completions", body=orjson.dumps(HOLDER),
                         headers={"content-type": "application/json"})
            response = late.getresponse()
            return response.status, orjson.loads(response.read()), response.getheader("connection")

        answer = pool.submit(send_late)
        # Both slots' prefills held: the late request is in (/metrics cannot tell: no new connections).
        wait_until(lambda: server.hold.held("prefill") == 2, what="the late request admitted")
    status, body, connection = answer.result()
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert connection == "close"
    assert held.result()[0] == 200
    assert server.proc.wait(30) == 0
    server.stop()


def test_a_connection_accepted_just_before_the_drain_gets_its_first_request_answered(drain_servers):
    # A balancer opens a connection to send a request. If SIGTERM lands between the accept and the
    # request, the drain must wait for that request (FIRST_REQUEST_GRACE, 2 s; here it comes at
    # once) rather than close the connection under it: HAProxy would answer its client by closing
    # a kept-alive connection without a response.
    server = drain_servers["fresh connection"]
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        wait_until(lambda: metric(server, "xllm:http_connections_open") >= 2, what="the connection accepted")
        server.proc.terminate()  # nothing in flight: only the fresh connection keeps the drain open
        wait_until(lambda: _try_health(server.port) is None, what="the listener closed")
        body = orjson.dumps(HOLDER)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    finally:
        sock.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower()
    assert orjson.loads(payload)["usage"]["completion_tokens"] == 3
    assert server.proc.wait(30) == 0
    server.stop()


def _try_health(port: int):
    try:
        return get(port, "/health", timeout=5)[0]
    except OSError:
        return None


def test_requests_unfinished_after_the_drain_time_get_an_error(drain_servers):
    server = drain_servers["drain time over"]
    pool = ThreadPoolExecutor(4)
    with server.hold("prefill"):  # none can finish before the drain time is over
        futures = [pool.submit(post, server.port, "/v1/completions", HOLDER) for _ in range(4)]
        admitted(server, 4)
        server.proc.terminate()
        for future in futures:
            try:
                status, body, _ = future.result()
            except OSError:  # the connection closed before an answer: never acceptable
                pytest.fail("a request got no answer")
            assert status == 503 and "shut down" in body["error"]["message"]
    assert server.proc.wait(30) == 0
    server.stop()
