"""Prompts of mixed lengths against prompts of one length, on the same server process, passes
interleaved: issue 14's "varied lengths" ratio measured side by side in one run. Two sweeps (one
per shape, perf/sweep.py) moved the ratio by 0.1 between pairs here, the host drifting between
them; here both shapes meet the same process, warm-up and drift.

    .venv/bin/python perf/experiments/shapes.py --model perf/results/models/qwen3-small \\
        --config "fixed_steps-N2=--scheduler fixed_steps --concurrent-execute-stream-num 2"

For each configuration and round: a fresh server, a warm-up of both shapes, then --passes passes
of [the mixed set, the fixed set] (the order alternating by pass), each --num-prompts requests at
--concurrency; every pass gives the ratio req/s(mixed) / req/s(fixed). By default 320 tokens
against uniform 30-608 (about the same tokens in all), one token out, as in the issue.
"""

from __future__ import annotations

import argparse
import os
import statistics

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import bench_serving as bench
import servers
from cli import cpu_model
from sweep import parse_configs, safe_name


def fixed_and_mixed(tokenizer, args) -> tuple[list, list]:
    """The fixed set (--fixed-input tokens each) and the mixed one (bench_serving's random lengths:
    uniform in [--mixed-input x --mixed-range-ratio, --mixed-input]), one token out each."""
    fixed = bench.make_random_prompts(tokenizer, args.num_prompts, args.fixed_input, 1, 1.0, seed=args.seed)
    mixed = bench.make_random_prompts(tokenizer, args.num_prompts, args.mixed_input, 1, args.mixed_range_ratio,
                                      seed=args.seed + 1)
    return fixed, mixed


async def measure(base_url: str, fixed: list, mixed: list, tokenizer, args) -> list[tuple[float, float]]:
    model = (await bench.fetch_model_info(base_url))["id"]
    common = {"tokenizer": tokenizer, "model": model, "stream": False, "seed": args.seed}
    for warm in (fixed[:args.concurrency], mixed[:args.concurrency]):
        await bench.benchmark(base_url, warm, max_concurrency=args.concurrency, **common)
    passes = []
    for i in range(args.passes):
        rates = {}
        for name in (("mixed", "fixed") if i % 2 == 0 else ("fixed", "mixed")):
            metrics = await bench.benchmark(base_url, mixed if name == "mixed" else fixed,
                                            max_concurrency=args.concurrency, **common)
            if metrics["failed"]:
                raise SystemExit(f"{name}: {metrics['failed']} failed: {metrics['first_error']}")
            rates[name] = metrics["request_throughput"]
        print(f"    pass {i + 1}: fixed {rates['fixed']:.1f} req/s, mixed {rates['mixed']:.1f} req/s, "
              f"ratio {rates['mixed'] / rates['fixed']:.3f}", flush=True)
        passes.append((rates["fixed"], rates["mixed"]))
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True, help="NAME=server.py flags, repeatable")
    parser.add_argument("--model", help="model folder (default: the tiny random Qwen3)")
    parser.add_argument("--fixed-input", type=int, default=320)
    parser.add_argument("--mixed-input", type=int, default=608)
    parser.add_argument("--mixed-range-ratio", type=float, default=0.05)
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    configs = parse_configs(args.config)
    args.model = servers.ensure_model(args.model)
    tokenizer = bench.load_tokenizer(args.model)
    fixed, mixed = fixed_and_mixed(tokenizer, args)
    tokens = [sum(p.prompt_len for p in prompts) for prompts in (fixed, mixed)]
    print(f"{cpu_model()}; {args.num_prompts} prompts a pass, fixed {tokens[0]} tokens, "
          f"mixed {tokens[1]} tokens; concurrency {args.concurrency}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for round_index in range(1, args.rounds + 1):
        for name, flags in configs.items():
            print(f"round {round_index}: {name}", flush=True)
            log = servers.server_log("shapes", safe_name(name))
            with servers.running_server(servers.server_command(args.model, flags), log, name) as server:
                results[name] += bench.run(measure(server.base_url, fixed, mixed, tokenizer, args))
    print("\n| configuration | fixed req/s (median) | mixed req/s (median) | mixed / fixed, per pass | median |")
    print("|---|---|---|---|---|")
    for name, passes in results.items():
        ratios = [m / f for f, m in passes]
        fixed_rate, mixed_rate = statistics.median(f for f, _ in passes), statistics.median(m for _, m in passes)
        print(f"| {name} | {fixed_rate:.1f} | {mixed_rate:.1f} | {', '.join(f'{r:.3f}' for r in ratios)} "
              f"| {statistics.median(ratios):.3f} |")
    print(f"\nlogs: {os.path.dirname(servers.server_log('shapes', 'x'))}")


if __name__ == "__main__":
    main()
