"""Users whose histories grow, served as beam searches (issue 37's recommendation case), with the
prefix cache off and on: one client, the users' requests in turn, each a user's history plus a few
new tokens. Prints each server's median latency (after each user's first request, which no cache
helps), the cached tokens its last answer reported, and whether both servers answered alike.

    .venv/bin/python perf/experiments/growing_history.py                  # medium model, 2 users, 2,000 + 20 a request
    .venv/bin/python perf/experiments/growing_history.py --users 4 --requests 6 --growth 30

A first slice of the measurement: one client, closed loop (the open-loop workload with many
clients is issue 37's next step).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import servers


def post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(servers.HOST, port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium", help="random Qwen3 size (xllm_async.random_model SIZES)")
    parser.add_argument("--users", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8, help="requests a user")
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--growth", type=int, default=20, help="new tokens a request")
    parser.add_argument("--beam-width", type=int, default=32)
    args = parser.parse_args()
    model = servers.ensure_random_model(args.size)
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(200, 150000) for _ in range(n)]

    histories = [tokens(args.history) for _ in range(args.users)]
    growth = [[tokens(args.growth) for _ in range(args.requests)] for _ in range(args.users)]
    results = {}
    for cache in ("off", "on"):
        os.environ["XLLM_PREFIX_CACHE"] = cache  # (the server inherits it)
        log = servers.server_log("growing_history", f"cache-{cache}")
        with servers.running_server(servers.server_command(model, ["--kv-cache-bytes", "4G"]), log) as server:
            seconds, answers, cached = [], [], None
            history = [list(h) for h in histories]
            for step in range(args.requests):
                for user in range(args.users):
                    history[user] += growth[user][step]
                    began = time.perf_counter()
                    status, body = post(server.port, {"prompt": history[user], "beam_width": args.beam_width,
                                                      "num_return_sequences": 4, "max_tokens": 3})
                    seconds.append(time.perf_counter() - began)
                    if status != 200:
                        raise SystemExit(f"{status}: {body}")
                    answers.append(body["choices"])
                    cached = body["usage"].get("prompt_tokens_details")
            results[cache] = (seconds, answers, cached)
    for cache, (seconds, _, cached) in results.items():
        print(f"cache {cache:3}: median {statistics.median(seconds[args.users:]) * 1e3:7.1f} ms, first requests "
              f"{', '.join(f'{s * 1e3:.0f}' for s in seconds[:args.users])} ms; last answer's details: {cached}")
    print("the same answers:", results["on"][1] == results["off"][1])


if __name__ == "__main__":
    main()
