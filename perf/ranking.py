"""Ranking (issue 47): a user's candidates scored in one /v1/score request against one copy of
their history, side by side with the same candidates sent as separate echo scoring requests.

    .venv/bin/python perf/ranking.py                          # tiny random Qwen3, 3 users, cache off and on
    .venv/bin/python perf/ranking.py --model perf/results/models/qwen3-medium --users 5 --candidates 100,1000
    .venv/bin/python perf/ranking.py --model perf/results/models/qwen3-medium --candidate-tokens 4 \
        --items 1520000 --candidates 100,1000 --echo-max 0 --caches off   # issue 47's workload

For each prefix-cache setting ("off", "on") a fresh server (fixed_steps, N=1: one batch at a
time, so that the figures are the requests' own), then per user a fresh random history of
`--history` tokens (fresh, so that no figure leans on an earlier request's cache) and
`--candidates` random candidates of `--candidate-tokens` tokens:
- prefill: one completion of 1 token on the history alone (what the history's prefill costs);
- score: one /v1/score request with the candidates as token ids (each one's summed log-probability);
- echo: each candidate as its own /v1/completions request on history + candidate (`echo`,
  `max_tokens` 0, `logprobs` 0: every prompt token's log-probability), `--echo-clients` at a
  time, the candidate's score summed from its last tokens'. Only with `--echo` up to
  `--echo-max` candidates (sending 1,000 histories of 1,000 tokens takes long on a small CPU).
- items (with `--items N`): the server loads a table of N random items of `--candidate-tokens`
  codebooks of 256 codes (written once into perf/results/ranking/), and the same count of the
  table's items is scored by `item_ids` (each normalised over the table's tokens, as the
  constrained beam search scores them: the LM head over a depth's few hundred tokens only).
Each figure is the median over the users; `max |diff|` is the largest difference between a
candidate's /v1/score answer and its echo one (the same model, the same numbers up to float noise).
The markdown table is printed, naming the CPU. Never a final figure on a machine others use.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import bench_serving as bench
import orjson
import servers
from cli import cpu_model, positive_ints


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://{servers.HOST}:{port}{path}", orjson.dumps(body),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as answer:
        return orjson.loads(answer.read())


def timed(fn, *args):
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


def user(rng: random.Random, history: int, count: int, tokens: int) -> tuple[list[int], list[list[int]]]:
    return ([rng.randrange(200, 150000) for _ in range(history)],
            [[rng.randrange(200, 150000) for _ in range(tokens)] for _ in range(count)])


def echo_scores(port: int, history: list[int], candidates: list[list[int]], clients: int) -> list[float]:
    def one(candidate: list[int]) -> float:
        body = {"prompt": history + candidate, "max_tokens": 0, "echo": True, "logprobs": 0}
        logprobs = post(port, "/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"]
        return sum(logprobs[len(history):])

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, candidates))


def item_table(args, model: str) -> tuple[list[str], list[str]]:
    """The server flag that loads a table of args.items random items, and their ids."""
    from transformers import AutoTokenizer

    codes = 256
    base = bench.item_token_base(AutoTokenizer.from_pretrained(model), args.candidate_tokens * codes)
    table = bench.make_item_table(args.items, args.candidate_tokens, codes, base, args.seed)
    path = servers.server_log("ranking", f"items-{args.items}x{args.candidate_tokens}x{codes}")[:-4] + ".tsv"
    bench.write_item_table(path, table, f"{args.items} items (perf/ranking.py)")
    return ["--item-table", path], list(table.items.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the tiny random Qwen3, built once)")
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument("--history", type=int, default=1000, help="history tokens of each user")
    parser.add_argument("--candidates", type=positive_ints, default=[100], help="candidates a request, e.g. 100,1000")
    parser.add_argument("--candidate-tokens", type=int, default=3)
    parser.add_argument("--caches", default="off,on", help="prefix-cache settings to run: off, on or both")
    parser.add_argument("--echo", action=argparse.BooleanOptionalAction, default=True,
                        help="also send the candidates as separate echo requests")
    parser.add_argument("--echo-max", type=int, default=100, help="largest candidate count also sent as echo")
    parser.add_argument("--echo-clients", type=int, default=8, help="echo requests in flight at once")
    parser.add_argument("--items", type=int, default=0, help="also score this many-item table's items (0: not)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = servers.ensure_model(args.model)
    table_args, names = item_table(args, model) if args.items else ([], [])
    rows = []
    for cache in args.caches.split(","):
        env_args = ["--scheduler", "fixed_steps", "--concurrent-execute-stream-num", "1",
                    "--prefix-cache", cache, *table_args]
        log = servers.server_log("ranking", f"cache-{cache}")
        with servers.running_server(servers.server_command(model, env_args), log, f"cache {cache}") as server:
            rng = random.Random(args.seed)
            warm_history, warm_candidates = user(rng, args.history, 4, args.candidate_tokens)
            post(server.port, "/v1/score", {"query": warm_history, "items": warm_candidates})  # unmeasured
            if names:  # (and the first item request's shapes, so that no figure carries them)
                post(server.port, "/v1/score", {"query": warm_history, "item_ids": rng.sample(names, 4)})
            for count in args.candidates:
                prefill, score, echo, diffs, items = [], [], [], [], []
                for _ in range(args.users):
                    history, candidates = user(rng, args.history, count, args.candidate_tokens)
                    seconds, _ = timed(post, server.port, "/v1/completions", {"prompt": history, "max_tokens": 1})
                    prefill.append(seconds)
                    history, candidates = user(rng, args.history, count, args.candidate_tokens)
                    seconds, answer = timed(post, server.port, "/v1/score", {"query": history, "items": candidates})
                    score.append(seconds)
                    if args.echo and count <= args.echo_max:
                        seconds, echoed = timed(echo_scores, server.port, history, candidates, args.echo_clients)
                        echo.append(seconds)
                        diffs.append(max(abs(a - b) for a, b in zip(answer["scores"], echoed)))
                    print(f"cache {cache}, {count} candidates: prefill {prefill[-1]:.3f} s, score {score[-1]:.3f} s"
                          + (f", echo {echo[-1]:.3f} s" if len(echo) == len(score) else ""), file=sys.stderr,
                          flush=True)
                    if names:
                        seconds, _ = timed(post, server.port, "/v1/score",
                                           {"query": history, "item_ids": rng.sample(names, min(count, len(names)))})
                        items.append(seconds)
                        print(f"cache {cache}, {count} items: score {seconds:.3f} s", file=sys.stderr, flush=True)
                rows.append((cache, count, statistics.median(prefill), statistics.median(score),
                             statistics.median(echo) if echo else None, max(diffs) if diffs else None))
                if items:
                    rows.append((f"{cache}, items", count, statistics.median(prefill), statistics.median(items),
                                 None, None))
    print(f"\nCPU: {cpu_model()}; model {model}; history {args.history} tokens, candidates of "
          f"{args.candidate_tokens} tokens, median of {args.users} users\n")
    print("| prefix cache | candidates | history prefill (s) | /v1/score (s) | x prefill | echo requests (s) "
          "| echo / score | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for cache, count, prefill, score, echo, diff in rows:
        echo_cells = (f"{echo:.3f} | {echo / score:.1f}x | {diff:.2e}" if echo is not None else "- | - | -")
        print(f"| {cache} | {count} | {prefill:.3f} | {score:.3f} | {score / prefill:.2f} | {echo_cells} |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except servers.ServerError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
