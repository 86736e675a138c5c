"""Python calls per served request, in the server's own threads (issue 50's speed guard): counts,
unlike wall-clock, do not move when another process shares the cores.

    .venv/bin/python perf/experiments/request_calls.py [--checkout DIR] [--requests 2000]

Runs Service from DIR (default: this checkout) in this process on uvloop, warms it up, then
turns on one cProfile per server thread (the loop's, each slot's) and drives it from a client
subprocess: streamed completions of --input random token ids, --output tokens, --concurrency
connections, as perf/sweep.py's workload. Prints each thread's calls per request, its profiled
time per request, and the functions with the most calls per request (--top).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def client(model: str, port: int, n: int, concurrency: int, length: int, output: int, vocab: int) -> None:
    """N streamed completions over keep-alive connections; reads each answer to its end."""
    import orjson

    rng = random.Random(0)
    bodies = [orjson.dumps({"model": model, "prompt": [rng.randrange(100, vocab) for _ in range(length)],
                            "max_tokens": output, "temperature": 0.0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) for _ in range(64)]
    todo = list(range(n))

    async def one_connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while todo:
            body = bodies[todo.pop() % len(bodies)]
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            while True:  # chunked: size line, data, CRLF; the last chunk is 0
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        writer.close()

    async def main() -> None:
        await asyncio.gather(*(one_connection() for _ in range(concurrency)))

    asyncio.run(main())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve(args) -> None:
    from xllm_async.config import load_settings
    from xllm_async.service import Service

    settings = load_settings(["--model", args.model, "--access-log", "off", "--port", str(free_port()),
                              *args.server_args])
    service = Service(settings)
    await service.start()
    port = service.http.port
    vocab = service.runner.vocab_size

    async def drive(n: int) -> float:
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", service.name, str(port), str(n), str(args.concurrency),
            str(args.input), str(args.output), str(vocab))
        assert await proc.wait() == 0
        return time.perf_counter() - started

    await drive(args.warmup)
    if args.cpu:
        await cpu_only(args, service, drive)
        return
    profiles = {"loop": cProfile.Profile()}
    for slot in service.slots:
        profiles[f"slot-{slot.index}"] = cProfile.Profile()
    for slot in service.slots:  # (a blocking call from the loop: nothing else runs yet)
        slot.call(profiles[f"slot-{slot.index}"].enable)
    profiles["loop"].enable()
    seconds = await drive(args.requests)
    profiles["loop"].disable()
    for slot in service.slots:
        slot.call(profiles[f"slot-{slot.index}"].disable)
    await service.shutdown()
    n = args.requests
    print(f"checkout {args.checkout}: {n} requests in {seconds:.2f} s ({n / seconds:.0f} req/s under the profiler)")
    for name, prof in profiles.items():
        stats = pstats.Stats(prof)
        calls = sum(row[1] for row in stats.stats.values())
        print(f"  {name:7s} {calls / n:9.1f} calls/request  {stats.total_tt / n * 1e6:8.1f} us/request profiled")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][1])[:args.top]
        for (path, line, func), (cc, nc, tt, ct, _) in rows:
            where = path.replace(args.checkout, "").lstrip("/")
            print(f"      {nc / n:8.2f} calls {tt / n * 1e6:7.2f} us own {ct / n * 1e6:8.2f} us cum  "
                  f"{where}:{line}({func})")
        if args.dump:
            stats.dump_stats(f"{args.dump}.{name}.prof")


def thread_cpu() -> dict[str, float]:
    """Seconds of CPU (user + system) per thread of this process, by thread name."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    names[os.getpid()] = "loop"
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = names.get(int(tid), "other")
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


async def cpu_only(args, service, drive) -> None:
    """No profiler: each thread's CPU time a request, the batches run, the throughput."""
    shares = {True: 0, False: 0}  # the slots' share_cores(alone) calls: how often a batch took every core
    kind = type(service.slots[0].binding)  # (a class with __slots__: wrapped on the class)
    plain = kind.share_cores

    def counted(binding, alone: bool) -> None:
        shares[alone] += 1
        plain(binding, alone)

    kind.share_cores = counted
    collections = [[0, 0.0, 0.0] for _ in range(3)]  # per generation: count, seconds, start

    def collected(phase: str, info: dict) -> None:
        entry = collections[info["generation"]]
        if phase == "start":
            entry[2] = time.perf_counter()
        else:
            entry[0] += 1
            entry[1] += time.perf_counter() - entry[2]

    import gc
    gc.callbacks.append(collected)
    # The loop's and the slots' own clocks (nanoseconds; /proc ticks in 10 ms), read on each thread.
    clocks = [time.thread_time()] + [slot.call(time.thread_time) for slot in service.slots]
    before, batches = thread_cpu(), sum(s.batches_run for s in service.slots)
    seconds = await drive(args.requests)
    after, batches = thread_cpu(), sum(s.batches_run for s in service.slots) - batches
    clocks = [time.thread_time() - clocks[0]] + [slot.call(time.thread_time) - c
                                                  for slot, c in zip(service.slots, clocks[1:])]
    await service.shutdown()
    n = args.requests
    used = {name: after[name] - before.get(name, 0.0) for name in after}
    busy = {name: t for name, t in used.items() if t > 0.001}
    print(f"cpu {os.path.basename(args.checkout)}: {n / seconds:.0f} req/s, {n / batches:.1f} requests a batch, "
          f"thread_time us/request: loop {clocks[0] / n * 1e6:.1f} "
          + " ".join(f"slot-{i} {c / n * 1e6:.1f}" for i, c in enumerate(clocks[1:]))
          + f"; CPU us/request (/proc): total {sum(used.values()) / n * 1e6:.0f} "
          + " ".join(f"{name.split(':')[0].removeprefix('xllm-')}={t / n * 1e6:.0f}"
                   for name, t in sorted(busy.items()))
          + f"; every core {shares[True] / max(1, shares[True] + shares[False]):.0%} of "
            f"{(shares[True] + shares[False]) / batches:.1f} share_cores a batch; gc "
          + " ".join(f"gen{g} {c / n * 1000:.1f}/1000 req {t / n * 1e6:.1f} us/req"
                     for g, (c, t, _) in enumerate(collections)), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client(sys.argv[2], *(int(v) for v in sys.argv[3:9]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", default=ROOT)
    parser.add_argument("--model", default=os.path.join(ROOT, "perf/results/models/qwen3-tiny"))
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input", type=int, default=320)
    parser.add_argument("--output", type=int, default=1)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--cpu", action="store_true", help="no profiler: CPU time per thread a request")
    parser.add_argument("--dump", default="", help="write each thread's pstats to DUMP.THREAD.prof")
    parser.add_argument("server_args", nargs="*", help="server flags after --")
    args = parser.parse_args()
    args.checkout = os.path.abspath(args.checkout)
    sys.path.insert(0, args.checkout)
    import uvloop

    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
