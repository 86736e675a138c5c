"""Uneven replicas behind HAProxy: one replica slowed, least outstanding requests against round robin.

    python perf/uneven_replicas.py --replicas 3 --fast-threads 4 --slow-threads 1 --concurrency 32

Replica r0 runs with fewer torch threads (or with --slow-args, say a larger model) than the others.
Round robin gives it a third of the requests whatever its speed, so its queue, and the P99 of the
whole fleet, grow; `balance leastconn` sends each request to the replica with the fewest
outstanding ones. The same replicas serve both balancers, in interleaved rounds, each through a
fresh HAProxy (deploy/haproxy_cfg.py); the table shows each balancer's req/s, P99 E2E and the share
of requests r0 got. Needs haproxy (apt-get install haproxy) and cores for every replica's threads.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

import bench_serving as bench
import servers

sys.path.insert(0, os.path.join(servers.ROOT, "deploy"))
import haproxy_cfg  # noqa: E402

E2E_COUNT = "xllm:e2e_request_latency_seconds_count"


def served(ports: list[int]) -> list[float]:
    """Requests each replica has answered so far."""
    return [servers.scrape_metrics(port).get(E2E_COUNT, 0.0) for port in ports]


def measure(balance: str, ports: list[int], prompts: list, tokenizer, args: argparse.Namespace) -> dict:
    """One run through a fresh HAProxy with this balance: bench_serving's metrics plus r0's share."""
    port = servers.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "haproxy.cfg")
        with open(config, "w") as f:
            f.write(haproxy_cfg.render([f"{servers.HOST}:{p}" for p in ports], f"{servers.HOST}:{port}",
                                       balance=balance, inter="500ms"))
        proc = subprocess.Popen([args.haproxy, "-db", "-f", config], stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 10
            while not servers.health_ok(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise servers.ServerError(f"haproxy did not come up on :{port}")
                time.sleep(0.1)
            before = served(ports)
            metrics = bench.run(bench.benchmark(f"http://{servers.HOST}:{port}", prompts, tokenizer=tokenizer,
                                                model=args.served_model_name, max_concurrency=args.concurrency,
                                                stream=False, warmup_requests=0))
            after = served(ports)
        finally:
            proc.terminate()
            proc.wait(10)
    counts = [a - b for a, b in zip(after, before)]
    metrics["slow_share"] = counts[0] / max(1.0, sum(counts))
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: the tiny random Qwen3 of perf/results/models)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--fast-threads", type=int, default=2, help="torch threads of every replica but r0")
    parser.add_argument("--slow-threads", type=int, default=1, help="torch threads of r0, the slow one")
    parser.add_argument("--slow-args", default="", help="more server.py flags for r0 (e.g. '--model BIGGER')")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--random-input", type=int, default=128)
    parser.add_argument("--random-output", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--balance", default="leastconn,roundrobin", help="balancers to compare, comma-separated")
    parser.add_argument("--haproxy", default=shutil.which("haproxy") or "/usr/sbin/haproxy")
    args = parser.parse_args(argv)
    args.served_model_name = "uneven"
    if not os.path.exists(args.haproxy):
        print("uneven_replicas: haproxy is not installed (apt-get install -y haproxy)", file=sys.stderr)
        return 2
    model = servers.ensure_model(args.model)
    tokenizer = bench.load_tokenizer(model)
    prompts = bench.make_random_prompts(tokenizer, args.num_prompts, args.random_input, args.random_output)
    common = ["--served-model-name", args.served_model_name, "--concurrent-execute-stream-num", "1"]
    balances = args.balance.split(",")
    results: dict[str, list[dict]] = {b: [] for b in balances}
    try:
        with ExitStack() as stack:
            ports = []
            for i in range(args.replicas):
                threads = args.slow_threads if i == 0 else args.fast_threads
                extra = shlex.split(args.slow_args) if i == 0 else []
                command = servers.server_command(model, [*common, "--torch-threads", str(threads), *extra])
                server = stack.enter_context(servers.running_server(
                    command, servers.server_log("uneven", f"r{i}"), f"r{i}"))
                ports.append(server.port)
            for round_index in range(args.rounds):
                for balance in balances:
                    metrics = measure(balance, ports, prompts, tokenizer, args)
                    results[balance].append(metrics)
                    print(f"round {round_index + 1} {balance:>10}: {metrics['request_throughput']:.1f} req/s, "
                          f"P99 E2E {metrics['p99_e2e_latency_ms']:.1f} ms, r0 served "
                          f"{100 * metrics['slow_share']:.0f}%, failed {metrics['failed']}", flush=True)
    except (servers.ServerError, bench.BenchmarkError) as exc:
        print(f"uneven_replicas: {exc}", file=sys.stderr)
        return 1
    print(f"\nmedians over {args.rounds} round(s), {args.replicas} replicas, r0 slowed, "
          f"concurrency {args.concurrency}:")
    print("| balance | req/s | median E2E ms | P99 E2E ms | share served by r0 |\n|---|---|---|---|---|")
    for balance, runs in results.items():
        figures = {key: statistics.median(m[key] for m in runs) for key in
                   ("request_throughput", "median_e2e_latency_ms", "p99_e2e_latency_ms", "slow_share")}
        print(f"| {balance} | {figures['request_throughput']:.1f} | {figures['median_e2e_latency_ms']:.1f} | "
              f"{figures['p99_e2e_latency_ms']:.1f} | {100 * figures['slow_share']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
