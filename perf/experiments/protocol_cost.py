"""What the HTTP protocol's valid path costs per request: this checkout's http package against
another commit's, in one process, interleaved rounds.

A served benchmark (`make bench`) cannot see a difference of a few microseconds on this machine
(its round-to-round noise is 2-6%), so this drives `HttpProtocol` directly: a fake transport, a
handler that answers at once, the same keep-alive chat request fed N times. What is timed is
everything from the bytes arriving to the answer written: httptools' parse, our callbacks and
checks, the handler task, the response. Only xllm_async/http/ differs between the two sides: the
other commit's package is loaded beside ours under another name (xllm_async.http_before).

    .venv/bin/python perf/experiments/protocol_cost.py --before d82d72b^ --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import _perf_path  # noqa: E402, F401  (perf/ on sys.path: its tools by name)
import uvloop  # noqa: E402
from cli import cpu_model  # noqa: E402

from xllm_async.http import protocol as current  # noqa: E402

BODY = (b'{"model":"m","messages":[{"role":"user","content":"What is the capital of France?"}],'
        b'"max_tokens":1,"temperature":0}')
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: bench\r\n"
           b"Accept: application/json\r\nContent-Type: application/json\r\nX-Request-Id: abc-123\r\n"
           b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
ANSWER = b'{"id":"x","object":"chat.completion","choices":[]}'


def load_protocol_at(commit: str):
    """xllm_async/http/ as it was at COMMIT, imported as a sibling package of ours (its imports
    from outside http/, such as ..errors, resolve to today's modules); its protocol module."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", commit, "xllm_async/http/"],
                           check=True, capture_output=True, text=True).stdout.split()
    folder = Path(tempfile.mkdtemp(prefix="http-before-"))
    for name in files:
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{name}"],
                                check=True, capture_output=True, text=True).stdout
        (folder / Path(name).name).write_text(source)
    spec = importlib.util.spec_from_file_location("xllm_async.http_before", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return importlib.import_module("xllm_async.http_before.protocol")


class FakeTransport:
    """Enough of asyncio.Transport for one kept-alive connection that is never closed."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        pass


async def handler(request, responder) -> None:
    responder.send(200, ANSWER)


async def per_request_us(module, n: int) -> float:
    done = asyncio.Event()
    count = 0

    def on_response(request, responder) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    proto = module.HttpProtocol(handler, set(), module.HttpLimits(), on_response)
    transport = FakeTransport()
    proto.connection_made(transport)
    start = time.perf_counter()
    for _ in range(n):
        proto.data_received(REQUEST)
        await asyncio.sleep(0)  # the handler task runs and answers; the next request may start
    await done.wait()
    elapsed = time.perf_counter() - start
    assert count == n and transport.written > 0
    return elapsed / n * 1e6


async def run(args) -> None:
    sides = {f"before ({args.before})": load_protocol_at(args.before), "this checkout": current}
    results: dict[str, list[float]] = {name: [] for name in sides}
    for name, module in sides.items():  # warm-up: imports, caches, the allocator
        await per_request_us(module, 2000)
    for round_ in range(args.rounds):
        order = list(sides.items()) if round_ % 2 == 0 else list(reversed(sides.items()))
        for name, module in order:
            results[name].append(await per_request_us(module, args.requests))
    print(f"CPU: {cpu_model()}; Python {platform.python_version()}; uvloop; {args.requests} requests x "
          f"{args.rounds} rounds, order alternating")
    print("| xllm_async/http | us per request, median | rounds |")
    print("|---|---|---|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    before, after = (statistics.median(v) for v in results.values())
    print(f"this / before: {after / before:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="d82d72b^", help="the commit whose xllm_async/http/ to compare with")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    uvloop.install()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
