"""Mixed traffic under fixed_steps: a request that arrives while every slot runs a
long generation joins that batch at its next step instead of waiting for the
whole batch to end; short batches and beam searches still run to completion."""

from __future__ import annotations

import contextlib
import re
import socket
from concurrent.futures import ThreadPoolExecutor

import orjson

from .client import post
from .hold import wait_until
from .test_robustness import metric, open_stream

LONG = {"prompt": [11] * 10, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
SHORT = {"prompt": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True, "temperature": 0}


def read_available(sock: socket.socket, data: bytes) -> bytes:
    """What the server has sent so far (a short read timeout ends the read, never an assertion)."""
    sock.settimeout(0.05)
    with contextlib.suppress(socket.timeout):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_a_request_joins_a_running_long_generation_at_its_next_step(servers, reference):
    server = servers("fixed_steps-N1")  # one slot: without joining, SHORT would wait for all of LONG
    decode_hold, prefill_hold = server.hold("decode"), server.hold("prefill")
    with ThreadPoolExecutor(1) as pool:
        decode_hold.__enter__()
        try:
            sock = open_stream(server.port, LONG, headers={})
            data = b""
            while b"data: " not in data:  # LONG's first token came out of its prefill; its decode waits
                data += sock.recv(65536)
            server.hold.wait_held("decode")
            short = pool.submit(post, server.port, "/v1/completions", SHORT)
            wait_until(lambda: metric(server, "xllm:num_requests_waiting") == 1, what="SHORT handed over")
            prefill_hold.__enter__()
        finally:
            decode_hold.__exit__(None, None, None)  # the held step ends; then the slot prefills SHORT
        try:
            server.hold.wait_held("prefill")  # SHORT's prefill, on the only slot, in the middle of LONG
            data = read_available(sock, data)
            assert b"[DONE]" not in data  # LONG is still generating
        finally:
            prefill_hold.__exit__(None, None, None)
        status, body, _ = short.result(timeout=120)
        assert status == 200
        assert body["choices"][0]["text"] == reference.tokenizer.decode(reference(SHORT["prompt"], 3),
                                                                        skip_special_tokens=True)
        sock.settimeout(120)
        while b"[DONE]" not in data:
            chunk = sock.recv(65536)
            assert chunk, "LONG's stream ended early"
            data += chunk
        sock.close()
    # LONG's tokens after SHORT joined its batch are still its own: the whole text equals generate()'s.
    events = [orjson.loads(e) for e in re.findall(rb"data: (\{.*?\})\n\n", data)]
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == reference.tokenizer.decode(reference(LONG["prompt"], LONG["max_tokens"]), skip_special_tokens=True)

