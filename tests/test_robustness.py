"""Overload, impatient clients, slow clients, hostile input: every case gets a
defined answer over a real socket and the server keeps serving."""

from __future__ import annotations

import http.client
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from .client import get, post, raw_exchange, split_responses
from .conftest import ServerProcess
from .test_observability import sample_value, scrape

KEY = "s3cret-key"
AUTH = {"authorization": f"Bearer {KEY}"}
LONG = {"prompt": [11] * 10, "max_tokens": 240, "ignore_eos": True, "temperature": 0}
BUSY = {**LONG, "n": 6}  # keeps a CPU slot busy for over a second


@pytest.fixture(scope="module")
def strict(tiny_model_dir):
    """One slot, a tiny queue, short timeouts and an API key."""
    server = ServerProcess(["--model", tiny_model_dir, "--concurrent-execute-stream-num", "1",
                            "--max-queued-requests", "32", "--queue-timeout", "0.8", "--read-timeout", "1",
                            "--keep-alive-timeout", "1.5", "--write-timeout", "1", "--api-key", KEY,
                            "--max-connections", "64"])
    yield server
    server.stop()


def call(server, body, path="/v1/completions"):
    return post(server.port, path, body, headers=AUTH)


def busy_slot(server, n=1):
    """Start n long generations in the background; returns their futures."""
    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(call, server, BUSY) for _ in range(n)]
    time.sleep(0.3)
    return futures


# --- access ---

