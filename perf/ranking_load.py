"""Ranking under load (issue 47): many users' /v1/score requests at once, closed loop (a fixed
number of clients, each sending its next user as soon as its answer is back) and open loop
(Poisson arrivals at fractions of the closed loop's rate), with and without the prefix cache.

    .venv/bin/python perf/ranking_load.py                     # tiny random Qwen3, a small table
    .venv/bin/python perf/ranking_load.py --model perf/results/models/qwen3-medium --items 1520000 \
        --candidate-tokens 4 --candidates 100 --clients 1,4 --fractions 0.5,0.8   # issue 47's workload

Every request is a fresh user: a random history of `--history` tokens (never seen, so that no
figure leans on the prefix cache) and `--candidates` item ids drawn from a table of `--items`
random items (perf/ranking.py writes it once), scored by `item_ids`; with `--items 0`, random
token-id candidates of `--candidate-tokens` tokens. The server runs its default scheduler. Each
point reports requests/s, candidates scored a second, and mean / P99 latency. The same candidates
sent as separate `echo` requests cost hundreds of times more a user (perf/ranking.py measures
them one user at a time): under load they would take hours, so they are not repeated here.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import servers
from cli import cpu_model, positive_ints
from ranking import item_table, post, user


def bodies(args, names: list[str], count: int, seed: int) -> list[dict]:
    """count fresh users' /v1/score bodies."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        history, candidates = user(rng, args.history, 0 if names else args.candidates, args.candidate_tokens)
        out.append({"query": history, "item_ids": rng.sample(names, args.candidates)} if names
                   else {"query": history, "items": candidates})
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def closed_loop(port: int, work: list[dict], clients: int) -> tuple[float, list[float]]:
    """(seconds for all of work, each request's latency) with `clients` requests in flight."""
    latencies, lock, todo = [], threading.Lock(), iter(work)

    def client() -> None:
        while True:
            with lock:
                body = next(todo, None)
            if body is None:
                return
            started = time.perf_counter()
            post(port, "/v1/score", body)
            with lock:
                latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, latencies


def open_loop(port: int, work: list[dict], rate: float, seed: int) -> tuple[float, list[float]]:
    """Poisson arrivals at `rate` requests/s, each answered on its own thread."""
    rng = random.Random(seed)

    def one(body: dict, due: float) -> float:
        post(port, "/v1/score", body)
        return time.perf_counter() - due  # from its arrival, so a late send counts too

    futures, started = [], time.perf_counter()
    due = started
    with ThreadPoolExecutor(64) as pool:
        for body in work:
            due += rng.expovariate(rate)
            time.sleep(max(0.0, due - time.perf_counter()))
            futures.append(pool.submit(one, body, due))
        latencies = [f.result() for f in futures]
    return time.perf_counter() - started, latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the tiny random Qwen3, built once)")
    parser.add_argument("--history", type=int, default=1000, help="history tokens of each user")
    parser.add_argument("--candidates", type=int, default=100, help="candidates a request")
    parser.add_argument("--candidate-tokens", type=int, default=4)
    parser.add_argument("--items", type=int, default=10000, help="the item table's size (0: token candidates)")
    parser.add_argument("--requests", type=int, default=24, help="requests a point")
    parser.add_argument("--clients", type=positive_ints, default=[1, 4], help="closed-loop clients, e.g. 1,4")
    parser.add_argument("--fractions", default="0.5,0.8", help="open-loop rates, fractions of the closed loop's best")
    parser.add_argument("--caches", default="off,on", help="prefix-cache settings to run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = servers.ensure_model(args.model)
    table_args, names = item_table(args, model) if args.items else ([], [])
    fractions = [float(f) for f in args.fractions.split(",") if f]
    rows, seed = [], args.seed
    for cache in args.caches.split(","):
        log = servers.server_log("ranking", f"load-cache-{cache}")
        with servers.running_server(servers.server_command(model, ["--prefix-cache", cache, *table_args]), log,
                                    f"cache {cache}") as server:
            for body in bodies(args, names, 2, seed + 999):  # unmeasured: the first requests' shapes
                post(server.port, "/v1/score", body)
            best = 0.0
            for clients in args.clients:
                seed += 1
                seconds, latencies = closed_loop(server.port, bodies(args, names, args.requests, seed), clients)
                best = max(best, len(latencies) / seconds)
                rows.append((cache, f"closed, {clients} clients", seconds, latencies))
                print(f"cache {cache}, {clients} clients: {len(latencies) / seconds:.2f} req/s", file=sys.stderr)
            for fraction in fractions:
                seed += 1
                seconds, latencies = open_loop(server.port, bodies(args, names, args.requests, seed),
                                               fraction * best, seed)
                rows.append((cache, f"open, {fraction:.0%} of {best:.2f} req/s", seconds, latencies))
                print(f"cache {cache}, open {fraction}: mean {statistics.mean(latencies):.3f} s", file=sys.stderr)
    kind = f"{args.candidates} item ids of a {args.items}-item table" if names else \
        f"{args.candidates} token candidates of {args.candidate_tokens} tokens"
    print(f"\nCPU: {cpu_model()}; model {model}; each request a fresh user: {args.history}-token history, {kind}; "
          f"{args.requests} requests a point\n")
    print("| prefix cache | traffic | req/s | candidates/s | mean latency (s) | P99 latency (s) |")
    print("|---|---|---|---|---|---|")
    for cache, traffic, seconds, latencies in rows:
        rate = len(latencies) / seconds
        print(f"| {cache} | {traffic} | {rate:.2f} | {rate * args.candidates:.0f} | "
              f"{statistics.mean(latencies):.3f} | {percentile(latencies, 0.99):.3f} |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except servers.ServerError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
