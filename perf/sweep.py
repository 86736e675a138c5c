"""Concurrency sweep: starts each server configuration itself, runs bench_serving's workload
at every concurrency against it, and writes a CSV, two PNG plots and a summary table.

    python perf/sweep.py --concurrency 1,2,4,8,16,32,64 --rounds 3 \\
        --config "continuous-N1=--scheduler continuous --concurrent-execute-stream-num 1" \\
        --config "fixed_steps-N2=--scheduler fixed_steps --concurrent-execute-stream-num 2"

A configuration is NAME=ARGS: ARGS are server.py flags, added after
`server.py --model MODEL --access-log off` (the port is chosen here). ARGS that begin with
`@PATH` run PATH/server.py, another checkout: `--config "before=@/tmp/wt-before"` measures a
worktree of an older commit against this one, side by side. The first configuration
is the baseline that the others' throughput is divided by.

Rounds interleave the configurations (round 1: A then B, round 2: A then B, ...), each
started fresh, so that slow drift on a shared machine falls on all of them alike; the plots
and the summary show the median over rounds.

Every point sends the same random prompts (bench_serving's `make_random_prompts`, one seed)
through bench_serving's `benchmark()`, in this process. A server that was just started is
warmed up first: a few requests at the largest concurrency, not measured. Rows are appended
to the CSV as they are measured, so an interrupted sweep keeps what it had.

Without --model, a tiny random Qwen3 is built once under perf/results/models/ (nothing is
downloaded). Servers are run by the Python that runs this script; they are stopped on exit,
on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import statistics
import sys
from collections.abc import Callable
from datetime import datetime

import bench_serving as bench
import servers
from cli import cpu_model, positive_ints

DEFAULT_CONFIGS = (
    "continuous-N1=--scheduler continuous --concurrent-execute-stream-num 1",
    "fixed_steps-N2=--scheduler fixed_steps --concurrent-execute-stream-num 2",
)
# Prefill-heavy, as the traffic the server is built for; shared with offline.py.
DEFAULT_INPUT = 256
DEFAULT_OUTPUT = 16

# CSV columns, and the bench_serving metric each one is read from.
METRIC_COLUMNS = {
    "req_per_s": "request_throughput",
    "output_tok_per_s": "output_throughput",
    "mean_e2e_ms": "mean_e2e_latency_ms",
    "median_e2e_ms": "median_e2e_latency_ms",
    "p90_e2e_ms": "p90_e2e_latency_ms",
    "p99_e2e_ms": "p99_e2e_latency_ms",
    "mean_ttft_ms": "mean_ttft_ms",
    "p99_ttft_ms": "p99_ttft_ms",
    "failed": "failed",
}
CSV_COLUMNS = ["config", "concurrency", "round", *METRIC_COLUMNS, "completed", "num_prompts", "duration_s",
               "outputs_differ"]


class SweepError(Exception):
    """The sweep cannot go on (bad arguments, a failed warm-up): one line for the user."""


# --- arguments -------------------------------------------------------------------------------


def parse_config(text: str) -> tuple[str, list[str]]:
    """'NAME=ARGS' -> (NAME, ARGS split as a shell would)."""
    name, sep, args = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise SweepError(f"--config must be NAME=ARGS, got {text!r}")
    try:
        return name, shlex.split(args)
    except ValueError as exc:
        raise SweepError(f"--config {name}: cannot split its arguments: {exc}") from None


def parse_configs(texts: list[str]) -> dict[str, list[str]]:
    """The configurations in the order given (the first is the baseline); names must differ."""
    configs: dict[str, list[str]] = {}
    for text in texts:
        name, args = parse_config(text)
        if name in configs:
            raise SweepError(f"--config {name} is given twice")
        configs[name] = args
    return configs


def prompts_for(concurrency: int, num_prompts: int | None) -> int:
    """Enough prompts that every connection sends several: max(100, 4 * concurrency) unless fixed."""
    return num_prompts or max(100, 4 * concurrency)


# --- measuring -------------------------------------------------------------------------------


def make_row(config: str, concurrency: int, round_index: int, metrics: dict) -> dict:
    """One CSV row from bench_serving's metrics of one point."""
    row = {"config": config, "concurrency": concurrency, "round": round_index}
    row.update({column: metrics[key] for column, key in METRIC_COLUMNS.items()})
    row.update(completed=metrics["completed"], num_prompts=metrics["num_prompts"], duration_s=metrics["duration"],
               outputs_differ=metrics.get("outputs_differ", 0))
    return row


