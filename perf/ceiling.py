"""Served against the ceiling, side by side: what the HTTP, API and batching layers (and the
load client, which shares the machine) cost on top of the engine's own work.

    python perf/ceiling.py --rounds 3 --output-file perf/results/ceiling.jsonl

Each round measures both sides back to back, in an order that alternates from round to round,
each in a fresh process (the same code runs up to 10% faster or slower from one process to the
next here, with where its memory landed):
- offline: perf/offline.py, the same engine without HTTP, with as many slots as the server
  (`--streams`): the best throughput over `--batch-sizes` is the ceiling, and the median of one
  request at a time on one slot is the single-request floor;
- served: a server (`--server-args`, fixed_steps with N=2 by default) started for the round, and
  bench_serving's workload (the same random prompts) at every `--concurrency`.
Only one side runs at a time.

Two ratios per round, then their medians over the rounds:
- at concurrency 1: served median E2E latency / offline single-request median (target <= 1.10);
- at every other concurrency: served requests/s / ceiling (target >= 0.85 from 32 up).
The machine is shared and noisy: only ratios taken in one round mean much, and the median over
rounds is the figure to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime

import bench_serving as bench
import servers
import sweep
from cli import positive_ints

DEFAULT_SERVER = "--scheduler fixed_steps --concurrent-execute-stream-num 2"
LATENCY_TARGET = 1.10  # served median at concurrency 1 over the offline single request, at most
THROUGHPUT_TARGET = 0.85  # served over the ceiling, at least, from THROUGHPUT_FROM concurrency up
THROUGHPUT_FROM = 32


class CeilingError(Exception):
    """The run cannot go on (a failed offline run or warm-up): one line for the user."""


def run_offline(args: argparse.Namespace) -> dict:
    """One offline.py run; returns its ceiling (best batch) and its single-request median."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "offline.jsonl")
        command = [sys.executable, os.path.join(servers.PERF_DIR, "offline.py"), "--model", args.model,
                   "--streams", str(args.streams), "--batch-sizes", ",".join(map(str, args.batch_sizes)),
                   "--seconds", str(args.seconds), "--latency-runs", str(args.latency_runs),
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--output-file", out]
        done = subprocess.run(command, cwd=servers.ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise CeilingError(f"offline.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
        with open(out) as f:
            records = [json.loads(line) for line in f]
    best = max((r for r in records if r["mode"] == "throughput"), key=lambda r: r["request_throughput"])
    single = next(r for r in records if r["mode"] == "latency")
    return {"ceiling_req_s": best["request_throughput"], "ceiling_batch": best["batch_size"],
            "single_ms": single["median_batch_ms"]}


def prompts_for(concurrency: int, num_prompts: int | None) -> int:
    """Prompts for one served point: enough that the steady state outweighs the ramp."""
    return num_prompts or max(400, 30 * concurrency)


async def run_served(base_url: str, prompts: list, tokenizer, args: argparse.Namespace) -> dict[int, dict]:
    """bench_serving at every concurrency, after an unmeasured warm-up at the largest."""
    model = (await bench.fetch_model_info(base_url))["id"]
    common = {"tokenizer": tokenizer, "model": model, "seed": args.seed}
    warm = await bench.benchmark(base_url, prompts[:4 * max(args.concurrency)],
                                 max_concurrency=max(args.concurrency), **common)
    if warm["failed"]:
        raise CeilingError(f"warm-up failed: {warm['first_error']}")
    served = {}
    for concurrency in args.concurrency:
        count = prompts_for(concurrency, args.num_prompts)
        served[concurrency] = await bench.benchmark(base_url, prompts[:count], max_concurrency=concurrency,
                                                    warmup_requests=1, **common)
        if served[concurrency]["failed"]:
            raise CeilingError(f"concurrency {concurrency}: {served[concurrency]['first_error']}")
    return served


def round_row(index: int, offline: dict, served: dict[int, dict]) -> dict:
    """One round's figures and ratios, as one JSON line."""
    row = {"round": index, **offline, "served": {}}
    for concurrency, metrics in served.items():
        point = {"req_s": metrics["request_throughput"], "median_e2e_ms": metrics["median_e2e_latency_ms"]}
        if concurrency == 1:
            point["latency_ratio"] = point["median_e2e_ms"] / offline["single_ms"]
        else:
            point["throughput_ratio"] = point["req_s"] / offline["ceiling_req_s"]
        row["served"][concurrency] = point
    return row


def format_round(row: dict) -> str:
    parts = [f"round {row['round']}: ceiling {row['ceiling_req_s']:.1f} req/s (batch {row['ceiling_batch']}), "
             f"single request {row['single_ms']:.2f} ms"]
    for concurrency, point in row["served"].items():
        if "latency_ratio" in point:
            parts.append(f"  c={concurrency}: median E2E {point['median_e2e_ms']:.2f} ms = "
                         f"{point['latency_ratio']:.3f}x the single request")
        else:
            parts.append(f"  c={concurrency}: {point['req_s']:.1f} req/s = {point['throughput_ratio']:.3f} of the "
                         f"ceiling (median E2E {point['median_e2e_ms']:.1f} ms)")
    return "\n".join(parts)


def summarize(rows: list[dict]) -> list[str]:
    """Median ratio per concurrency over the rounds, each against its target."""
    lines = [f"medians over {len(rows)} round(s):"]
    for concurrency in rows[0]["served"]:
        points = [r["served"][concurrency] for r in rows]
        if concurrency == 1:
            ratio = statistics.median(p["latency_ratio"] for p in points)
            verdict = "met" if ratio <= LATENCY_TARGET else "not met"
            lines.append(f"  c=1: served median E2E / offline single request = {ratio:.3f} "
                         f"(target <= {LATENCY_TARGET:.2f}: {verdict})")
        else:
            ratio = statistics.median(p["throughput_ratio"] for p in points)
            target = (f" (target >= {THROUGHPUT_TARGET:.2f}: {'met' if ratio >= THROUGHPUT_TARGET else 'not met'})"
                      if concurrency >= THROUGHPUT_FROM else "")
            lines.append(f"  c={concurrency}: served / ceiling = {ratio:.3f}{target}")
    return lines


def run(args: argparse.Namespace) -> list[dict]:
    tokenizer = bench.load_tokenizer(args.model)
    count = max(prompts_for(c, args.num_prompts) for c in args.concurrency)
    prompts = bench.make_random_prompts(tokenizer, count, args.input_len, args.output_len, seed=args.seed)
    rows = []
    for index in range(1, args.rounds + 1):
        # Alternate which side goes first, so that drift within a round favours neither.
        if index % 2:
            offline = run_offline(args)
            served = serve_and_measure(args, prompts, tokenizer)
        else:
            served = serve_and_measure(args, prompts, tokenizer)
            offline = run_offline(args)
        rows.append(round_row(index, offline, served))
        print(format_round(rows[-1]), flush=True)
    return rows


def serve_and_measure(args: argparse.Namespace, prompts: list, tokenizer) -> dict[int, dict]:
    """A fresh server for this round's served side; stopped before offline runs."""
    command = servers.server_command(args.model, shlex.split(args.server_args))
    with servers.running_server(command, servers.server_log("ceiling", "server")) as server:
        return bench.run(run_served(server.base_url, prompts, tokenizer, args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the tiny random Qwen3, built once)")
    parser.add_argument("--server-args", default=DEFAULT_SERVER, help="server.py flags")
    parser.add_argument("--streams", type=int, default=2, help="offline slots: as many as the server has")
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 32, 64], help="served points, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=320)
    parser.add_argument("--output-len", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, help="per served point (default: max(400, 30 x concurrency))")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[8, 16, 32],
                        help="offline batch sizes; the best one is the ceiling")
    parser.add_argument("--seconds", type=float, default=3.0, help="offline time per batch size")
    parser.add_argument("--latency-runs", type=int, default=100, help="offline single-request runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-file", help="append one JSON line per round")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servers.interrupt_on_sigterm()
    try:
        args.model = servers.ensure_model(args.model)
        rows = run(args)
    except (CeilingError, sweep.SweepError, servers.ServerError, bench.BenchmarkError) as exc:
        print(f"ceiling: {exc}", file=sys.stderr)
        return 1
    print("\n".join(summarize(rows)))
    if args.output_file:
        stamp = {"date": datetime.now().isoformat(timespec="seconds"), "server_args": args.server_args,
                 "cpu_count": os.cpu_count(), "input_len": args.input_len, "output_len": args.output_len}
        for row in rows:
            bench.append_json_line(args.output_file, {**row, **stamp})
    return 0


if __name__ == "__main__":
    sys.exit(main())
