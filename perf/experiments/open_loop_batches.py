"""Open loop near capacity, taken apart by batch (issue 50's guard): two checkouts' servers up at
once, Poisson arrivals at one fixed rate, passes alternating (A B, B A, ...), and for each pass the
mean and P99 E2E beside what the server's /metrics say its batches were (count, mean size, mean
prefill time, mean queueing time, fill waits) over that pass alone.

    .venv/bin/python perf/experiments/open_loop_batches.py --other /tmp/wt-before --rate 800 --passes 4

Near capacity a pass settles into one of two modes (small batches and little queueing, or big
batches and long queues), in either checkout: compare medians over passes, never one pass.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import urllib.request

import _perf_path  # noqa: F401  (perf/ on sys.path)
import bench_serving as bench
from open_loop import measure
from servers import ensure_model, running_server, server_command, server_log
from sweep import parse_configs

WANTED = ("batch_size", "batch_prefill_time_seconds", "request_queue_time_seconds", "batch_fill_wait_seconds")


def batch_metrics(base_url: str) -> dict[str, float]:
    """The wanted histograms' _sum and _count, as the server's /metrics says them now."""
    text = urllib.request.urlopen(base_url + "/metrics").read().decode()
    found = {}
    for line in text.splitlines():
        match = re.match(r"^\S*?(" + "|".join(WANTED) + r")_(sum|count)(\{[^}]*\})?\s+(\S+)", line)
        if match:
            found[f"{match.group(1)}_{match.group(2)}"] = float(match.group(4))
    return found


def mean_of(before: dict, after: dict, name: str) -> tuple[float, float]:
    """(mean over the pass, count over the pass) of histogram `name`."""
    count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
    total = after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)
    return (total / count if count else 0.0), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="the other checkout (the baseline)")
    parser.add_argument("--model", default=None, help="model folder (default: the tiny random Qwen3)")
    parser.add_argument("--rate", type=float, required=True, help="Poisson arrivals a second")
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=800)
    args = parser.parse_args()
    model = ensure_model(args.model)
    configs = parse_configs([f"before=@{args.other}", "after="])
    tokenizer = bench.load_tokenizer(model)
    prompts = bench.make_random_prompts(tokenizer, args.num_prompts, 320, 1, 1.0, 0)
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(running_server(server_command(model, configs[name]),
                                                            server_log("open_loop_batches", name), name))
                   for name in configs}
        for server in servers.values():
            asyncio.run(measure(server.base_url, prompts[:32], tokenizer, None, 8))
        for index in range(args.passes):
            for name in (["before", "after"] if index % 2 == 0 else ["after", "before"]):
                url = servers[name].base_url
                start = batch_metrics(url)
                result = asyncio.run(measure(url, prompts, tokenizer, args.rate, None))
                end = batch_metrics(url)
                size, batches = mean_of(start, end, "batch_size")
                prefill, _ = mean_of(start, end, "batch_prefill_time_seconds")
                queue, _ = mean_of(start, end, "request_queue_time_seconds")
                fill, waits = mean_of(start, end, "batch_fill_wait_seconds")
                print(f"{index} {name:6s} mean {result['mean_e2e_latency_ms']:6.1f} ms, P99 "
                      f"{result['p99_e2e_latency_ms']:6.1f} ms | {batches:.0f} batches of {size:.2f}, prefill "
                      f"{prefill * 1e3:.2f} ms, queued {queue * 1e3:.2f} ms, fill waits {waits:.0f} of "
                      f"{fill * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
