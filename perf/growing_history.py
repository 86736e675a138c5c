"""Users whose histories grow (issue 37's recommendation workload): every request is a user's
history plus a few new tokens, served as a beam search, against servers with the prefix cache off
and on (or any --config), fresh servers, configurations interleaved round by round.

Each server first answers every user's first request (unmeasured: no cache can help a history it
has never seen; the same for every configuration), then:
- closed loop: --clients clients, each sending its own users' next requests one after another
  (a user's requests never overlap); requests/s and mean / P99 latency;
- open loop (--fractions): Poisson arrivals at those fractions of the first configuration's
  closed-loop requests/s, users in turn (a user's next request comes --users requests later);
  mean / P99 latency at each rate. A beam search answers at once: its TTFT is its latency.
Answers are compared across configurations (choices: token ids and scores).

    .venv/bin/python perf/growing_history.py                     # medium model, 16 users, 8 clients
    .venv/bin/python perf/growing_history.py --rounds 2 --fractions 0.5,0.8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time

import bench_serving as bench
import servers
from cli import cpu_model, positive_floats
from sweep import parse_configs

DEFAULT_CONFIGS = ["off=--prefix-cache off", "on=--prefix-cache on"]


class Workload:
    """Every user's history and the growth of each of their requests (the same for every server)."""

    def __init__(self, args: argparse.Namespace, vocab: list[int]) -> None:
        rng = random.Random(args.seed)
        self.users = [rng.choices(vocab, k=args.history) for _ in range(args.users)]
        self.growth = [[rng.choices(vocab, k=args.growth) for _ in range(args.requests)] for _ in self.users]
        self.extra = {"beam_width": args.beam_width, "num_return_sequences": args.returned, "max_tokens": args.tokens}

    def body(self, user: int, step: int) -> bytes:
        """The user's request at this step: history plus the growth of steps 0..step."""
        prompt = self.users[user] + [t for part in self.growth[user][:step + 1] for t in part]
        return json.dumps({"prompt": prompt, **self.extra}).encode()


async def send(port: int, body: bytes) -> tuple[float, object]:
    conn = bench.HttpConnection(servers.HOST, port)
    try:
        result = await bench.send_request(conn, "/v1/completions", body, 0, chat=False, stream=False)
    finally:
        conn.close()
    if not result.success:
        raise SystemExit(f"request failed: {result.error}")
    return result.latency, result.choices


async def first_requests(port: int, work: Workload, clients: int) -> None:
    queue = list(range(len(work.users)))

    async def client() -> None:
        while queue:
            await send(port, work.body(queue.pop(), 0))
    await asyncio.gather(*(client() for _ in range(clients)))


async def closed_loop(port: int, work: Workload, clients: int, steps: range) -> tuple[dict, dict]:
    """Each client sends its users' requests of each step in turn."""
    latencies, answers = [], {}

    async def client(own: list[int]) -> None:
        for step in steps:
            for user in own:
                latency, choices = await send(port, work.body(user, step))
                latencies.append(latency)
                answers[user, step] = choices
    began = time.perf_counter()
    await asyncio.gather(*(client(list(range(c, len(work.users), clients))) for c in range(clients)))
    return figures(latencies, time.perf_counter() - began), answers


async def open_loop(port: int, work: Workload, rate: float, steps: range, seed: int) -> tuple[dict, dict]:
    """Poisson arrivals at `rate`, users in turn; every request sent when it arrives."""
    rng, latencies, answers, tasks = random.Random(seed), [], {}, []

    async def one(user: int, step: int) -> None:
        latency, choices = await send(port, work.body(user, step))
        latencies.append(latency)
        answers[user, step] = choices
    began, arrival = time.perf_counter(), 0.0
    for step in steps:
        for user in range(len(work.users)):
            await asyncio.sleep(max(0.0, began + arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(one(user, step)))
            arrival += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return figures(latencies, time.perf_counter() - began), answers


def figures(latencies: list[float], seconds: float) -> dict:
    ordered = sorted(latencies)
    return {"requests": len(ordered), "req_s": len(ordered) / seconds, "mean_ms": statistics.fmean(ordered) * 1e3,
            "p99_ms": ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] * 1e3}


