"""Generated-shared-prefix's cycle in-process (issue 48): the served run's shape without the server,
so that a change to the engine can be timed in seconds rather than in a 40-second run per side.

perf/experiments/shared_prefix_split.py showed the served shape: 8 clients in step, each cycle one
request prefilled alone (the first one back), the other 7 joining at the next step, then 15 decode
steps of all 8 rows. This replays the same prompts (bench_serving's generated-shared-prefix: 16
groups of 16, a 1,024-token system prompt and a 64-token question, 16 out) through one ModelRunner
with the prefix cache on, cycle by cycle, and reports where the time goes: lone prefills, joined
prefills, decode steps. --profile adds torch.profiler's operator table over one more run.

    .venv/bin/python perf/experiments/shared_prefix_cycle.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import bench_serving as bench
import torch
from cli import cpu_model
from transformers import AutoTokenizer

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.execution.sampling import argmax_rows
from xllm_async.runtime.model_runner import ModelRunner

MODEL = os.path.expanduser("~/.cache/xllm_async/SmolLM2-135M-Instruct")


def run(runner: ModelRunner, prompts: list[list[int]], out: int, concurrency: int,
        together: bool = False) -> dict[str, float]:
    """Every prompt, `concurrency` a cycle as the served run takes them: seconds in each phase.
    together: each cycle's prompts prefilled as one batch (no lone first one)."""
    spent = {"lone": 0.0, "joined": 0.0, "decode": 0.0}
    for start in range(0, len(prompts), concurrency):
        cycle = prompts[start:start + concurrency]
        capacity = max(len(p) for p in cycle) + out
        began = time.perf_counter()
        first = runner.prefill(cycle if together else cycle[:1], capacity)
        tokens, kv = argmax_rows(first.logits), first.cache
        joined = time.perf_counter()
        if len(cycle) > 1 and not together:
            tokens += argmax_rows(runner.prefill(cycle[1:], capacity, kv).logits)
        decoding = time.perf_counter()
        for _ in range(out - 1):
            tokens = runner.decode_greedy(kv, tokens)
        ended = time.perf_counter()
        spent["lone"] += joined - began
        spent["joined"] += decoding - joined
        spent["decode"] += ended - decoding
    spent["total"] = sum(spent.values())
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--profile", action="store_true", help="torch.profiler's table over one more run")
    parser.add_argument("--together", action="store_true",
                        help="runs alternate with each cycle's prompts prefilled as one batch (no lone first one)")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    runner = ModelRunner(MODEL, torch.device("cpu"), "bfloat16")
    runner.set_kv_cache(None, 1, None)
    out = 16
    print(f"CPU: {cpu_model()}; {torch.get_num_threads()} threads", flush=True)
    with torch.inference_mode():
        warm = bench.make_shared_prefix_prompts(tokenizer, 1, 8, 1024, 64, out, 100)
        run(runner, [p.prompt for p in warm], out, args.concurrency)
        results = []
        for seed in range(1, args.runs + 1):  # (each run its own system prompts: nothing cached from before)
            prompts = bench.make_shared_prefix_prompts(tokenizer, args.groups, 16, 1024, 64, out, seed)
            together = args.together and seed % 2 == 0
            spent = run(runner, [p.prompt for p in prompts], out, args.concurrency, together)
            results.append((together, spent))
            print("together" if together else "as served", "  ".join(f"{k} {v:6.2f} s" for k, v in spent.items()),
                  f" {len(prompts) / spent['total']:.2f} req/s", flush=True)
        for way in (False, True) if args.together else (False,):
            runs = [r for t, r in results if t == way]
            print("median" + (" together" if way else ""), "  ".join(
                f"{k} {statistics.median(r[k] for r in runs):6.2f} s" for k in runs[0]))
        if args.profile:
            prompts = bench.make_shared_prefix_prompts(tokenizer, args.groups, 16, 1024, 64, out, 99)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run(runner, [p.prompt for p in prompts], out, args.concurrency)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