def test_api_key_guards_v1_routes_but_not_health(strict):
    assert post(strict.port, "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 401
    status, body, headers = post(strict.port, "/v1/completions", {"prompt": [1], "max_tokens": 1},
                                 headers={"authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["code"] == 401 and "bearer" in headers["www-authenticate"].lower()
    assert call(strict, {"prompt": [1], "max_tokens": 1})[0] == 200
    assert get(strict.port, "/health")[0] == 200


# --- overload ---

def test_full_queue_gets_503_and_admitted_requests_finish(strict):
    long_request = busy_slot(strict)
    with ThreadPoolExecutor(48) as pool:
        results = list(pool.map(lambda _: call(strict, {"prompt": [3] * 5, "max_tokens": 2, "ignore_eos": True}),
                                range(48)))
    statuses = [s for s, _, _ in results]
    assert statuses.count(503) >= 1
    for status, body, headers in results:
        if status == 503:
            assert headers["retry-after"] == "1" and body["error"]["code"] == 503
        else:
            assert status in (200, 408)
            if status == 200:
                assert body["usage"]["completion_tokens"] == 2
    status, body, _ = long_request[0].result()
    assert status == 200 and body["usage"]["completion_tokens"] == 6 * 240


def test_request_waiting_past_its_deadline_gets_408_and_is_never_computed(strict):
    before = scrape(strict.port)
    prompt_before = sample_value(before, "xllm:prompt_tokens", "xllm:prompt_tokens_total")
    long_request = busy_slot(strict)
    status, body, _ = call(strict, {"prompt": [5] * 33, "max_tokens": 1})
    assert status == 408 and "waited" in body["error"]["message"]
    assert long_request[0].result()[0] == 200
    after = scrape(strict.port)
    # Only the long request's 6 x 10 prompt tokens were computed, never the 33.
    assert sample_value(after, "xllm:prompt_tokens", "xllm:prompt_tokens_total") == prompt_before + 60


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


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("config", ["fixed_steps-N2", "continuous-N1"])
def test_disconnect_mid_generation_stops_the_work(servers, config):
    server = servers(config)
    aborts_before = sample_value(scrape(server.port), "xllm:request_success", "xllm:request_success_total",
                                 default=0, finished_reason="abort")
    sock = open_stream(server.port, LONG, headers={})
    assert b"data: " in sock.recv(65536)
    gen_at_close = sample_value(scrape(server.port), "xllm:generation_tokens", "xllm:generation_tokens_total")
    sock.close()
    running = lambda: sample_value(scrape(server.port), "xllm:num_requests_running",  # noqa: E731
                                   "xllm:num_requests_running") == 0
    assert wait_until(running)
    gen_after = sample_value(scrape(server.port), "xllm:generation_tokens", "xllm:generation_tokens_total")
    assert gen_after - gen_at_close < 200  # far fewer than the 240 asked for
    assert sample_value(scrape(server.port), "xllm:request_success", "xllm:request_success_total",
                        finished_reason="abort") == aborts_before + 1
    assert post(server.port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200


def test_disconnect_while_waiting_is_never_computed(strict):
    prompt_before = sample_value(scrape(strict.port), "xllm:prompt_tokens", "xllm:prompt_tokens_total")
    long_request = busy_slot(strict)
    sock = open_stream(strict.port, {"prompt": [9] * 21, "max_tokens": 1})
    time.sleep(0.1)
    sock.close()
    assert long_request[0].result()[0] == 200
    time.sleep(0.2)
    assert sample_value(scrape(strict.port), "xllm:prompt_tokens", "xllm:prompt_tokens_total") == prompt_before + 60


def test_stream_whose_client_stops_reading_is_ended(strict):
    def aborts():
        return sample_value(scrape(strict.port), "xllm:request_success", "xllm:request_success_total",
                            default=0, finished_reason="abort")

    before = aborts()
    # 32 x 200 events with 20 logprobs each are tens of MB: far more than the socket buffers hold,
    # so the server must find the client stopped reading while it is still generating.
    sock = open_stream(strict.port, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "n": 32,
                                     "logprobs": True, "top_logprobs": 20, "ignore_eos": True, "temperature": 0},
                       path="/v1/chat/completions", receive_buffer=4096)
    try:
        assert wait_until(lambda: aborts() >= before + 32, timeout=90)  # dropped, its sequences aborted
    finally:
        sock.close()
    assert call(strict, {"prompt": [1], "max_tokens": 1})[0] == 200


def test_slowloris_headers_get_408(strict):
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        time.sleep(0.5)
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
        started = time.monotonic()
        assert sock.recv(4096) == b""  # closed by the server
        assert time.monotonic() - started < 5


def test_connection_cap_refuses_cleanly(strict):
    idle = [socket.create_connection(("127.0.0.1", strict.port)) for _ in range(64)]
    try:
        time.sleep(0.2)
        raw = raw_exchange(strict.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        (status, body), = split_responses(raw)
        assert status == 503 and orjson.loads(body)["error"]["code"] == 503
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: get(strict.port, "/health")[0] == 200)


# --- hostile input ---

HOSTILE = [
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!", 400),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
     + b"".join(b"100000\r\n" + b"a" * 0x100000 + b"\r\n" for _ in range(17)) + b"0\r\n\r\n", 413),
    (b"GET /health HTTP/1.1\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(150)) + b"\r\n", 431),
    (b"GET /health HTTP/9.9\r\n\r\n", 400),
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


def test_health_answers_fast_while_every_slot_is_busy(strict):
    futures = busy_slot(strict)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        assert get(strict.port, "/health")[0] == 200
        times.append(time.perf_counter() - started)
    assert futures[0].result()[0] == 200
    # Generous: the loop must not be waiting on model work (a forward here is a few ms).
    assert min(times) < 0.25


# --- shutdown ---

def test_sigterm_drains_in_flight_requests_then_exits_zero(tiny_model_dir):
    server = ServerProcess(["--model", tiny_model_dir, "--drain-timeout", "20"])
    pool = ThreadPoolExecutor(3)
    futures = [pool.submit(post, server.port, "/v1/completions", BUSY) for _ in range(3)]
    balancer = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)  # a kept-alive prober
    balancer.connect()
    time.sleep(0.3)
    server.proc.terminate()
    health = 200
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and health == 200:
        balancer.request("GET", "/health")
        response = balancer.getresponse()
        response.read()
        health = response.status
        time.sleep(0.02)
    assert health == 503  # told to stop sending while we drain
    assert _try_health(server.port) is None  # and no new connections are accepted
    for future in futures:
        status, body, _ = future.result()
        assert status == 200 and body["usage"]["completion_tokens"] == 6 * 240
    assert server.proc.wait(30) == 0
    server.stop()


def _try_health(port: int):
    try:
        return get(port, "/health", timeout=5)[0]
    except OSError:
        return None


def test_requests_unfinished_after_the_drain_time_get_an_error(tiny_model_dir):
    server = ServerProcess(["--model", tiny_model_dir, "--drain-timeout", "0.2",
                            "--concurrent-execute-stream-num", "1"])
    pool = ThreadPoolExecutor(4)
    futures = [pool.submit(post, server.port, "/v1/completions", LONG) for _ in range(4)]
    time.sleep(0.3)
    server.proc.terminate()
    statuses = []
    for future in futures:
        try:
            status, body, _ = future.result()
        except OSError:  # the connection closed before an answer: never acceptable
            pytest.fail("a request got no answer")
        statuses.append(status)
        if status != 200:
            assert status == 503 and "shut down" in body["error"]["message"]
    assert 503 in statuses
    assert server.proc.wait(30) == 0
    server.stop()
