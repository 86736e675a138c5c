"""Open-loop traffic: requests that arrive on their own (Poisson, bench_serving's --request-rate),
not from a fixed set of clients waiting on their answers. That is how users reach a service, and
where a P99 bound is kept or lost.

For every server configuration (fresh servers, rounds interleaved): its capacity (closed loop at
--capacity-concurrency), then Poisson arrivals at fractions of the baseline's capacity (the first
configuration), the same rates for every configuration, with mean and P99 E2E latency at each; the
goodput is the highest of those rates at which P99 stays within --p99-ms.

    python perf/open_loop.py --model perf/results/models/qwen3-small --random-input 320 \
        --fractions 0.3,0.5,0.65,0.8,0.9,1.0 --p99-ms 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from datetime import datetime

import bench_serving as bench
from cli import cpu_model, positive_floats
from servers import PERF_DIR, ensure_model, running_server, server_command, server_log
from sweep import parse_configs

DEFAULT_CONFIGS = ["continuous-N1=--scheduler continuous --concurrent-execute-stream-num 1",
                   "fixed_steps-N2=--scheduler fixed_steps --concurrent-execute-stream-num 2"]


async def measure(base_url: str, prompts: list, tokenizer, rate: float | None, concurrency: int | None) -> dict:
    model = (await bench.fetch_model_info(base_url))["id"]
    kwargs = {"request_rate": rate} if rate else {"max_concurrency": concurrency}
    return await bench.benchmark(base_url, prompts, tokenizer=tokenizer, model=model, stream=False, seed=1,
                                 warmup_requests=1, **kwargs)


def run(args: argparse.Namespace) -> list[dict]:
    configs = parse_configs(args.config or DEFAULT_CONFIGS)
    names = list(configs)
    tokenizer = bench.load_tokenizer(args.model)
    prompts = bench.make_random_prompts(tokenizer, args.num_prompts, args.random_input, args.random_output,
                                        args.random_range_ratio, args.seed)
    rows: list[dict] = []
    for round_index in range(args.rounds):
        baseline_capacity = None
        for name in names:
            command = server_command(args.model, configs[name])
            with running_server(command, server_log("open_loop", name), name) as server:
                asyncio.run(measure(server.base_url, prompts[:args.warmup], tokenizer, None, 8))
                closed = asyncio.run(measure(server.base_url, prompts, tokenizer, None, args.capacity_concurrency))
                capacity = closed["request_throughput"]
                baseline_capacity = baseline_capacity or capacity
                print(f"round {round_index} {name}: capacity {capacity:.1f} req/s "
                      f"(closed loop, concurrency {args.capacity_concurrency})", flush=True)
                rows.append({"round": round_index, "config": name, "fraction": "capacity", "rate": capacity,
                             "req_s": capacity, "mean_ms": closed["mean_e2e_latency_ms"],
                             "p99_ms": closed["p99_e2e_latency_ms"], "failed": closed["failed"]})
                for fraction in args.fractions:
                    rate = fraction * baseline_capacity
                    m = asyncio.run(measure(server.base_url, prompts, tokenizer, rate, None))
                    rows.append({"round": round_index, "config": name, "fraction": fraction, "rate": rate,
                                 "req_s": m["request_throughput"], "mean_ms": m["mean_e2e_latency_ms"],
                                 "p99_ms": m["p99_e2e_latency_ms"], "failed": m["failed"]})
                    print(f"  {fraction:.2f} x {baseline_capacity:.1f} = {rate:6.1f} req/s: mean "
                          f"{m['mean_e2e_latency_ms']:7.1f} ms, P99 {m['p99_e2e_latency_ms']:7.1f} ms, "
                          f"failed {m['failed']}", flush=True)
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> str:
    names = list(dict.fromkeys(r["config"] for r in rows))
    lines = [f"open loop, {cpu_model()}, model {os.path.basename(args.model)}, {args.random_input} in "
             f"(range ratio {args.random_range_ratio}) / {args.random_output} out, {args.num_prompts} prompts a point, "
             f"{args.rounds} round(s), medians over rounds", "",
             "| load | " + " | ".join(f"{n} mean / P99 E2E (ms)" for n in names) + " |",
             "|---|" + "---|" * len(names)]

    def median(name, fraction, key):
        values = [r[key] for r in rows if r["config"] == name and r["fraction"] == fraction]
        return statistics.median(values) if values else float("nan")

    lines.append("| capacity (req/s, closed loop) | " + " | ".join(f"{median(n, 'capacity', 'req_s'):.1f}"
                                                              for n in names) + " |")
    for fraction in args.fractions:
        rate = median(names[0], fraction, "rate")
        cells = [f"{median(n, fraction, 'mean_ms'):.1f} / {median(n, fraction, 'p99_ms'):.1f}" for n in names]
        lines.append(f"| {fraction:.0%} ({rate:.1f} req/s) | " + " | ".join(cells) + " |")
    goodput = []
    for n in names:
        within = [f for f in args.fractions if median(n, f, "p99_ms") <= args.p99_ms
                  and not any(r["failed"] for r in rows if r["config"] == n and r["fraction"] == f)]
        best = max(within, default=None)
        goodput.append("none" if best is None else f"{median(n, best, 'rate'):.1f} req/s")
    lines.append(f"| goodput (P99 <= {args.p99_ms:.0f} ms) | " + " | ".join(goodput) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", help="NAME=server.py flags, repeatable; the first is the baseline")
    p.add_argument("--model", default=None, help="model folder (default: the tiny random Qwen3)")
    p.add_argument("--random-input", type=int, default=320)
    p.add_argument("--random-output", type=int, default=1)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--capacity-concurrency", type=int, default=32)
    p.add_argument("--fractions", type=positive_floats, default=[0.5, 0.8],
                   help="arrival rates as fractions of the baseline's capacity")
    p.add_argument("--p99-ms", type=float, default=300.0, help="the P99 E2E bound of the goodput")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.model = ensure_model(args.model)
    rows = run(args)
    text = report(rows, args)
    print(text)
    out = os.path.join(PERF_DIR, "results", "open_loop", datetime.now().strftime("%Y%m%d-%H%M%S") + ".json")
    with open(out, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "table": text}, f, indent=1)
    print(f"\nrows: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
