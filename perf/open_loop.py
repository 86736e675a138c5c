"""Open-loop traffic: requests that arrive on their own (Poisson, bench_serving's --request-rate),
not from a fixed set of clients waiting on their answers. That is how users reach a service, and
where a P99 bound is kept or lost.

For every server configuration (fresh servers, rounds interleaved): its capacity (closed loop at
--capacity-concurrency), then Poisson arrivals at fractions of the baseline's capacity (the first
configuration), the same rates for every configuration, with mean and P99 E2E latency at each; the
goodput is the highest of those rates at which P99 stays within --p99-ms.

    python perf/open_loop.py --model perf/results/models/qwen3-small --random-input 320 \
        --fractions 0.3,0.5,0.65,0.8,0.9,1.0 --p99-ms 300

Near capacity a single point moves 2-4x between runs on a shared host, as the host's speed drifts
over minutes. --interleave K starts every configuration's server once, side by side (an idle one
sleeps), and runs each point K times, the configurations in turn and in alternating order (A B, B
A, ...), so that each pass compares them within seconds of each other; rows are then passes, and
the table adds each configuration's mean and P99 E2E over the baseline's, the medians of its
passes. --pool FILE... reports the rows of several such runs' JSON files as one (passes of every
run paired within their run), without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
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


def workload(args: argparse.Namespace) -> tuple[list[str], dict, object, list]:
    """(configuration names, their flags, the tokenizer, the prompts) of a run."""
    configs = parse_configs(args.config or DEFAULT_CONFIGS)
    tokenizer = bench.load_tokenizer(args.model)
    prompts = bench.make_random_prompts(tokenizer, args.num_prompts, args.random_input, args.random_output,
                                        args.random_range_ratio, args.seed)
    return list(configs), configs, tokenizer, prompts


def capacity_row(server, name: str, index: int, prompts: list, tokenizer, args: argparse.Namespace) -> dict:
    """Warm the server up, then its closed-loop capacity at --capacity-concurrency, as a row."""
    asyncio.run(measure(server.base_url, prompts[:args.warmup], tokenizer, None, 8))
    closed = asyncio.run(measure(server.base_url, prompts, tokenizer, None, args.capacity_concurrency))
    capacity = closed["request_throughput"]
    print(f"round {index} {name}: capacity {capacity:.1f} req/s (closed loop, concurrency "
          f"{args.capacity_concurrency})", flush=True)
    return {"round": index, "config": name, "fraction": "capacity", "rate": capacity, "req_s": capacity,
            "mean_ms": closed["mean_e2e_latency_ms"], "p99_ms": closed["p99_e2e_latency_ms"],
            "failed": closed["failed"]}


def point_row(server, name: str, index: int, fraction: float, baseline_capacity: float, prompts: list,
              tokenizer) -> dict:
    """Poisson arrivals at fraction x the baseline's capacity, as a row."""
    rate = fraction * baseline_capacity
    m = asyncio.run(measure(server.base_url, prompts, tokenizer, rate, None))
    print(f"  {index} {name}: {fraction:.2f} x {baseline_capacity:.1f} = {rate:6.1f} req/s: mean "
          f"{m['mean_e2e_latency_ms']:7.1f} ms, P99 {m['p99_e2e_latency_ms']:7.1f} ms, failed {m['failed']}",
          flush=True)
    return {"round": index, "config": name, "fraction": fraction, "rate": rate, "req_s": m["request_throughput"],
            "mean_ms": m["mean_e2e_latency_ms"], "p99_ms": m["p99_e2e_latency_ms"], "failed": m["failed"]}


def run(args: argparse.Namespace) -> list[dict]:
    """--rounds rounds; in each, every configuration on a fresh server, one after the other."""
    names, configs, tokenizer, prompts = workload(args)
    rows: list[dict] = []
    for index in range(args.rounds):
        baseline_capacity = None
        for name in names:
            with running_server(server_command(args.model, configs[name]), server_log("open_loop", name),
                                name) as server:
                rows.append(capacity_row(server, name, index, prompts, tokenizer, args))
                baseline_capacity = baseline_capacity or rows[-1]["rate"]
                rows += [point_row(server, name, index, f, baseline_capacity, prompts, tokenizer)
                         for f in args.fractions]
    return rows


