"""Peers: the same workload, model and machine against xllm_async, LitServe (dynamic batching)
and the naive FastAPI server (transformers behind a thread pool).

    .venv/bin/python perf/peers/compare.py                      # 320 in, 1 out, 200 prompts, 1,2,32, 2 rounds
    .venv/bin/python perf/peers/compare.py --num-prompts 100 --rounds 1

1. The peers run in their own virtual environment, perf/peers/.venv, made once from the
   project's Python: the on-disk CPU torch first, then requirements.txt, then the project
   itself (for its transformers, tokenizers... pins). It is set up again only when
   requirements.txt or pyproject.toml change.
2. Without --model, a tiny random Qwen3 folder is built once at perf/results/models/qwen3-tiny.
3. Each round starts the servers one at a time, each fresh on a free port, waits for /health,
   warms it up (unmeasured requests at the largest concurrency), runs every concurrency and
   stops it: only one server is ever up. The order turns by one each round, so drift on a
   shared machine falls on all of them alike.
4. In the first round, before its timing, each server's greedy 4-token text for the first
   prompt (whole and streamed) must equal ours; a difference is printed as a WARNING.
5. The workload is perf/bench_serving.py's: `make_random_prompts` and `benchmark()`, in this
   process, the same prompts for every server. The table shows the median over rounds and the
   ratios ours/peer; every run is appended as a JSON line to perf/results/peers.jsonl.

Server logs go to perf/results/peers/. Servers are stopped on exit, on Ctrl-C and on SIGTERM:
SIGTERM first, then SIGKILL to whatever is left of their own process group.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

PEERS_DIR = os.path.dirname(os.path.abspath(__file__))
PERF_DIR = os.path.dirname(PEERS_DIR)
ROOT = os.path.dirname(PERF_DIR)
# perf/ is a folder of scripts, not a package: they import each other by name, from perf/ on sys.path.
sys.path.insert(0, PERF_DIR)

import bench_serving as bench  # noqa: E402
import servers  # noqa: E402
from cli import positive_ints  # noqa: E402

RESULTS = os.path.join(PERF_DIR, "results")
OUR_PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
PEERS_VENV = os.path.join(PEERS_DIR, ".venv")
PEERS_PYTHON = os.path.join(PEERS_VENV, "bin", "python")
TORCH_PIN = "torch==2.13.0"  # the on-disk CPU wheel, as the Makefile installs it
OURS = "xllm_async"
CHECK_TOKENS = 4


# --- set-up ----------------------------------------------------------------------------------


def run_step(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, cwd=ROOT, check=True)


def ensure_peers_venv() -> None:
    """perf/peers/.venv with torch, the peers' requirements and the project, set up when they changed."""
    stamp = os.path.join(PEERS_VENV, ".installed")
    digest = hashlib.sha256()
    for name in (os.path.join(PEERS_DIR, "requirements.txt"), os.path.join(ROOT, "pyproject.toml")):
        with open(name, "rb") as f:
            digest.update(f.read())
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == digest.hexdigest():
                return
    if not os.path.exists(PEERS_PYTHON):
        run_step([OUR_PYTHON, "-m", "venv", PEERS_VENV])
    pip = [PEERS_PYTHON, "-m", "pip", "install", "-q"]
    run_step(pip + [TORCH_PIN])  # first, so that nothing after it pulls another torch
    run_step(pip + ["-r", os.path.join(PEERS_DIR, "requirements.txt")])
    run_step(pip + ["-e", ROOT])
    with open(stamp, "w") as f:
        f.write(digest.hexdigest())


# --- servers ---------------------------------------------------------------------------------


@dataclass
class Server:
    """How to start one server (running_server adds the port)."""

    name: str
    python: str
    args: list[str]

    def command(self, model: str) -> list[str]:
        return [self.python, *self.args, "--model", model]


def servers_for(args: argparse.Namespace) -> list[Server]:
    every = {
        OURS: Server(OURS, OUR_PYTHON, ["server.py", "--access-log", "off", "--scheduler", "fixed_steps",
                                        "--concurrent-execute-stream-num", str(args.ours_streams)]),
        "litserve": Server("litserve", PEERS_PYTHON, [os.path.join(PEERS_DIR, "litserve_server.py"),
                                                      "--max-batch-size", str(args.max_batch_size),
                                                      "--batch-timeout", str(args.batch_timeout)]),
        "fastapi": Server("fastapi", PEERS_PYTHON, [os.path.join(PEERS_DIR, "fastapi_server.py")]
                          + (["--threads", str(args.fastapi_threads)] if args.fastapi_threads else [])),
    }
    names = [name.strip() for name in args.servers.split(",") if name.strip()]
    unknown = [name for name in names if name not in every]
    if unknown or OURS not in names:
        raise SystemExit(f"compare: --servers must include {OURS} and name only {', '.join(every)}")
    return [every[OURS]] + [every[name] for name in names if name != OURS]


