"""Where a generated-shared-prefix request's time to first token goes on our server (issue 48): the
workload of `perf/peers/compare.py --workloads shared_prefix` (16 groups of 16 prompts, a 1,024-token
system prompt and a 64-token question each, 16 out, 8 clients, SmolLM2) against one fresh server,
then the server's own histograms over the run: the wait in the queue, the prefill batches (count,
mean time, mean size), the decode steps, and the prompt tokens served from the prefix cache; and
the CPU seconds the server's event loop thread, its other threads and the benchmark client used over
the run.

    .venv/bin/python perf/experiments/shared_prefix_split.py                  # the default server
    .venv/bin/python perf/experiments/shared_prefix_split.py --args "--scheduler continuous"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import bench_serving as bench
import servers
from cli import cpu_model
from profile_server import thread_cpu_seconds
from transformers import AutoTokenizer

SERIES = ("request_queue_time_seconds", "batch_prefill_time_seconds", "batch_decode_time_seconds",
          "time_to_first_token_seconds", "batch_size")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--args", default="", help="server flags beyond the default configuration")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    model = os.path.expanduser("~/.cache/xllm_async/SmolLM2-135M-Instruct")  # (make model converts it there)
    tokenizer = AutoTokenizer.from_pretrained(model)
    name = os.path.basename(os.path.normpath(model))  # (the server's name for it)
    prompts = bench.make_shared_prefix_prompts(tokenizer, args.groups, 16, 1024, 64, 16, args.seed)
    command = servers.server_command(model, ["--dtype", "bfloat16", *shlex.split(args.args)])
    print(f"CPU: {cpu_model()}; server flags: {args.args or '(default)'}", flush=True)
    with servers.running_server(command, servers.server_log("shared_prefix_split", "server")) as server:
        warm = bench.make_shared_prefix_prompts(tokenizer, 1, 8, 1024, 64, 16, args.seed + 100)
        asyncio.run(bench.benchmark(server.base_url, warm, tokenizer=tokenizer, model=name,
                                    max_concurrency=args.concurrency))
        before, threads_before = servers.scrape_metrics(server.port), thread_cpu_seconds(server.pid)
        client_before = os.times()
        result = asyncio.run(bench.benchmark(server.base_url, prompts, tokenizer=tokenizer,
                                             model=name, max_concurrency=args.concurrency))
        after, threads_after = servers.scrape_metrics(server.port), thread_cpu_seconds(server.pid)
        client_after = os.times()
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    row = {"completed": result["completed"], "first_error": result["first_error"][:200],
           "req_s": round(result["request_throughput"], 2), "client_ttft_mean_ms": round(result["mean_ttft_ms"], 1),
           "client_tpot_mean_ms": round(result["mean_tpot_ms"], 1)}
    for name in SERIES:
        total, count = delta.get(f"xllm:{name}_sum", 0.0), delta.get(f"xllm:{name}_count", 0.0)
        row[name] = {"count": int(count), "mean": round(total / count * (1 if name == "batch_size" else 1000), 2)
                     if count else None, "sum": round(total * (1 if name == "batch_size" else 1), 2)}
    row["server_cpu_s"] = {k: round(threads_after[k] - threads_before[k], 2) for k in threads_after}
    row["client_cpu_s"] = round(client_after.user + client_after.system - client_before.user - client_before.system, 2)
    row["cached_prompt_tokens"] = int(delta.get("xllm:prefix_cache_hits_total", delta.get("xllm:prefix_cache_hits", 0)))
    row["prompt_tokens"] = int(delta.get("xllm:prompt_tokens_total", 0))
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
