"""What one request's metric updates cost: xllm_async/metrics.py against prometheus_client.

A request makes about eight updates on the event loop or a slot thread (a counter, a few
latency histograms, the batch-size histograms). This times the same updates in both libraries,
in one process, interleaved over several rounds, and prints the per-request cost in
microseconds next to the time a served request takes (--request-us, default the seed
workload's ~1,700 us a request at concurrency 32 on this machine), so the share is plain.

    .venv/bin/python perf/experiments/metrics_cost.py --rounds 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import _perf_path  # noqa: E402, F401  (perf/ on sys.path: its tools by name)
import prometheus_client  # noqa: E402
from cli import cpu_model  # noqa: E402

from xllm_async import metrics as ours  # noqa: E402


def request_of(finished, ttft, e2e, queue, prefill, batch, prompt, tokens):
    """One request's updates, in whichever library made the metrics."""
    def one(value: float) -> None:
        finished()
        ttft.observe(value)
        e2e.observe(value * 1.2)
        queue.observe(value * 0.1)
        prefill.observe(value * 0.5)
        batch.observe(16)
        prompt.observe(320)
        tokens()
    return one


def our_request():
    """The updates of one request, with our metrics."""
    requests = ours.Counter("bench_requests_total", "x", ("status",))
    ttft = ours.Histogram("bench_ttft_seconds", "x")
    e2e = ours.Histogram("bench_e2e_seconds", "x")
    queue = ours.Histogram("bench_queue_seconds", "x")
    prefill = ours.Histogram("bench_prefill_seconds", "x")
    batch = ours.Histogram("bench_batch_size", "x", ours.SIZE_BUCKETS)
    prompt = ours.Histogram("bench_prompt_tokens", "x", ours.SIZE_BUCKETS)
    tokens = ours.Counter("bench_tokens_total", "x")

    return request_of(lambda: requests.inc(1.0, "200"), ttft, e2e, queue, prefill, batch, prompt,
                      lambda: tokens.inc(321.0))


def client_request():
    """The same updates with prometheus_client, in a registry of their own."""
    registry = prometheus_client.CollectorRegistry()
    sizes = tuple(float(b) for b in ours.SIZE_BUCKETS)
    requests = prometheus_client.Counter("bench_requests", "x", ("status",), registry=registry)
    ttft = prometheus_client.Histogram("bench_ttft_seconds", "x", buckets=ours.LATENCY_BUCKETS, registry=registry)
    e2e = prometheus_client.Histogram("bench_e2e_seconds", "x", buckets=ours.LATENCY_BUCKETS, registry=registry)
    queue = prometheus_client.Histogram("bench_queue_seconds", "x", buckets=ours.LATENCY_BUCKETS, registry=registry)
    prefill = prometheus_client.Histogram("bench_prefill_seconds", "x", buckets=ours.LATENCY_BUCKETS,
                                          registry=registry)
    batch = prometheus_client.Histogram("bench_batch_size", "x", buckets=sizes, registry=registry)
    prompt = prometheus_client.Histogram("bench_prompt_tokens", "x", buckets=sizes, registry=registry)
    tokens = prometheus_client.Counter("bench_tokens", "x", registry=registry)

    # .labels() is looked up per request, as a server does with a status known only at the end.
    return request_of(lambda: requests.labels("200").inc(), ttft, e2e, queue, prefill, batch, prompt,
                      lambda: tokens.inc(321.0))


def time_per_call(fn, n: int) -> float:
    values = [0.003 + (i % 97) * 0.001 for i in range(n)]
    start = time.perf_counter()
    for v in values:
        fn(v)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000, help="requests timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--request-us", type=float, default=1700.0,
                        help="a served request's wall time, to put the cost in proportion")
    args = parser.parse_args()
    impls = {"xllm_async.metrics": our_request(), f"prometheus_client {version('prometheus_client')}":
             client_request()}
    results: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(args.rounds):
        for name, fn in impls.items():
            results[name].append(time_per_call(fn, args.requests))
    print(f"CPU: {cpu_model()}; Python {platform.python_version()}; {args.requests} requests x {args.rounds} rounds")
    print(f"| metrics | us per request (8 updates), median | rounds | share of a {args.request_us:.0f} us request |")
    print("|---|---|---|---|")
    for name, values in results.items():
        med = statistics.median(values)
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {med:.2f} | {rounds} | {med / args.request_us:.2%} |")


if __name__ == "__main__":
    main()