def count_differences(reference: list[str | None], texts: list[str | None]) -> int:
    """Prompts answered in both runs whose answers differ (failures are counted apart, as failed)."""
    return sum(1 for a, b in zip(reference, texts) if a is not None and b is not None and a != b)


class OutputCheck:
    """Every point's answers against the first point measured at the same concurrency: greedy
    decoding with EOS ignored must give every configuration, every round, the same text."""

    def __init__(self) -> None:
        self.reference: dict[int, list[str | None]] = {}

    def differences(self, concurrency: int, texts: list[str | None]) -> int:
        return count_differences(self.reference.setdefault(concurrency, texts), texts)


class CsvLog:
    """The sweep's CSV; each row is appended as its point is measured, so an interrupted sweep keeps it."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "w", newline="") as f:
            csv.DictWriter(f, CSV_COLUMNS).writeheader()

    def add(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, CSV_COLUMNS).writerow({k: f"{v:.3f}" if isinstance(v, float) else v
                                                     for k, v in row.items()})


async def sweep_server(base_url: str, prompts: list, tokenizer, args: argparse.Namespace,
                       record: Callable[[int, dict], None]) -> None:
    """Warm the server up, then measure every concurrency in order, handing each (concurrency,
    metrics, with each prompt's answer) to record as soon as it is measured; record adds
    "outputs_differ"."""
    model = (await bench.fetch_model_info(base_url))["id"]
    common = {"tokenizer": tokenizer, "model": model, "stream": args.stream, "seed": args.seed}
    top = max(args.concurrency)
    # Unmeasured: the first forwards at new shapes pay for allocations, and connections are new.
    warm = await bench.benchmark(base_url, prompts[:args.warmup_prompts], max_concurrency=top, **common)
    if warm["failed"]:
        raise SweepError(f"warm-up failed: {warm['first_error']}")
    for concurrency in args.concurrency:
        count = prompts_for(concurrency, args.num_prompts)
        metrics = await bench.benchmark(base_url, prompts[:count], max_concurrency=concurrency,
                                        warmup_requests=1, keep_texts=True, **common)
        record(concurrency, metrics)
        print(f"  concurrency {concurrency:>4}: {metrics['request_throughput']:8.2f} req/s, "
              f"median E2E {metrics['median_e2e_latency_ms']:8.1f} ms, failed {metrics['failed']}, "
              f"answers unlike the first run's {metrics['outputs_differ']}", flush=True)
        if args.tables:
            metrics["backend"] = args.current_config
            print(bench.format_table(metrics), flush=True)


def run_sweep(args: argparse.Namespace, configs: dict[str, list[str]], csv_log: CsvLog) -> list[dict]:
    """Every round, every configuration started in turn and swept; returns the CSV rows."""
    tokenizer = bench.load_tokenizer(args.model)
    # One list for every point: the same seed gives each point the same first prompts.
    most = max(max(prompts_for(c, args.num_prompts) for c in args.concurrency), args.warmup_prompts)
    prompts = bench.make_random_prompts(tokenizer, most, args.random_input, args.random_output,
                                        args.random_range_ratio, seed=args.seed)
    rows = []
    answers = OutputCheck()
    print(f"CPU: {cpu_model()}", flush=True)
    for round_index in range(1, args.rounds + 1):
        for name, server_args in configs.items():
            print(f"round {round_index}/{args.rounds}: {name} ({shlex.join(server_args)})", flush=True)

            def record(concurrency: int, metrics: dict, name: str = name, round_index: int = round_index) -> None:
                metrics["outputs_differ"] = answers.differences(concurrency, metrics.pop("generated_texts"))
                rows.append(make_row(name, concurrency, round_index, metrics))
                csv_log.add(rows[-1])

            args.current_config = name  # the label of the full tables
            log_path = os.path.join(args.out_dir, f"server-{safe_name(name)}-round{round_index}.log")
            with servers.running_server(servers.server_command(args.model, server_args), log_path, name) as server:
                bench.run(sweep_server(server.base_url, prompts, tokenizer, args, record))
    return rows


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# --- results ---------------------------------------------------------------------------------


def medians(rows: list[dict]) -> dict[tuple[str, int], dict[str, float]]:
    """(config, concurrency) -> the median over rounds of every metric column."""
    grouped: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["config"], row["concurrency"]), []).append(row)
    return {key: {column: statistics.median(r[column] for r in group) for column in METRIC_COLUMNS}
            for key, group in grouped.items()}


def throughput_ratios(summary: dict[tuple[str, int], dict[str, float]], configs: list[str],
                      concurrencies: list[int]) -> dict[int, dict[str, float]]:
    """concurrency -> config -> its req/s over the first config's (nan where either is missing or zero)."""
    ratios: dict[int, dict[str, float]] = {}
    for concurrency in concurrencies:
        base = summary.get((configs[0], concurrency), {}).get("req_per_s", 0.0)
        ratios[concurrency] = {}
        for config in configs:
            value = summary.get((config, concurrency), {}).get("req_per_s")
            ratios[concurrency][config] = value / base if value is not None and base else math.nan
    return ratios


def round_ratios(rows: list[dict], configs: list[str]) -> dict[tuple[str, int], list[float]]:
    """(config, concurrency) -> its req/s over the first config's in the same round, round by round.

    The runs of one round are minutes apart, the rounds further: so these pair runs that shared
    the machine's mood, and their spread shows how far one run's ratio can be trusted."""
    base = {(row["concurrency"], row["round"]): row["req_per_s"] for row in rows if row["config"] == configs[0]}
    ratios: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        reference = base.get((row["concurrency"], row["round"]))
        if row["config"] != configs[0] and reference:
            ratios.setdefault((row["config"], row["concurrency"]), []).append(row["req_per_s"] / reference)
    return ratios


def format_round_ratios(ratios: dict[tuple[str, int], list[float]]) -> str:
    """One line per (config, concurrency): the median per-round ratio and its range ('' with one round)."""
    lines = [f"  {config} at {concurrency}: median {statistics.median(values):.2f}, "
             f"rounds {min(values):.2f}-{max(values):.2f}"
             for (config, concurrency), values in ratios.items() if len(values) > 1]
    return "\n".join(["per-round ratios (each round's runs against each other):", *lines]) if lines else ""


def format_summary(summary: dict[tuple[str, int], dict[str, float]], configs: list[str],
                   concurrencies: list[int]) -> str:
    """The medians as a table: one line per (config, concurrency)."""
    width = max(len(c) for c in configs + ["config"])
    header = (f"{'config':<{width}} {'conc':>5} {'req/s':>9} {'out tok/s':>10} {'p50 E2E ms':>11} "
              f"{'p99 E2E ms':>11} {'mean TTFT':>10} {'failed':>7}")
    lines = [header]
    for config in configs:
        for concurrency in concurrencies:
            m = summary.get((config, concurrency))
            if m is None:
                continue
            lines.append(f"{config:<{width}} {concurrency:>5} {m['req_per_s']:>9.2f} {m['output_tok_per_s']:>10.1f} "
                         f"{m['median_e2e_ms']:>11.1f} {m['p99_e2e_ms']:>11.1f} {m['mean_ttft_ms']:>10.1f} "
                         f"{m['failed']:>7g}")
    return "\n".join(lines)


def format_ratios(ratios: dict[int, dict[str, float]], configs: list[str]) -> str:
    """Throughput of every config over the first one's, one line per concurrency."""
    width = max(len(c) for c in configs) + 2
    lines = [f"throughput / {configs[0]}",
             f"{'conc':>5}" + "".join(f"{config:>{width}}" for config in configs)]
    for concurrency, by_config in ratios.items():
        lines.append(f"{concurrency:>5}" + "".join(f"{by_config[config]:>{width}.2f}" for config in configs))
    return "\n".join(lines)


def format_output_check(rows: list[dict]) -> str:
    """Whether every run answered like the first run at its concurrency, and where not."""
    unlike = [row for row in rows if row["outputs_differ"]]
    if not unlike:
        return "answers: identical in every configuration and round (each point against the first at its concurrency)"
    return "answers DIFFER from the first run at the same concurrency:\n" + "\n".join(
        f"  {row['config']} round {row['round']} concurrency {row['concurrency']}: "
        f"{row['outputs_differ']} of {row['completed']} prompts" for row in unlike)


def plot(summary: dict[tuple[str, int], dict[str, float]], configs: list[str], concurrencies: list[int],
         out_dir: str) -> list[str]:
    """throughput.png (req/s) and latency.png (P50 and P99 E2E) against concurrency on a log2
    axis, one line per configuration; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    throughput_path = os.path.join(out_dir, "throughput.png")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw_lines(ax, summary, configs, concurrencies, "req_per_s", "requests/s")
    ax.set_title("Throughput")
    fig.tight_layout()
    fig.savefig(throughput_path, dpi=120)
    plt.close(fig)

    latency_path = os.path.join(out_dir, "latency.png")
    fig, (p50, p99) = plt.subplots(1, 2, figsize=(12, 4.5))
    draw_lines(p50, summary, configs, concurrencies, "median_e2e_ms", "ms")
    p50.set_title("P50 end-to-end latency")
    draw_lines(p99, summary, configs, concurrencies, "p99_e2e_ms", "ms")
    p99.set_title("P99 end-to-end latency")
    fig.tight_layout()
    fig.savefig(latency_path, dpi=120)
    plt.close(fig)
    return [throughput_path, latency_path]


def draw_lines(ax, summary: dict, configs: list[str], concurrencies: list[int], column: str, ylabel: str) -> None:
    for config in configs:
        points = [(c, summary[(config, c)][column]) for c in concurrencies if (config, c) in summary]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=config)
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()


def report(rows: list[dict], configs: list[str], concurrencies: list[int], out_dir: str) -> None:
    """Print the summary and the ratios, and draw the plots (skipped without matplotlib)."""
    summary = medians(rows)
    print()
    print(format_summary(summary, configs, concurrencies))
    print()
    print(format_ratios(throughput_ratios(summary, configs, concurrencies), configs))
    if per_round := format_round_ratios(round_ratios(rows, configs)):
        print(per_round)
    print()
    print(format_output_check(rows))
    try:
        paths = plot(summary, configs, concurrencies, out_dir)
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return
    print("plots: " + ", ".join(paths))


# --- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", metavar="NAME=ARGS",
                        help="a server configuration, repeatable (default: continuous-N1 and fixed_steps-N2)")
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 2, 4, 8, 16, 32, 64],
                        help="comma-separated concurrencies (default: 1,2,4,8,16,32,64)")
    parser.add_argument("--rounds", type=int, default=1, help="sweeps of every configuration, interleaved")
    parser.add_argument("--model", default=servers.DEFAULT_MODEL,
                        help="model folder (default: a tiny random Qwen3, built once)")
    parser.add_argument("--random-input", type=int, default=DEFAULT_INPUT, help="prompt tokens")
    parser.add_argument("--random-output", type=int, default=DEFAULT_OUTPUT, help="output tokens")
    parser.add_argument("--random-range-ratio", type=float, default=1.0,
                        help="prompt lengths uniform in [input * ratio, input] (1.0: all exactly --random-input)")
    parser.add_argument("--num-prompts", type=int, help="prompts per point (default: max(100, 4 * concurrency))")
    parser.add_argument("--warmup-prompts", type=int, default=16, help="unmeasured requests after each start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tables", action="store_true",
                        help="also print each run's full \"Serving Benchmark Result\" table")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="SSE or whole responses")
    parser.add_argument("--out-dir", help="where the CSV, plots and server logs go "
                                          "(default: perf/results/sweep-<timestamp>)")
    return parser


def check_args(args: argparse.Namespace) -> dict[str, list[str]]:
    if args.rounds < 1 or (args.num_prompts is not None and args.num_prompts < 1) or args.warmup_prompts < 1:
        raise SweepError("--rounds, --num-prompts and --warmup-prompts must be at least 1")
    args.out_dir = args.out_dir or os.path.join(servers.PERF_DIR, "results", f"sweep-{datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(args.out_dir, exist_ok=True)
    args.model = servers.ensure_model(args.model)
    return parse_configs(args.config or list(DEFAULT_CONFIGS))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    servers.interrupt_on_sigterm()
    bench.raise_open_file_limit()
    try:
        configs = check_args(args)
        csv_log = CsvLog(os.path.join(args.out_dir, "sweep.csv"))
        rows = run_sweep(args, configs, csv_log)
    except (SweepError, servers.ServerError, bench.BenchmarkError) as exc:
        print(f"sweep: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nsweep: interrupted; the points measured so far are in {args.out_dir}", file=sys.stderr)
        return 130
    report(rows, list(configs), args.concurrency, args.out_dir)
    print(f"csv: {csv_log.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