# --- measuring -------------------------------------------------------------------------------


def cpu_seconds(pgid: int) -> tuple[float, float, float] | None:
    """CPU seconds used so far by the whole machine, by the server's process group and by this
    client process; None where /proc cannot tell."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
        group = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[2]) == pgid:
                group += int(fields[11]) + int(fields[12])
    except (OSError, ValueError):
        return None
    own = os.times()
    return (user + nice + system + irq + softirq) / hz, group / hz, own.user + own.system


def cpu_shares(before: tuple | None, after: tuple | None, seconds: float) -> dict:
    """Where the CPU went during a run, in % of one core: the server, the client, everyone else
    (other people's work on a shared machine: the noise to look at before trusting a number)."""
    if before is None or after is None or seconds <= 0:
        return {}
    machine, server, client = (100 * (b - a) / seconds for a, b in zip(before, after))
    return {"cpu_server_pct": server, "cpu_client_pct": client, "cpu_others_pct": max(machine - server - client, 0.0)}


async def greedy_texts(base_url: str, prompt, model: str) -> tuple[str, str]:
    """The server's greedy CHECK_TOKENS-token text for the prompt, whole and streamed."""
    host, port, _ = bench.split_base_url(base_url)
    check = bench.Prompt(prompt.prompt, prompt.prompt_len, CHECK_TOKENS)
    texts = []
    for stream in (False, True):
        conn = bench.HttpConnection(host, port)
        try:
            result = await bench.send_request(conn, "/v1/completions",
                                              bench.request_body(check, model=model, chat=False, stream=stream),
                                              check.prompt_len, chat=False, stream=stream)
        finally:
            conn.close()
        texts.append(result.generated_text if result.success else f"<error: {result.error}>")
    return texts[0], texts[1]


async def measure(base_url: str, pgid: int, server: str, prompts: list, tokenizer, model: str,
                  args: argparse.Namespace) -> dict[int, dict]:
    """One warm-up, unmeasured, then the workload at each concurrency, with where the CPU went."""
    common = dict(tokenizer=tokenizer, model=model, stream=args.stream, backend=server)
    if args.warmup_prompts:
        await bench.benchmark(base_url, prompts[:args.warmup_prompts], max_concurrency=max(args.concurrency), **common)
    results = {}
    for c in args.concurrency:
        before, start = cpu_seconds(pgid), time.monotonic()
        metrics = await bench.benchmark(base_url, prompts, max_concurrency=c, warmup_requests=1, **common)
        results[c] = {**metrics, **cpu_shares(before, cpu_seconds(pgid), time.monotonic() - start)}
    return results


def same_text(name: str, got: tuple[str, str], ours: tuple[str, str]) -> bool:
    """A server's greedy text against ours; prints the verdict."""
    if name == OURS:
        print(f"  correctness: our greedy {CHECK_TOKENS} tokens are {ours[0]!r}")
    elif got == ours:
        print(f"  correctness: {name} gives the same text, whole and streamed")
    else:
        print(f"WARNING: {name} answers {got[0]!r} whole and {got[1]!r} streamed; {OURS}: {ours[0]!r} and "
              f"{ours[1]!r}. The timings compare different computations.", flush=True)
    return got == ours


def run_line(concurrency: int, metrics: dict) -> str:
    cpu = {key: metrics.get(f"cpu_{key}_pct", math.nan) for key in ("server", "client", "others")}
    return (f"  c={concurrency:<3} {metrics['request_throughput']:8.1f} req/s  mean E2E "
            f"{metrics['mean_e2e_latency_ms']:8.1f} ms  failed {metrics['failed']}  "
            f"cpu (% of a core): " + ", ".join(f"{key} {value:.0f}" for key, value in cpu.items()))


def run_all(args: argparse.Namespace, lineup: list[Server], model: str) -> list[dict]:
    tokenizer = bench.load_tokenizer(model)
    name = os.path.basename(model)
    prompts = bench.make_random_prompts(tokenizer, args.num_prompts, args.random_input, args.random_output,
                                        1.0, args.seed, args.prompt_format)
    rows: list[dict] = []
    ours: tuple[str, str] = ("", "")
    same: dict[str, bool] = {}
    for round_index in range(args.rounds):
        turn = round_index % len(lineup)
        for server in lineup[turn:] + lineup[:turn]:
            print(f"round {round_index + 1}/{args.rounds}: {server.name}", flush=True)
            log_path = servers.server_log("peers", server.name)
            # In a process group of its own: LitServe's workers are stopped with it.
            with servers.running_server(server.command(model), log_path, server.name, own_group=True) as up:
                if round_index == 0:  # ours comes first in the first round
                    got = asyncio.run(greedy_texts(up.base_url, prompts[0], name))
                    ours = got if server.name == OURS else ours
                    same[server.name] = same_text(server.name, got, ours)
                results = bench.run(measure(up.base_url, up.pid, server.name, prompts, tokenizer, name, args))
            for concurrency, metrics in results.items():
                row = {**metrics, "suite": "peers", "server": server.name, "round": round_index + 1,
                       "concurrency": concurrency, "model_dir": model, "random_input": args.random_input,
                       "random_output": args.random_output, "prompt_format": args.prompt_format,
                       "same_greedy_text": same.get(server.name)}
                rows.append(row)
                bench.append_json_line(args.output_file, row)
                print(run_line(concurrency, metrics), flush=True)
    return rows


# --- report ----------------------------------------------------------------------------------

FIGURES = (("request_throughput", "req/s"), ("mean_e2e_latency_ms", "mean E2E ms"),
           ("median_e2e_latency_ms", "median E2E ms"))


def summarize(rows: list[dict]) -> dict[tuple[str, int], dict[str, float]]:
    """Median over rounds of each figure, per (server, concurrency); failures summed."""
    grouped: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["server"], row["concurrency"]), []).append(row)
    return {key: {**{f: statistics.median(r[f] for r in runs) for f, _ in FIGURES},
                  "failed": sum(r["failed"] for r in runs),
                  "others": statistics.median(r.get("cpu_others_pct", math.nan) for r in runs)}
            for key, runs in grouped.items()}


