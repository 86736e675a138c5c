"""Two configurations of our server side by side, in pairs: both servers up at once, each pair one
burst of never-seen requests to each, back to back, the order alternating (ABBA), so that the
machine's memory phases (perf/bandwidth_phases.py: the read ceiling moves ~1.6x in phases of
seconds) fall on both sides of a pair alike. Fresh servers per round (perf/sweep.py) land each
configuration in a different phase, and a round's ratio then says as much of the phase as of the
configurations; `--restarts R` starts both afresh R times, the pairs split between the starts, so
that what a start lands on is sampled too.

    python perf/paired_configs.py --model perf/results/models/qwen3-small --a "--prefix-cache off" \\
        --b "--prefix-cache on" --concurrency 2 --burst 200 --pairs 24 --restarts 3

Every burst's prompts are random tokens (--input-len in, --output-len out) drawn afresh, so nothing
repeats within a server or between bursts; or, `--dataset shared_prefix`, SGLang's
generated-shared-prefix (bench_serving.make_shared_prefix_prompts: a burst of --burst prompts in
groups of 16 (--per-group) behind a 1,024-token system prompt, 64-token questions, --output-len
out), each burst its own system prompts. Both servers of a pair get the same prompts. Reported:
each burst's requests a second, each pair's ratio b / a, their median and range, and the pooled
ratio (all b's requests over all b's seconds, against a's).

A configuration of just `vllm` is vLLM-CPU as perf/peers/compare.py runs it (its own environment,
`VLLM_CPU_KVCACHE_SPACE=4`, `--vllm-dtype`), so that ours is paired against the peer the same way:

    python perf/paired_configs.py --model ~/.cache/xllm_async/SmolLM2-135M-Instruct --a vllm \\
        --b "--dtype bfloat16" --dataset shared_prefix --concurrency 8 --burst 128 --output-len 16 \\
        --pairs 8 --restarts 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys

import bench_serving as bench
import servers
from cli import cpu_model

PEER = "vllm"  # the one peer a configuration may name


def launch(model: str, flags: str, dtype: str) -> tuple[list[str], bool]:
    """(the command, whether it runs in a process group of its own) of a configuration: server.py with
    these flags, or vLLM-CPU as perf/peers/compare.py starts it."""
    if flags.strip() != PEER:
        return servers.server_command(model, shlex.split(flags)), False
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
    import compare  # (perf/peers/compare.py: how each peer is started)

    peers = compare.servers_for(argparse.Namespace(
        servers=f"{compare.OURS},{PEER}", dtype=dtype, ours_streams=2, max_batch_size=32, batch_timeout=0.005,
        fastapi_threads=None, vllm_threads_bind=f"0-{(os.cpu_count() or 1) - 1}"))
    return peers[1].command(model), True


def burst(server: servers.RunningServer, prompts, tokenizer, model: str, concurrency: int) -> tuple[int, float]:
    """(requests completed, seconds) of one closed-loop burst."""
    metrics = bench.run(bench.benchmark(server.base_url, prompts, tokenizer=tokenizer, model=model,
                                        max_concurrency=concurrency))
    if metrics["completed"] != len(prompts):
        raise SystemExit(f"paired_configs: {len(prompts) - metrics['completed']} requests to {server.base_url} "
                         f"failed: {metrics['first_error'][:200]}")
    return metrics["completed"], metrics["duration"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=servers.DEFAULT_MODEL, help="model folder (default: the tiny Qwen3)")
    parser.add_argument("--a", default="--prefix-cache off", help="server.py flags of configuration a")
    parser.add_argument("--b", default="--prefix-cache on", help="server.py flags of configuration b")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--burst", type=int, default=200, help="requests a burst")
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--restarts", type=int, default=3, help="fresh pairs of servers, the pairs split between them")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured bursts to each server after a start")
    parser.add_argument("--dataset", choices=("random", "shared_prefix"), default="random")
    parser.add_argument("--per-group", type=int, default=bench.SHARED_PREFIX[2],
                        help="shared_prefix: prompts behind each system prompt (a burst of one group: one for all)")
    parser.add_argument("--input-len", type=int, default=320)
    parser.add_argument("--output-len", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.97, help="the ratio b / a to reach")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="a configuration `vllm`: its --dtype")
    args = parser.parse_args(argv)
    model = servers.ensure_model(args.model)
    tokenizer = bench.load_tokenizer(model)
    bursts = args.pairs + args.warmup * args.restarts
    if args.dataset == "shared_prefix":  # (a burst's groups of its own: nothing cached from an earlier burst)
        system, question, _ = bench.SHARED_PREFIX
        per_group = args.per_group
        prompts = [p for b in range(bursts) for p in bench.make_shared_prefix_prompts(
            tokenizer, max(1, args.burst // per_group), per_group, system, question, args.output_len, seed=1000 + b)]
        args.burst = len(prompts) // bursts
    else:
        prompts = bench.make_random_prompts(tokenizer, bursts * args.burst, args.input_len, args.output_len)
    commands = {name: launch(model, flags, args.vllm_dtype) for name, flags in (("a", args.a), ("b", args.b))}
    shape = "shared prefix" if args.dataset == "shared_prefix" else f"{args.input_len} in"
    print(f"CPU: {cpu_model()}; a: {args.a}; b: {args.b}; {shape} / {args.output_len} out, "
          f"concurrency {args.concurrency}, bursts of {args.burst}; req/s, ratio = b / a")
    taken = 0

    def next_prompts():
        nonlocal taken
        taken += args.burst
        return prompts[taken - args.burst:taken]

    pairs: list[dict[str, tuple[int, float]]] = []
    per_start = -(-args.pairs // args.restarts)
    for start in range(args.restarts):
        with contextlib.ExitStack() as stack:
            up = {name: stack.enter_context(servers.running_server(command, servers.server_log("paired_configs", name),
                                                                   name, own_group=group))
                  for name, (command, group) in commands.items()}
            names = {name: bench.run(bench.fetch_model_info(s.base_url))["id"] for name, s in up.items()}
            for _ in range(args.warmup):
                chunk = next_prompts()
                for name, s in up.items():
                    burst(s, chunk, tokenizer, names[name], args.concurrency)
            for _ in range(per_start):
                if len(pairs) == args.pairs:
                    break
                chunk = next_prompts()
                order = ("a", "b") if len(pairs) % 2 == 0 else ("b", "a")
                got = {name: burst(up[name], chunk, tokenizer, names[name], args.concurrency) for name in order}
                pairs.append(got)
                rate = {name: n / s for name, (n, s) in got.items()}
                print(f"  start {start + 1} pair {len(pairs):3d}: a {rate['a']:7.2f}  b {rate['b']:7.2f}  "
                      f"ratio {rate['b'] / rate['a']:.3f}", flush=True)
    ratios = [(p["b"][0] / p["b"][1]) / (p["a"][0] / p["a"][1]) for p in pairs]
    pooled = {name: sum(p[name][0] for p in pairs) / sum(p[name][1] for p in pairs) for name in ("a", "b")}
    print(f"pooled: a {pooled['a']:.2f} req/s, b {pooled['b']:.2f}: ratio {pooled['b'] / pooled['a']:.3f}")
    print(f"pairs: median {statistics.median(ratios):.3f}, mean {statistics.fmean(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}; {sum(r >= args.target for r in ratios)} of "
          f"{len(ratios)} pairs >= {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
