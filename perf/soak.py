"""Soak: thousands of requests at high concurrency, a share of clients that
vanish at random points, against each scheduler; then proof that nothing leaked.

    python perf/soak.py --requests 3000 --concurrency 64 --disconnect-share 0.2

For each server configuration (started here, or --base-url for a running one):
1. reference answers: a small set of prompts (token ids, mixed lengths and
   max_tokens, greedy, some streamed) is answered one at a time;
2. load: `--requests` requests drawn from that set at `--concurrency`; a share
   of the clients disconnect at a random point (mid request, after sending,
   or mid-stream);
3. checks: every request that completed got exactly its reference answer;
   after each round the server's counters show no waiting or running sequence,
   no busy slot and no open connection but ours; resident memory after the
   last round is within `--rss-growth` of after the first.
Exits 1 if any check fails. Traffic goes to loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import servers

CONFIGS = {
    "fixed_steps-N2": ["--scheduler", "fixed_steps", "--concurrent-execute-stream-num", "2"],
    "continuous-N1": ["--scheduler", "continuous", "--concurrent-execute-stream-num", "1"],
}


# --- a minimal HTTP/1.1 client over asyncio streams (one request per connection) ---

async def exchange(port: int, body: dict, vanish: str | None, rng: random.Random) -> tuple[int, bytes] | None:
    """POST /v1/completions; None when this client vanishes on purpose."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-length: {len(payload)}\r\n"
               f"connection: close\r\n\r\n").encode() + payload
    try:
        if vanish == "mid-request":
            writer.write(request[: rng.randrange(1, len(request))])
            await writer.drain()
            return None
        writer.write(request)
        await writer.drain()
        if vanish == "after-sending":
            await asyncio.sleep(rng.random() * 0.02)
            return None
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if vanish == "mid-stream":
            await reader.read(rng.randrange(1, 400))
            return None
        data = await reader.read()  # connection: close -> the body runs to EOF
        return status, _dechunk(data) if b"transfer-encoding: chunked" in head.lower() else data
    finally:
        writer.close()


def _dechunk(data: bytes) -> bytes:
    out = []
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out.append(rest[:size])
        data = rest[size + 2:]
    return b"".join(out)


class Broken(str):
    """An answer that is not a completion (an error status, a cut stream); never equals a reference."""

    def __eq__(self, other) -> bool:
        return False

    __hash__ = str.__hash__


def answer_of(status: int, body: bytes, stream: bool) -> str:
    """The text of an answer, or a Broken describing what went wrong."""
    if status != 200:
        return Broken(f"HTTP {status}: {body[:200]!r}")
    if not stream:
        choices = json.loads(body)["choices"]
        if len(choices) > 1:  # a beam search: every returned sequence, best first
            return " | ".join(str(c["token_ids"]) for c in choices)
        return choices[0]["text"]
    events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return Broken("stream without [DONE]")
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])


