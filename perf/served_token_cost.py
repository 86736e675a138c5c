"""Where a served token's time goes beyond the offline step (issue 49, item 4): one client's decode
through a server, each of the server's threads' CPU time and context switches a token (from
/proc/PID/task), the client's own CPU a token, and the served time a token beside the slot's busy
time a token (/metrics); then the offline step in a fresh process (perf/decode_step.py's).

    python perf/served_token_cost.py --model ~/.cache/xllm_async/SmolLM2-135M-Instruct --rounds 3

On a machine with as many cores as the slot has threads, every CPU-millisecond the event loop and
the client spend a token is taken from the step's threads; a switch that wakes the loop preempts one
of them while the other waits for it at the next barrier. Rounds alternate served and offline, each
in a fresh process, so that the machine's memory phases (perf/bandwidth_phases.py) fall on both.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request

import bench_serving as bench
import servers

TICK = os.sysconf("SC_CLK_TCK")


def thread_times(pid: int) -> dict[str, tuple[str, float, int, int]]:
    """Each thread of pid: (name, CPU seconds, voluntary, involuntary context switches)."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except OSError:  # (a thread that ended)
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        found[tid] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / TICK,
                      int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
    return found


def slots_busy(port: int) -> float:
    """Seconds all execution slots have spent running batches (/metrics, slot_busy_seconds_total)."""
    with urllib.request.urlopen(f"http://{servers.HOST}:{port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if "slot_busy_seconds_total{" in line)


def served(args: argparse.Namespace, prompts: list) -> dict:
    command = servers.server_command(args.model, shlex.split(args.server_args))
    with servers.running_server(command, servers.server_log("served_token_cost", "server")) as server:
        tokenizer = bench.load_tokenizer(args.model)
        model = bench.run(bench.fetch_model_info(server.base_url))["id"]
        bench.run(bench.benchmark(server.base_url, prompts[:1], tokenizer=tokenizer, model=model, max_concurrency=1))
        before, busy0 = thread_times(server.pid), slots_busy(server.port)
        client0, wall0 = time.process_time(), time.perf_counter()
        metrics = bench.run(bench.benchmark(server.base_url, prompts[1:], tokenizer=tokenizer, model=model,
                                            max_concurrency=1))
        client, wall = time.process_time() - client0, time.perf_counter() - wall0
        after, busy1 = thread_times(server.pid), slots_busy(server.port)
    tokens = metrics["total_output_tokens"]
    threads = []
    for tid, (name, cpu, vol, inv) in after.items():
        name0, cpu0, vol0, inv0 = before.get(tid, (name, 0.0, 0, 0))
        if cpu - cpu0 > 0.005 * wall:
            threads.append((tid == str(server.pid), (cpu - cpu0) / tokens * 1e3, (vol - vol0) / tokens,
                            (inv - inv0) / tokens))
    busy = busy1 - busy0
    return {"tpot": metrics["median_tpot_ms"], "wall": wall / tokens * 1e3, "client": client / tokens * 1e3,
            "busy": busy / tokens * 1e3, "threads": sorted(threads, key=lambda t: -t[1])}


def offline(args: argparse.Namespace) -> float:
    """The median offline step in a fresh process (perf/decode_step.py, one round), ms."""
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "decode_step.py"), "--model",
                          args.model, "--dtype", "bfloat16", "--rounds", "1", "--steps", str(args.output_len - 1)],
                         capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("native"))
    return float(line.split("wall ms")[1].split("|")[0].split()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=servers.DEFAULT_MODEL, help="model folder (default: the tiny Qwen3)")
    parser.add_argument("--server-args", default="--dtype bfloat16", help="server.py flags")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4, help="measured requests a round (after one warm-up)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args(argv)
    args.model = servers.ensure_model(args.model)
    tokenizer = bench.load_tokenizer(args.model)
    prompts = bench.make_random_prompts(tokenizer, args.requests + 1, args.input_len, args.output_len)
    print(f"one client, {args.input_len} in / {args.output_len} out, {args.requests} requests a round; "
          f"ms a token (CPU ms a token for threads; context switches a token: voluntary/involuntary)")
    rows = []
    for round_ in range(args.rounds):
        sides = ("served", "offline") if round_ % 2 == 0 else ("offline", "served")
        got = {side: served(args, prompts) if side == "served" else offline(args) for side in sides}
        s = got["served"]
        rows.append((s["tpot"], got["offline"], s["busy"] / s["wall"], s["client"]))
        threads = "; ".join(f"{'loop' if main_ else 'thread'} {cpu:.2f} ({vol:.1f}/{inv:.1f})"
                            for main_, cpu, vol, inv in s["threads"])
        print(f"round {round_ + 1}: served {s['tpot']:.2f} (wall {s['wall']:.2f}), slot busy {s['busy']:.2f} (prefills "
              f"included), "
              f"offline step {got['offline']:.2f}, client CPU {s['client']:.2f} | {threads}", flush=True)
    tpot, step, busy, client = (statistics.median(column) for column in zip(*rows))
    print(f"medians: served {tpot:.2f} = offline step {step:.2f} + {tpot - step:.2f}; the slot busy {busy:.0%} of "
          f"the wall (idle between steps: the rest); client CPU {client:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
