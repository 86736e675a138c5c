"""One client's decode against llama.cpp's server, in pairs: both servers up at once, each pair one
request to each, back to back, the order alternating, so that the machine's memory phases
(perf/bandwidth_phases.py: the read ceiling moves ~1.6x in phases of seconds) fall on both sides of
a pair alike. A round of fresh servers, as perf/peers/compare.py runs them, lands each server in a
different phase, and its ratio then says as much of the phase as of the servers (issue 49).

    python perf/paired_decode.py --model ~/.cache/xllm_async/SmolLM2-135M-Instruct --pairs 16
    python perf/paired_decode.py --peer-gguf q4_1 --ours-args "--dtype bfloat16 --quantization gguf"

Each request: 128 random tokens in, 128 out (ignore_eos, greedy), streamed through perf/bench_serving.py's
client; its time per output token after the first (TPOT). Reported: each server's TPOT per pair,
the speed ratio of each pair (their TPOT / ours), its median and range, and how many pairs reach
--target. `--restarts R` starts both servers afresh R times, pairs split between them.
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

PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers")
PEERS_PYTHON = os.path.join(PEERS, ".venv", "bin", "python")


def tpot(server: servers.RunningServer, prompt, tokenizer, model: str) -> float:
    """One request's time per output token after the first, ms."""
    metrics = bench.run(bench.benchmark(server.base_url, [prompt], tokenizer=tokenizer, model=model, max_concurrency=1))
    if metrics["completed"] != 1:
        raise SystemExit(f"paired_decode: a request to {server.base_url} failed")
    return metrics["median_tpot_ms"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/xllm_async/SmolLM2-135M-Instruct"))
    parser.add_argument("--ours-args", default="--dtype bfloat16", help="server.py flags")
    parser.add_argument("--peer-gguf", default="bf16", choices=("bf16", "q4_1"), help="llama.cpp's file")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--restarts", type=int, default=1, help="fresh pairs of servers, the pairs split between them")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests to each server after a start")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--target", type=float, default=1.1, help="the speed ratio a pair should reach")
    args = parser.parse_args(argv)
    tokenizer = bench.load_tokenizer(args.model)
    prompts = bench.make_random_prompts(tokenizer, args.pairs + args.warmup, args.input_len, args.output_len)
    ours_cmd = servers.server_command(args.model, shlex.split(args.ours_args))
    peer_cmd = [PEERS_PYTHON, os.path.join(PEERS, "llamacpp.py"), "serve", "--gguf", args.peer_gguf,
                "--folder", args.model]
    print(f"CPU: {cpu_model()}; one client, {args.input_len} in / {args.output_len} out; ours: {args.ours_args}; "
          f"llama.cpp: {args.peer_gguf}; TPOT ms, ratio = llama.cpp's / ours (speed)")
    pairs: list[tuple[float, float]] = []
    per_start = -(-args.pairs // args.restarts)
    for start in range(args.restarts):
        with contextlib.ExitStack() as stack:
            ours = stack.enter_context(servers.running_server(ours_cmd, servers.server_log("paired_decode", "ours"),
                                                              "ours"))
            peer = stack.enter_context(servers.running_server(peer_cmd, servers.server_log("paired_decode", "llamacpp"),
                                                              "llamacpp", own_group=True))
            names = {s.port: bench.run(bench.fetch_model_info(s.base_url))["id"] for s in (ours, peer)}
            for prompt in prompts[:args.warmup]:
                for s in (ours, peer):
                    tpot(s, prompt, tokenizer, names[s.port])
            for index in range(per_start):
                if len(pairs) == args.pairs:
                    break
                prompt = prompts[args.warmup + len(pairs)]
                order = (ours, peer) if len(pairs) % 2 == 0 else (peer, ours)
                got = {s.port: tpot(s, prompt, tokenizer, names[s.port]) for s in order}
                pairs.append((got[ours.port], got[peer.port]))
                print(f"  start {start + 1} pair {len(pairs):3d}: ours {got[ours.port]:6.2f}  llama.cpp "
                      f"{got[peer.port]:6.2f}  ratio {got[peer.port] / got[ours.port]:.3f}", flush=True)
    ratios = [p / o for o, p in pairs]
    ours_ms, peer_ms = zip(*pairs)
    print(f"ours: median {statistics.median(ours_ms):.2f} ms ({min(ours_ms):.2f}-{max(ours_ms):.2f}); llama.cpp "
          f"{statistics.median(peer_ms):.2f} ({min(peer_ms):.2f}-{max(peer_ms):.2f})")
    print(f"ratio: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; "
          f"{sum(r >= args.target for r in ratios)} of {len(ratios)} pairs >= {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