def make_requests(rng: random.Random, count: int, max_prompt: int, beam_share: float = 0.0) -> list[dict]:
    """Mixed lengths, greedy, half streamed; a `beam_share` of them beam searches (recommendation:
    beam_width 4-16, every beam returned, 3 rounds; never streamed)."""
    lengths = sorted({8, 40, max_prompt // 2, max_prompt})
    bodies = []
    for _ in range(count):
        prompt = [rng.randrange(200, 150000) for _ in range(rng.choice(lengths))]
        if rng.random() < beam_share:
            width = rng.choice([4, 8, 16])
            bodies.append({"prompt": prompt, "max_tokens": 3, "beam_width": width, "num_return_sequences": width,
                           "stream": False})
        else:
            bodies.append({"prompt": prompt, "max_tokens": rng.choice([1, 1, 2, 8, 32]), "temperature": 0,
                           "ignore_eos": True, "stream": rng.random() < 0.5})
    return bodies


async def load(port: int, bodies: list[dict], references: list[str], total: int, concurrency: int,
               disconnect_share: float, seed: int) -> dict:
    rng = random.Random(seed)
    plan = [(rng.randrange(len(bodies)), rng.choice(["mid-request", "after-sending", "mid-stream"])
             if rng.random() < disconnect_share else None) for _ in range(total)]
    counts = {"completed": 0, "correct": 0, "vanished": 0, "wrong": 0, "errors": 0, "busy_answers": 0}
    first_wrong: list[str] = []
    queue = iter(plan)

    async def worker() -> None:
        for index, vanish in queue:
            try:
                result = await exchange(port, bodies[index], vanish, rng)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                counts["errors"] += 1
                first_wrong.append(f"connection error: {exc!r}")
                continue
            if result is None:
                counts["vanished"] += 1
                continue
            counts["completed"] += 1
            status, body = result
            if status == 503:  # overload answers are allowed; they must be clean 503s
                counts["busy_answers"] += 1
                continue
            got = answer_of(status, body, bodies[index]["stream"])
            if got == references[index]:
                counts["correct"] += 1
            else:
                counts["wrong"] += 1
                first_wrong.append(f"request {index}: expected {references[index]!r}, got {got!r}")

    started = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    counts["seconds"] = round(time.perf_counter() - started, 2)
    counts["first_problem"] = first_wrong[0] if first_wrong else ""
    return counts


# How long an idle server is given before its memory is read: it hands freed heap pages back once
# it has been idle for a whole second (service.py, TRIM_TICK), so what is read is what it holds,
# not what the last seconds of load happened to leave behind.
IDLE_SECONDS = 2.5


async def settle(port: int, idle_seconds: float = IDLE_SECONDS, timeout: float = 30.0) -> dict[str, float]:
    """Wait until the server is idle again (or the timeout), give it idle_seconds, and return its
    counters."""
    deadline = time.monotonic() + timeout
    while True:
        values = servers.scrape_metrics(port)
        idle = (values["xllm:num_requests_waiting"] == 0 and values["xllm:num_requests_running"] == 0
                and values["xllm:slots_busy"] == 0 and values["xllm:http_connections_open"] <= 1)
        if time.monotonic() > deadline:
            return values
        if idle:
            if not idle_seconds:
                return values
            await asyncio.sleep(idle_seconds)
            return servers.scrape_metrics(port)
        await asyncio.sleep(0.2)


async def soak(port: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    bodies = make_requests(rng, args.distinct, args.max_prompt, args.beam_share)
    references = []
    for body in bodies:  # one at a time: no batching can influence the reference
        status, data = await exchange(port, body, None, rng)
        references.append(answer_of(status, data, body["stream"]))
    broken = [r for r in references if isinstance(r, Broken)]
    if broken:
        raise SystemExit(f"reference request failed: {broken[0]}")
    rounds = []
    for round_index in range(args.rounds):  # memory after the last round is compared with after round 1
        counts = await load(port, bodies, references, args.requests // args.rounds, args.concurrency,
                            args.disconnect_share, args.seed + round_index)
        counters = await settle(port, args.idle_seconds)
        counts["rss_mb"] = round(counters.get("xllm:process_resident_memory_bytes", 0) / 2**20, 1)
        counts["leaks"] = {k: counters[k] for k in ("xllm:num_requests_waiting", "xllm:num_requests_running",
                                                    "xllm:slots_busy", "xllm:http_connections_open")}
        rounds.append(counts)
    return {"rounds": rounds}


def verdict(result: dict, rss_growth: float) -> list[str]:
    problems = []
    for i, r in enumerate(result["rounds"], 1):
        if r["wrong"] or r["errors"]:
            problems.append(f"round {i}: {r['wrong']} wrong, {r['errors']} errors; {r['first_problem']}")
        if r["correct"] == 0:
            problems.append(f"round {i}: no request completed correctly")
        leaks = {k: v for k, v in r["leaks"].items() if v > (1 if k.endswith("connections_open") else 0)}
        if leaks:
            problems.append(f"round {i}: leaked {leaks}")
    # Round 1 warms the allocator and the caches up; growth after it would be a leak.
    first, last = result["rounds"][0]["rss_mb"], result["rounds"][-1]["rss_mb"]
    if first and last > first * (1 + rss_growth):
        problems.append(f"resident memory grew from {first} MB to {last} MB")
    return problems


def soak_new_server(name: str, extra: list[str], args: argparse.Namespace) -> dict:
    """The soak against a server started for it, stopped afterwards; its log in perf/results/soak/."""
    command = servers.server_command(servers.ensure_model(args.model), ["--max-connections", "4096", *extra])
    with servers.running_server(command, servers.server_log("soak", name), name) as server:
        return asyncio.run(soak(server.port, args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="requests per configuration, over the rounds")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of load; memory is compared after each")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--disconnect-share", type=float, default=0.2)
    parser.add_argument("--distinct", type=int, default=24, help="distinct prompts (each with its reference)")
    parser.add_argument("--max-prompt", type=int, default=300, help="longest prompt (max_tokens is up to 32)")
    parser.add_argument("--beam-share", type=float, default=0.0,
                        help="share of the distinct prompts that are beam searches (fixed_steps only)")
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS,
                        help="how long the server is left idle after each round before its memory is read")
    parser.add_argument("--rss-growth", type=float, default=0.10, help="allowed growth of resident memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model folder (default: a tiny random Qwen3 built once)")
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS), help="default: both")
    parser.add_argument("--base-url-port", type=int, help="soak a server already running on this loopback port")
    parser.add_argument("--output-file", help="append the figures as JSON lines")
    args = parser.parse_args(argv)
    targets = [("running", None)] if args.base_url_port else [(c, CONFIGS[c]) for c in args.config or CONFIGS]
    failed = False
    for name, extra in targets:
        if extra is None:
            result = asyncio.run(soak(args.base_url_port, args))
        else:
            try:
                result = soak_new_server(name, extra, args)
            except servers.ServerError as exc:
                print(f"soak: {exc}", file=sys.stderr)
                return 1
        problems = verdict(result, args.rss_growth)
        failed |= bool(problems)
        result.update(config=name, requests=args.requests, concurrency=args.concurrency,
                      disconnect_share=args.disconnect_share, problems=problems)
        print(json.dumps(result, indent=1))
        print(f"{name}: {'FAIL' if problems else 'ok'}" + "".join(f"\n  - {p}" for p in problems))
        if args.output_file:
            with open(args.output_file, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
