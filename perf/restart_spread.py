"""The same speed after every restart? One client's decode in N fresh servers, one after another,
and in N fresh offline processes, so that what moves with the process can be told apart from what
the serving adds.

    python perf/restart_spread.py --model ~/.cache/xllm_async/SmolLM2-135M-Instruct --processes 5
    python perf/restart_spread.py --model ... --variant weights= --variant all=XLLM_HUGE_PAGES=all \
      --variant off=XLLM_HUGE_PAGES=off

Each round starts, for every variant (a name and environment variables for its processes; the
default is one variant, "default", with this environment), one fresh server (`--server-args`) and
one fresh offline process, in an order that alternates from round to round, only one at a time:
- served: bench_serving's client at one connection, `--warmup` requests unmeasured, then
  `--requests` of `--input-len` in / `--output-len` out (random prompts, greedy, ignore_eos):
  the median time per output token after the first (TPOT), in ms;
- offline: the same prompts through the runner on this thread bound as a lone slot binds its own
  (`--threads`, a lone request's on fixed_steps N=2: every core), a prefill then output_len - 1
  decode steps each (perf/decode_step.py's steps): the median step, in ms.
Per variant and side: each process's figure, and the spread across processes, max/min - 1 and
the coefficient of variation (stdev / mean); the load average when each process ran (the machine
may be shared); and whether every process gave the same tokens (the first measured prompt's).

Every process imports this checkout's package (server.py does from its folder; the offline one
gets it first on PYTHONPATH), so a variant measures this checkout's code.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import bench_serving as bench
import servers
import sweep

DEFAULT_SERVER = "--dtype bfloat16"  # fixed_steps N=2, the server's defaults


class SpreadError(Exception):
    """The run cannot go on (a failed process or request): one line for the user."""


def parse_variants(texts: list[str]) -> list[tuple[str, dict[str, str]]]:
    """'NAME=VAR=VALUE VAR=VALUE' (or 'NAME=' for this environment) each -> (name, variables), in
    order; names must differ (sweep.parse_configs' rules)."""
    variants = []
    for name, items in sweep.parse_configs(texts).items():
        env = {}
        for item in items:
            var, sep, value = item.partition("=")
            if not sep or not var:
                raise sweep.SweepError(f"--variant {name}: {item!r} is not VAR=VALUE")
            env[var] = value
        variants.append((name, env))
    return variants


def spread(values: list[float]) -> dict[str, float]:
    """Median, max/min - 1 and the coefficient of variation (population stdev over the mean)."""
    mean = statistics.fmean(values)
    return {"median": statistics.median(values), "max_over_min": max(values) / min(values) - 1,
            "cv": statistics.pstdev(values) / mean if mean else 0.0}


def prompts_for(args: argparse.Namespace) -> list:
    tokenizer = bench.load_tokenizer(args.model)
    return bench.make_random_prompts(tokenizer, args.warmup + args.requests, args.input_len, args.output_len,
                                     seed=args.seed)


def run_served(args: argparse.Namespace, prompts: list, env: dict[str, str], name: str) -> dict:
    """One fresh server with the variant's environment: its median TPOT and first answer."""
    command = servers.server_command(args.model, shlex.split(args.server_args))
    saved = {var: os.environ.get(var) for var in env}
    os.environ.update(env)  # (running_server's process inherits this environment)
    try:
        with servers.running_server(command, servers.server_log("restart_spread", name), name) as server:
            load = os.getloadavg()[0]
            tokenizer = bench.load_tokenizer(args.model)
            model = bench.run(bench.fetch_model_info(server.base_url))["id"]
            metrics = bench.run(bench.benchmark(server.base_url, prompts, tokenizer=tokenizer, model=model,
                                                max_concurrency=1, warmup_requests=args.warmup, keep_texts=True))
    finally:
        for var, value in saved.items():
            os.environ.pop(var, None) if value is None else os.environ.__setitem__(var, value)
    if metrics["failed"]:
        raise SpreadError(f"{name}: {metrics['failed']} request(s) failed: {metrics['first_error']}")
    return {"ms": metrics["median_tpot_ms"], "load": load, "answer": metrics["generated_texts"][args.warmup]}


def run_offline(args: argparse.Namespace, env: dict[str, str], name: str) -> dict:
    """One fresh offline process with the variant's environment: its median step and first tokens."""
    command = [sys.executable, os.path.abspath(__file__), "--offline-child", "--model", args.model,
               "--threads", str(args.threads), "--warmup", str(args.warmup), "--requests", str(args.requests),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(args.seed)]
    child_env = {**os.environ, **env}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (servers.ROOT, child_env.get("PYTHONPATH")) if p)
    load = os.getloadavg()[0]
    done = subprocess.run(command, cwd=servers.ROOT, env=child_env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SpreadError(f"{name}: the offline process failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": load}


def offline_child(args: argparse.Namespace) -> int:
    """In the fresh process: the prompts' decode steps, one request at a time; one JSON line."""
    import decode_step

    from xllm_async.runtime.device import StreamBinding, resolve_device
    from xllm_async.runtime.model_runner import load_runner

    runner = load_runner(args.model, resolve_device("cpu"), "bfloat16")
    runner.set_kv_cache(None, 1)
    binding = StreamBinding(runner.device, args.threads)
    binding.enter()
    try:
        medians, first = [], None
        for index, prompt in enumerate(prompts_for(args)):
            seconds, tokens = decode_step.steps(runner, prompt.prompt, args.output_len - 1)
            if index >= args.warmup:
                medians.append(statistics.median(wall for wall, _ in seconds) * 1e3)
                first = tokens if first is None else first
    finally:
        binding.exit()
    print(json.dumps({"ms": statistics.median(medians), "answer": first}))
    return 0


def format_side(name: str, side: str, rows: list[dict]) -> str:
    figures, loads = [r["ms"] for r in rows], [r["load"] for r in rows]
    s = spread(figures)
    same = all(r["answer"] == rows[0]["answer"] for r in rows)
    return (f"{name:>10s} {side:7s} ms/token {' '.join(f'{f:6.2f}' for f in figures)} | median {s['median']:.2f}, "
            f"max/min - 1 {s['max_over_min'] * 100:.1f}%, CV {s['cv'] * 100:.1f}% | load "
            f"{' '.join(f'{load:.1f}' for load in loads)} | same tokens: {same}")


def run(args: argparse.Namespace) -> dict[str, dict[str, list[dict]]]:
    prompts = prompts_for(args)
    rows: dict[str, dict[str, list[dict]]] = {name: {"served": [], "offline": []} for name, _ in args.variant}
    for index in range(args.processes):
        jobs = [(name, env, side) for name, env in args.variant for side in ("served", "offline")]
        for name, env, side in jobs if index % 2 == 0 else jobs[::-1]:
            label = f"{name}-{side}-{index + 1}"
            row = run_served(args, prompts, env, label) if side == "served" else run_offline(args, env, label)
            rows[name][side].append(row)
            print(f"round {index + 1}: {name} {side} {row['ms']:.2f} ms/token (load {row['load']:.1f})", flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the tiny random Qwen3, built once)")
    parser.add_argument("--processes", type=int, default=5, help="fresh servers (and offline processes) a variant")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=VAR=VALUE ...: environment for that variant's processes (repeatable; "
                             "default: one variant, this environment)")
    parser.add_argument("--server-args", default=DEFAULT_SERVER, help="server.py flags")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="the offline process's torch threads (a lone request's on fixed_steps: every core)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests a process")
    parser.add_argument("--requests", type=int, default=4, help="measured requests a process")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-file", help="append one JSON line with every figure")
    parser.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.variant = parse_variants(args.variant) or [("default", {})]
    except sweep.SweepError as exc:
        parser.error(str(exc))
    if args.offline_child:
        return offline_child(args)
    servers.interrupt_on_sigterm()
    try:
        args.model = servers.ensure_model(args.model)
        rows = run(args)
    except (SpreadError, servers.ServerError, bench.BenchmarkError) as exc:
        print(f"restart_spread: {exc}", file=sys.stderr)
        return 1
    print(f"{args.processes} fresh processes a variant and side, 1 client, {args.input_len} in / {args.output_len} "
          f"out, {args.requests} requests after {args.warmup} warm-up; server: {args.server_args}")
    for name, sides in rows.items():
        for side, side_rows in sides.items():
            print(format_side(name, side, side_rows))
    answers = {json.dumps(r["answer"]) for sides in rows.values() for r in sides["offline"]}
    print(f"every offline process, every variant, the same tokens: {len(answers) == 1}")
    if args.output_file:
        record = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "server_args": args.server_args,
                  "variants": {name: env for name, env in args.variant},
                  "rows": {name: {side: [{k: v for k, v in r.items() if k != "answer"} for r in side_rows]
                                  for side, side_rows in sides.items()} for name, sides in rows.items()}}
        bench.append_json_line(args.output_file, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