def format_table(summary: dict[tuple[str, int], dict[str, float]], names: list[str],
                 concurrencies: list[int]) -> str:
    """One row per concurrency and server; the peers' rows end with ours/peer for each figure."""
    head = (f"{'conc':>4}  {'server':<10} {'req/s':>8} {'mean E2E ms':>12} {'median E2E ms':>14} {'failed':>6} "
            f"{'others %cpu':>11}  | ours/peer: {'req/s':>6} {'mean E2E':>9} {'median E2E':>11}")
    lines = [head, "-" * len(head)]
    for c in concurrencies:
        ours = summary[(OURS, c)]
        for name in names:
            s = summary[(name, c)]
            line = (f"{c:>4}  {name:<10} {s['request_throughput']:>8.1f} {s['mean_e2e_latency_ms']:>12.1f} "
                    f"{s['median_e2e_latency_ms']:>14.1f} {s['failed']:>6} {s['others']:>11.0f}  |")
            if name != OURS:
                ratios = [f"{ours[f] / s[f]:.2f}x" if s[f] else "-" for f, _ in FIGURES]
                line += f"{'':11} {ratios[0]:>6} {ratios[1]:>9} {ratios[2]:>11}"
            lines.append(line)
    lines.append("ours/peer: req/s above 1 means we serve more; E2E below 1 means we answer sooner.")
    lines.append("others %cpu: CPU that other processes on the machine used during the run (% of one core).")
    return "\n".join(lines)


# --- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: a tiny random Qwen3, built once)")
    parser.add_argument("--servers", default=f"{OURS},litserve,fastapi", help="which to run; ours always")
    parser.add_argument("--random-input", type=int, default=320, help="prompt tokens")
    parser.add_argument("--random-output", type=int, default=1, help="output tokens")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 2, 32], help="e.g. 1,2,32")
    parser.add_argument("--rounds", type=int, default=2, help="each server started fresh once per round")
    parser.add_argument("--warmup-prompts", type=int, default=32, help="sent unmeasured after each start")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="whole responses, no SSE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ours-streams", type=int, default=2, help="our fixed_steps slots (N)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="LitServe's")
    parser.add_argument("--batch-timeout", type=float, default=0.005, help="LitServe's, seconds")
    parser.add_argument("--fastapi-threads", type=int, help="FastAPI's pool (default: ThreadPoolExecutor's)")
    parser.add_argument("--skip-install", action="store_true", help="use perf/peers/.venv as it is")
    parser.add_argument("--output-file", default=os.path.join(RESULTS, "peers.jsonl"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.num_prompts < 1:
        raise SystemExit("compare: --rounds and --num-prompts must be at least 1")
    servers.interrupt_on_sigterm()
    bench.raise_open_file_limit()
    if not args.skip_install:
        ensure_peers_venv()
    lineup = servers_for(args)
    try:
        model = servers.ensure_model(args.model)
        rows = run_all(args, lineup, model)
    except servers.ServerError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the running server was stopped on the way out
        print("compare: interrupted", file=sys.stderr)
        return 130
    print(f"\nmodel {model}: {args.random_input} tokens in ({args.prompt_format}), {args.random_output} out, "
          f"{args.num_prompts} prompts, {'streamed' if args.stream else 'whole'}, median of {args.rounds} round(s)")
    print(format_table(summarize(rows), [s.name for s in lineup], args.concurrency))
    print(f"runs appended to {args.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
