"""Where one request's time goes at concurrency 1, read off the kernel's clock: which stretch is
work and which is a thread waiting to be woken.

    python perf/trace_c1.py [--model PATH] [--seconds 1.5] [--server-args "..."]

A server (fixed_steps, N=2 by default) and a bench_serving client at concurrency 1 run while
`perf record` takes scheduler and system-call tracepoints of both processes for --seconds. Each
request then splits into the stretches below, and the median of each is printed:

    client writes the request  -> the event loop wakes       (a wake-up)
    the loop wakes             -> it wakes a slot thread     (HTTP, JSON, checks, admission)
    the slot is woken          -> it runs                    (a wake-up)
    the slot runs              -> it signals the loop        (prefill: forward, argmax, detokenise)
    the signal                 -> the loop wakes             (a wake-up)
    the loop wakes             -> the response is written    (delivery, the OpenAI chunk)
    the response is written    -> the client wakes           (loopback, a wake-up)

Needs Linux `perf` with tracepoint access (root here). Nothing is timed from Python, so nothing
is added to the path being measured beyond the tracepoints themselves.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import servers

EVENTS = ("sched:sched_waking", "syscalls:sys_exit_futex", "syscalls:sys_exit_epoll_pwait",
          "syscalls:sys_enter_write")
SEGMENTS = ("client -> loop wake-up", "loop: request to slot", "loop -> slot wake-up", "slot: prefill",
            "slot -> loop wake-up", "loop: tokens to response", "loop -> client wake-up")
WARMUP_REQUESTS = 300  # answered before the trace starts
_LINE = re.compile(r"\s*(\d+)\s+([\d.]+):\s+(\S+):\s*(.*)")
_WOKEN = re.compile(r"pid=(\d+)")
Event = tuple[int, float, str, str]  # thread id, seconds, tracepoint, its details


def parse_events(text: str) -> list[Event]:
    """`perf script -F tid,time,event,trace` lines -> (tid, seconds, event, details)."""
    events = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            events.append((int(match[1]), float(match[2]), match[3], match[4]))
    return events


def split_requests(events: list[Event], loop: int, server_threads: set[int], client: int) -> dict[str, list[float]]:
    """Each complete request's seven stretches in seconds, by name (SEGMENTS).

    A request starts at the client's write and ends when the client's epoll returns after the
    loop's response write; one that the trace cut short, or that did not follow the path (a slot
    already awake, say), is left out rather than guessed at."""
    found: dict[str, list[float]] = {name: [] for name in SEGMENTS}
    marks: dict[str, float] = {}
    slot = 0
    for tid, at, event, details in events:
        woke = event == "syscalls:sys_exit_epoll_pwait" and details.strip() not in ("0x0", "0")
        if tid == client and event == "syscalls:sys_enter_write":
            marks, slot = {"sent": at}, 0
        elif tid == loop and woke and "sent" in marks and "loop" not in marks:
            marks["loop"] = at
        elif tid == loop and event == "sched:sched_waking" and "loop" in marks and "submit" not in marks:
            woken = _WOKEN.search(details)
            if woken and int(woken[1]) in server_threads and int(woken[1]) != loop:
                marks["submit"], slot = at, int(woken[1])
        elif tid == slot and event == "syscalls:sys_exit_futex" and "submit" in marks and "slot" not in marks:
            marks["slot"] = at
        elif tid == slot and event == "syscalls:sys_enter_write" and "slot" in marks and "signal" not in marks:
            marks["signal"] = at
        elif tid == loop and woke and "signal" in marks and "loop2" not in marks:
            marks["loop2"] = at
        elif tid == loop and event == "syscalls:sys_enter_write" and "loop2" in marks and "reply" not in marks:
            marks["reply"] = at
        elif tid == client and woke and "reply" in marks:
            order = ("sent", "loop", "submit", "slot", "signal", "loop2", "reply")
            times = [marks[k] for k in order] + [at]
            for name, start, end in zip(SEGMENTS, times, times[1:]):
                found[name].append(end - start)
            marks = {}
    return found


def format_table(found: dict[str, list[float]]) -> str:
    count = min(len(v) for v in found.values())
    if not count:
        return "no complete request in the trace (0)"
    medians = {name: statistics.median(found[name]) * 1e6 for name in SEGMENTS}
    lines = [f"{count} requests traced; medians in microseconds", f"{'stretch':28s} {'median':>9s} {'mean':>9s}"]
    lines += [f"{name:28s} {medians[name]:9.1f} {statistics.mean(found[name]) * 1e6:9.1f}" for name in SEGMENTS]
    total = sum(medians.values())
    prefill = medians["slot: prefill"]
    wakes = sum(medians[name] for name in SEGMENTS if "wake-up" in name)
    lines.append(f"{'sum of medians':28s} {total:9.1f}")
    lines.append(f"beyond the prefill: {total - prefill:.1f} us ({(total - prefill) / prefill:.1%} of it), "
                 f"of which wake-ups {wakes:.1f} us")
    return "\n".join(lines)


def wait_for_answers(port: int, client: subprocess.Popen, count: int) -> None:
    """Returns once the server has answered `count` generation requests (the client builds its prompts
    first, which takes a while, and the first requests warm up); raises if the client stops first."""
    while servers.scrape_metrics(port).get("xllm:e2e_request_latency_seconds_count", 0.0) < count:
        if client.poll() is not None:
            raise servers.ServerError(f"the client exited with {client.returncode} before the trace")
        time.sleep(0.2)


def threads_of(pid: int) -> set[int]:
    return {int(tid) for tid in os.listdir(f"/proc/{pid}/task")}


def trace(args: argparse.Namespace) -> str:
    model = servers.ensure_model(args.model)
    command = servers.server_command(model, shlex.split(args.server_args))
    with servers.running_server(command, servers.server_log("trace", "server")) as server, \
            tempfile.TemporaryDirectory() as folder:
        client = subprocess.Popen(
            [sys.executable, os.path.join(servers.PERF_DIR, "bench_serving.py"), "--base-url", server.base_url,
             "--model-path", model, "--random-input", str(args.input_len), "--random-output", "1",
             "--max-concurrency", "1", "--num-prompts", str(args.num_prompts)],
            cwd=servers.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_answers(server.port, client, WARMUP_REQUESTS)
            data = os.path.join(folder, "perf.data")
            subprocess.run(["perf", "record", "-q", "-e", ",".join(EVENTS), "-p", f"{server.pid},{client.pid}",
                            "-o", data, "--", "sleep", str(args.seconds)], check=True, capture_output=True)
            server_threads = threads_of(server.pid)
        finally:
            client.terminate()
            client.wait()
        script = subprocess.run(["perf", "script", "-i", data, "-F", "tid,time,event,trace"], check=True,
                                capture_output=True, text=True).stdout
    return format_table(split_requests(parse_events(script), server.pid, server_threads, client.pid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the tiny random Qwen3, built once)")
    parser.add_argument("--server-args", default="--scheduler fixed_steps --concurrent-execute-stream-num 2")
    parser.add_argument("--input-len", type=int, default=320)
    parser.add_argument("--seconds", type=float, default=1.5, help="how long perf records")
    parser.add_argument("--num-prompts", type=int, default=3000,
                        help="the client's prompts: enough to outlast the warm-up and the trace")
    args = parser.parse_args(argv)
    try:
        print(trace(args))
    except subprocess.CalledProcessError as exc:  # perf itself: missing rights, or no tracepoints
        print(f"trace_c1: {' '.join(exc.cmd[:2])} failed: {(exc.stderr or b'').strip()[-500:]!r}", file=sys.stderr)
        return 1
    except (servers.ServerError, OSError) as exc:  # OSError: no perf, or the server went away
        print(f"trace_c1: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
