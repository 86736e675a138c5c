"""Small HTTP helpers for tests: real sockets, nothing mocked."""

from __future__ import annotations

import http.client
import socket

import orjson


def post(port: int, path: str, body, headers: dict | None = None, timeout: float = 60):
    """POST JSON (or raw bytes); returns (status, parsed JSON or raw bytes, headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    conn.request("POST", path, data, {"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        return resp.status, orjson.loads(raw), dict(resp.getheaders())
    except orjson.JSONDecodeError:
        return resp.status, raw, dict(resp.getheaders())


def get(port: int, path: str, timeout: float = 30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", path)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, raw, dict(resp.getheaders())


def stream_events(port: int, path: str, body: dict, timeout: float = 60) -> list:
    """POST with stream=true; returns the SSE payloads in order ('[DONE]' as a string)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, orjson.dumps({**body, "stream": True}), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = []
    for line in resp:
        line = line.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[6:]
        events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    conn.close()
    return events


def raw_exchange(port: int, data: bytes, timeout: float = 10, read_until_close: bool = True) -> bytes:
    """Send raw bytes; read until the server closes (or timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                if not read_until_close:
                    break
        except TimeoutError:
            pass
    return b"".join(chunks)


def split_responses(data: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each Content-Length response in a raw byte stream."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        out.append((status, rest[:length]))
        data = rest[length:]
    return out


def counts(usage: dict) -> dict:
    """usage without its prompt_tokens_details, once checked: the default server's prefix cache reports
    them, and how much of a prompt earlier tests left cached is theirs to say, not the asserting test's."""
    usage = dict(usage)
    details = usage.pop("prompt_tokens_details")
    assert set(details) == {"cached_tokens"} and 0 <= details["cached_tokens"] < max(usage["prompt_tokens"], 1)
    return usage