def run_interleaved(args: argparse.Namespace) -> list[dict]:
    """Every configuration's server up at once; each point --interleave times, in turn (the docstring)."""
    names, configs, tokenizer, prompts = workload(args)
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(running_server(server_command(args.model, configs[name]),
                                                            server_log("open_loop", name), name))
                   for name in names}
        rows += [capacity_row(servers[name], name, 0, prompts, tokenizer, args) for name in names]
        baseline_capacity = rows[0]["rate"]
        for fraction in args.fractions:
            for index in range(args.interleave):
                rows += [point_row(servers[name], name, index, fraction, baseline_capacity, prompts, tokenizer)
                         for name in (names if index % 2 == 0 else names[::-1])]
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> str:
    names = list(dict.fromkeys(r["config"] for r in rows))
    lines = [f"open loop, {cpu_model()}, model {os.path.basename(args.model)}, {args.random_input} in "
             f"(range ratio {args.random_range_ratio}) / {args.random_output} out, {args.num_prompts} prompts a point, "
             + (f"the passes of {len(args.pool)} runs pooled, medians over passes" if args.pool else
                f"every server up at once, {args.interleave} interleaved passes a point, medians over passes"
                if args.interleave else f"{args.rounds} round(s), medians over rounds"), "",
             "| load | " + " | ".join(f"{n} mean / P99 E2E (ms)" + (" (over the first)" if i else "")
                                    for i, n in enumerate(names)) + " |",
             "|---|" + "---|" * len(names)]

    def median(name, fraction, key):
        values = [r[key] for r in rows if r["config"] == name and r["fraction"] == fraction]
        return statistics.median(values) if values else float("nan")

    lines.append("| capacity (req/s, closed loop) | " + " | ".join(f"{median(n, 'capacity', 'req_s'):.1f}"
                                                              for n in names) + " |")
    def cell(name, fraction):
        mean = median(name, fraction, "mean_ms")
        if math.isnan(mean):
            return "-"  # not run at this load (--pool)
        text = f"{mean:.1f} / {median(name, fraction, 'p99_ms'):.1f}"
        if name == names[0]:
            return text
        return (f"{text} ({paired_ratio(rows, names[0], name, fraction, 'mean_ms'):.2f}x / "
                f"{paired_ratio(rows, names[0], name, fraction, 'p99_ms'):.2f}x)")

    for fraction in args.fractions:
        rate = median(names[0], fraction, "rate")
        cells = [cell(n, fraction) for n in names]
        lines.append(f"| {fraction:.0%} ({rate:.1f} req/s) | " + " | ".join(cells) + " |")
    goodput = []
    for n in names:
        within = [f for f in args.fractions if median(n, f, "p99_ms") <= args.p99_ms
                  and not any(r["failed"] for r in rows if r["config"] == n and r["fraction"] == f)]
        best = max(within, default=None)
        goodput.append("none" if best is None else f"{median(n, best, 'rate'):.1f} req/s")
    lines.append(f"| goodput (P99 <= {args.p99_ms:.0f} ms) | " + " | ".join(goodput) + " |")
    return "\n".join(lines)


def paired_ratio(rows: list[dict], baseline: str, name: str, fraction: float, key: str) -> float:
    """The median over rounds (or passes) of name's figure (key) over the baseline's in the same one."""
    figures = {(r["config"], r["round"]): r[key] for r in rows if r["fraction"] == fraction}
    ratios = [figures[name, i] / figures[baseline, i] for c, i in figures if c == baseline and (name, i) in figures]
    return statistics.median(ratios) if ratios else float("nan")


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
    p.add_argument("--interleave", type=int, default=0, metavar="K",
                   help="start every server once and run each point K times, configurations in turn (not --rounds)")
    p.add_argument("--pool", nargs="+", metavar="JSON", default=[],
                   help="report the rows of these earlier runs (their own settings) as one, running nothing")
    p.add_argument("--seed", type=int, default=0)
    return p


def pooled(paths: list[str]) -> tuple[list[dict], argparse.Namespace]:
    """The rows of several runs' JSON files, each run's rounds kept apart (so pairs stay within a run),
    and the first run's settings with every run's fractions."""
    rows: list[dict] = []
    first = None
    for index, path in enumerate(paths):
        with open(path) as f:
            saved = json.load(f)
        first = first or saved["args"]
        rows += [{**row, "round": f"{index}:{row['round']}"} for row in saved["rows"]]
    args = argparse.Namespace(**{**first, "pool": paths, "fractions": sorted(
        {r["fraction"] for r in rows if r["fraction"] != "capacity"})})
    return rows, args


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.pool:
        rows, args = pooled(args.pool)
        print(report(rows, args))
        return 0
    args.model = ensure_model(args.model)
    rows = run_interleaved(args) if args.interleave else run(args)
    text = report(rows, args)
    print(text)
    out = os.path.join(PERF_DIR, "results", "open_loop", datetime.now().strftime("%Y%m%d-%H%M%S") + ".json")
    with open(out, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "table": text}, f, indent=1)
    print(f"\nrows: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