def run_config(model: str, flags: list[str], name: str, work: Workload, args: argparse.Namespace,
               rates: list[float] | None) -> tuple[dict, dict, list[float]]:
    """One fresh server: first requests, the closed loop, then each open-loop rate (steps apart);
    rates None: --fractions of this server's closed-loop req/s."""
    log = servers.server_log("growing_history", name)
    command = servers.server_command(model, ["--kv-cache-bytes", args.kv_cache_bytes, *flags])
    rows, answers = {}, {}
    with servers.running_server(command, log) as server:
        asyncio.run(first_requests(server.port, work, args.clients))
        closed_steps = range(1, 1 + args.closed_steps)
        rows["closed"], answers["closed"] = asyncio.run(closed_loop(server.port, work, args.clients, closed_steps))
        start = closed_steps.stop
        if rates is None:
            rates = [f * rows["closed"]["req_s"] for f in args.fractions]
        for rate in rates:
            steps = range(start, start + args.open_steps)
            rows[f"open {rate:.2f}/s"], answers[rate] = asyncio.run(open_loop(server.port, work, rate, steps, 1))
            start = steps.stop
    return rows, answers, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: the random Qwen3 of --size)")
    parser.add_argument("--size", default="medium", help="random Qwen3 size (xllm_async.testing.random_model SIZES)")
    parser.add_argument("--config", action="append", help=f"name=server flags (default {DEFAULT_CONFIGS})")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--growth", type=int, default=20, help="new tokens a request")
    parser.add_argument("--closed-steps", type=int, default=2, help="requests a user in the closed loop")
    parser.add_argument("--open-steps", type=int, default=2, help="requests a user at each open-loop rate")
    parser.add_argument("--fractions", type=positive_floats, default=[0.5],
                        help="open-loop rates, as fractions of the first configuration's closed-loop req/s")
    parser.add_argument("--beam-width", type=int, default=32)
    parser.add_argument("--returned", type=int, default=4, help="num_return_sequences")
    parser.add_argument("--tokens", type=int, default=3, help="beam rounds (max_tokens)")
    parser.add_argument("--kv-cache-bytes", default="4G")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.requests = 1 + args.closed_steps + args.open_steps * len(args.fractions)
    model = args.model or servers.ensure_random_model(args.size)
    configs = parse_configs(args.config or DEFAULT_CONFIGS)
    work = Workload(args, bench.ordinary_token_ids(bench.load_tokenizer(model)))
    print(f"{cpu_model()}; {model}; {args.users} users, {args.history}-token histories +{args.growth} a request, "
          f"beam {args.beam_width}, {args.tokens} rounds, {args.clients} clients", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in configs}
    reference = None
    rates = None  # set by the first configuration's first closed loop
    for round_index in range(args.rounds):
        names = list(configs) if round_index % 2 == 0 else list(configs)[::-1]
        for name in names:
            rows, answers, rates = run_config(model, configs[name], name, work, args, rates)
            results[name].append(rows)
            reference = reference or answers
            same = all(answers[key] == reference[key] for key in reference if key in answers)
            print(f"round {round_index + 1} {name}: " + "; ".join(
                f"{point} {row['req_s']:.2f} req/s mean {row['mean_ms']:.0f} P99 {row['p99_ms']:.0f} ms"
                for point, row in rows.items()) + f"; answers as the first: {same}", flush=True)
    baseline = list(configs)[0]
    print(f"\n{'config':10} {'point':16} {'req/s':>8} {'mean ms':>9} {'P99 ms':>9}   vs {baseline}: req/s, mean")
    for name, runs in results.items():
        for point in runs[0]:
            med = {k: statistics.median(r[point][k] for r in runs) for k in ("req_s", "mean_ms", "p99_ms")}
            base = {k: statistics.median(r[point][k] for r in results[baseline]) for k in ("req_s", "mean_ms")}
            print(f"{name:10} {point:16} {med['req_s']:8.2f} {med['mean_ms']:9.1f} {med['p99_ms']:9.1f}   "
                  f"{med['req_s'] / base['req_s']:.2f}x {med['mean_ms'] / base['mean_ms']:.2f}x")


if __name__ == "__main__":
    main()
