"""Wide beams (issue 15): latency and extra resident memory of one beam search per beam width,
with and without an item table; beam requests under load; the widest beam that must work.

    .venv/bin/python perf/beams.py                              # the table: widths 1,16,64,128,256
    .venv/bin/python perf/beams.py --throughput --widest        # and the other two parts (make beams)
    .venv/bin/python perf/beams.py --model perf/results/models/qwen3-tiny --widths 1,4 \\
        --prompt-tokens 40 --repetitions 2 --throughput-prompts 8   # a quick look that it runs

The model is the 8-layer, 512-wide random Qwen3 (`random_model --size medium`), built once at
perf/results/models/qwen3-medium. Prompts are random token ids, a fresh one per request (a
server with a prefix cache would otherwise answer repeats from it); every request asks
`--rounds` tokens (3: an item of 3 codebooks) and returns all its beams (`num_return_sequences`
= the width). The item table (5,000 items, 3 codebooks of 256 codes) is written with
perf/bench_serving.py's writer into perf/results/beams/.

1. The table: for each of "none" (no table: the whole vocabulary) and "items" (the server
   loaded the table), a fresh server (fixed_steps, N=2), then for each width one unmeasured
   request and `--repetitions` measured ones, one at a time. Per width: the median latency,
   its ratio to width 1's, and the extra resident memory: the peak of the server's resident
   memory while the request ran, minus its resident memory just before it (median and max over
   the repetitions). Resident memory is the sum of VmRSS over the server's process group,
   sampled every `--sample-ms` by a thread of this process (/proc/<pid>/statm).
2. `--throughput`: a fresh server with the table; `--throughput-concurrency` (8) clients send
   `--throughput-prompts` requests of width `--throughput-width` (128): req/s, items/s, P99
   latency, the share of asked items returned, the invalid ones, and the peak extra memory.
3. `--catalogues 5000x3x256,100000x3x256,1520000x4x8192`: the item table at catalogue scale
   (items x codebooks x codes, drawn at random; written with numpy into perf/results/beams/).
   A fresh server without a table, then one per catalogue: seconds from the process's start to
   /health, resident memory once ready (minus the server without a table's), median latency of
   `--catalogue-width` (128) beams on `--prompt-tokens` prompts (the no-table server's too),
   and the time a SIGHUP reload of the same file takes (until the load counter moves). Then
   `--catalogue-load-prompts` (64) requests from 8 clients while the table is reloaded 3 times
   (the same file, a bad file in its place, the same file again): failed requests, median and
   P99 against the same load without reloads.
4. `--widest`: a fresh server without the table; width `--widest-width` (512) on a
   `--widest-prompt-tokens` (2,000) token prompt must complete: its latency and extra memory.

The markdown tables are printed; every row goes to perf/results/beams/<time>.csv and the rows
with the run's settings to <time>.json. Server logs: perf/results/beams/*.log. Never a final
figure on a machine that others are using: look at the CPU first.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

import bench_serving as bench
import servers
from cli import cpu_model, positive_ints

RESULTS = os.path.join(servers.PERF_DIR, "results", "beams")
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1e6


# --- resident memory -------------------------------------------------------------------------


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (vLLM's API server, engine core and worker; ours is one)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[2]) == pgid:
                        pids.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    return pids


def resident_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            continue
    return total


class MemorySampler:
    """A thread that samples the resident memory of a process group every `interval` seconds and
    keeps the peak since the last `mark()`. The group's members are looked up again every second."""

    def __init__(self, pgid: int, interval: float) -> None:
        self.pgid = pgid
        self.interval = interval
        self.pids = group_pids(pgid)
        self.peak = resident_bytes(self.pids)
        self._window = 0  # mark() starts a new one: a sample read before it must not count in it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        looked_up = time.monotonic()
        while not self._stop.wait(self.interval):
            if time.monotonic() - looked_up > 1.0:
                self.pids, looked_up = group_pids(self.pgid), time.monotonic()
            window = self._window
            rss = resident_bytes(self.pids)
            with self._lock:
                if window == self._window:
                    self.peak = max(self.peak, rss)

    def mark(self) -> int:
        """The resident memory now, which also starts a new peak."""
        rss = resident_bytes(self.pids)
        with self._lock:
            self.peak = rss
            self._window += 1
        return rss

    def peak_since_mark(self) -> int:
        rss = resident_bytes(self.pids)  # the end of the window counts too
        with self._lock:
            self.peak = max(self.peak, rss)
            return self.peak


# --- requests --------------------------------------------------------------------------------


def beam_body(style: str, width: int) -> dict:
    """The extra request fields of a beam search of `width` beams returning all of them: ours
    (`beam_width`, `num_return_sequences`) or vLLM's (`use_beam_search`, `n`)."""
    if style == "vllm":
        return {"use_beam_search": True, "n": width}
    return {"beam_width": width, "num_return_sequences": width}


@dataclass
class Measured:
    """One request at a time: its figures and the memory it added."""

    latency_ms: list[float] = field(default_factory=list)
    extra_mb: list[float] = field(default_factory=list)
    idle_mb: list[float] = field(default_factory=list)
    failed: int = 0
    first_error: str = ""
    items_returned: int = 0
    items_asked: int = 0
    invalid_items: int = 0
    top_texts: list[str | None] = field(default_factory=list)


def measure_one_by_one(base_url: str, sampler: MemorySampler, prompts: list, *, tokenizer, model: str, style: str,
                       width: int, warmup: int, items: bench.ItemTable | None) -> Measured:
    """The first `warmup` prompts unmeasured, then each other prompt alone, timed by bench_serving,
    with the memory it added: the peak while it ran minus the resident memory just before."""
    measured = Measured()
    for index, prompt in enumerate(prompts):
        idle = sampler.mark()
        metrics = bench.run(bench.benchmark(base_url, [prompt], tokenizer=tokenizer, model=model, stream=False,
                                            max_concurrency=1, extra_body=beam_body(style, width),
                                            item_table=items, keep_texts=True))
        extra = sampler.peak_since_mark() - idle
        if index < warmup:
            continue
        if metrics["failed"]:
            measured.failed += 1
            measured.first_error = measured.first_error or metrics["first_error"]
            continue
        measured.latency_ms.append(metrics["median_e2e_latency_ms"])
        measured.extra_mb.append(extra / MB)
        measured.idle_mb.append(idle / MB)
        measured.top_texts.append(metrics["generated_texts"][0])
        if items is not None:
            measured.items_returned += metrics["items_returned"]
            measured.items_asked += metrics["items_asked"]
            measured.invalid_items += metrics["invalid_items"]
    return measured


def latency_row(part: str, table: str, width: int, prompt_tokens: int, measured: Measured) -> dict:
    """A CSV/JSON row: medians over the repetitions, the worst extra memory beside the median."""
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    return {"part": part, "table": table, "width": width, "prompt_tokens": prompt_tokens,
            "requests": len(measured.latency_ms), "failed": measured.failed, "first_error": measured.first_error,
            "median_latency_ms": median(measured.latency_ms),
            "min_latency_ms": min(measured.latency_ms, default=float("nan")),
            "median_extra_mb": median(measured.extra_mb), "max_extra_mb": max(measured.extra_mb, default=float("nan")),
            "idle_rss_mb": median(measured.idle_mb), "items_asked": measured.items_asked,
            "items_returned": measured.items_returned, "invalid_items": measured.invalid_items}


# --- the parts -------------------------------------------------------------------------------


@dataclass
class Setup:
    """What every part shares: the model, its tokenizer, the table file, the server's flags."""

    model: str
    tokenizer: object
    table_path: str
    items: bench.ItemTable
    server_args: list[str]


def write_table(args: argparse.Namespace, tokenizer) -> tuple[str, bench.ItemTable]:
    base = bench.item_token_base(tokenizer, args.item_codebooks * args.item_codes)
    path = os.path.join(RESULTS, f"items-{args.items}x{args.item_codebooks}x{args.item_codes}-base{base}.tsv")
    if os.path.exists(path):
        return path, bench.read_item_table(path)
    table = bench.make_item_table(args.items, args.item_codebooks, args.item_codes, base, args.seed)
    bench.write_item_table(path, table, f"{args.items} items, {args.item_codebooks} codebooks x {args.item_codes} "
                                        f"codes from token {base} (perf/beams.py)")
    return path, table


def start(setup: Setup, with_table: bool, name: str):
    """A fresh server, in a process group of its own (its memory is that group's)."""
    extra = ["--item-table", setup.table_path] if with_table else []
    return servers.running_server(servers.server_command(setup.model, [*setup.server_args, *extra]),
                                  servers.server_log("beams", name), name, own_group=True)


def run_table(setup: Setup, args: argparse.Namespace) -> list[dict]:
    rows = []
    count = args.warmup + args.repetitions
    for table in args.tables:
        with start(setup, table == "items", f"table-{table}") as up, \
                MemorySampler(up.pid, args.sample_ms / 1000) as sampler:
            for index, width in enumerate(args.widths):
                prompts = bench.make_random_prompts(setup.tokenizer, count, args.prompt_tokens, args.rounds,
                                                    seed=args.seed + 1000 * index)
                measured = measure_one_by_one(up.base_url, sampler, prompts, tokenizer=setup.tokenizer,
                                              model=os.path.basename(setup.model), style="ours", width=width,
                                              warmup=args.warmup,
                                              items=setup.items if table == "items" else None)
                rows.append(latency_row("table", table, width, args.prompt_tokens, measured))
                print(f"  {table:<5} W={width:<4} {rows[-1]['median_latency_ms']:9.1f} ms  "
                      f"+{rows[-1]['median_extra_mb']:.0f} MB  failed {measured.failed}", flush=True)
    return rows


def run_throughput(setup: Setup, args: argparse.Namespace) -> dict:
    prompts = bench.make_random_prompts(setup.tokenizer, args.throughput_prompts + args.throughput_concurrency,
                                        args.prompt_tokens, setup.items.item_length, seed=args.seed + 77)
    warm, timed = prompts[:args.throughput_concurrency], prompts[args.throughput_concurrency:]
    common = dict(tokenizer=setup.tokenizer, model=os.path.basename(setup.model), stream=False,
                  max_concurrency=args.throughput_concurrency,
                  extra_body=beam_body("ours", args.throughput_width), item_table=setup.items)
    with start(setup, True, "throughput") as up, MemorySampler(up.pid, args.sample_ms / 1000) as sampler:
        bench.run(bench.benchmark(up.base_url, warm, **common))
        idle = sampler.mark()
        metrics = bench.run(bench.benchmark(up.base_url, timed, **common))
        extra = sampler.peak_since_mark() - idle
    return {"part": "throughput", "table": "items", "width": args.throughput_width,
            "prompt_tokens": args.prompt_tokens, "concurrency": args.throughput_concurrency,
            "requests": metrics["completed"], "failed": metrics["failed"], "first_error": metrics["first_error"],
            "request_throughput": metrics["request_throughput"], "item_throughput": metrics["item_throughput"],
            "median_latency_ms": metrics["median_e2e_latency_ms"], "p99_latency_ms": metrics["p99_e2e_latency_ms"],
            "max_extra_mb": extra / MB, "idle_rss_mb": idle / MB, "items_asked": metrics["items_asked"],
            "items_returned": metrics["items_returned"], "invalid_items": metrics["invalid_items"]}


def write_catalogue(path: str, items: int, codebooks: int, codes: int, base: int, seed: int) -> None:
    """`items` random semantic ids (codebook c's code k is token base + c * codes + k), written with
    numpy: a Python dict of 1.5M tuples would take the client longer than the server."""
    import numpy as np

    if os.path.exists(path):
        return
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, codes, (items, codebooks)) + base + codes * np.arange(codebooks)
    with open(path + ".tmp", "w") as f:
        f.write(f"# {items} items, {codebooks} codebooks x {codes} codes from token {base} (perf/beams.py)\n")
        for start in range(0, items, 100_000):
            rows = tokens[start:start + 100_000].tolist()
            f.write("".join(f"item-{start + i}\t{' '.join(map(str, row))}\n" for i, row in enumerate(rows)))
    os.replace(path + ".tmp", path)


def reload_seconds(up) -> float:
    """SIGHUP the server, then the seconds until its item table load counter moves."""
    import signal
    import urllib.request

    def loads() -> float:
        with urllib.request.urlopen(f"{up.base_url}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("xllm:item_table_loads_total{"))

    before = loads()
    started = time.monotonic()
    os.kill(up.pid, signal.SIGHUP)
    while loads() == before:
        time.sleep(0.05)
    return time.monotonic() - started


def reloads_under_load(up, setup: Setup, args: argparse.Namespace, path: str, body: dict) -> dict:
    """8 clients of beam searches, once quietly and once while the table is reloaded three times
    (the middle time from a bad file, which must leave the old table serving)."""
    prompts = bench.make_random_prompts(setup.tokenizer, args.catalogue_load_prompts, args.prompt_tokens, 4,
                                        seed=args.seed + 66)
    common = dict(tokenizer=setup.tokenizer, model=os.path.basename(setup.model), stream=False, max_concurrency=8,
                  extra_body=body)
    quiet = bench.run(bench.benchmark(up.base_url, prompts, **common))
    outcome = {}

    def reload_three_times() -> None:
        time.sleep(0.5)
        outcome["first"] = reload_seconds(up)
        os.rename(path, path + ".good")
        with open(path, "w") as f:
            f.write("bad\t1 -2 3 4\n")
        try:
            outcome["bad"] = reload_seconds(up)
        finally:
            os.replace(path + ".good", path)
        outcome["last"] = reload_seconds(up)

    reloader = threading.Thread(target=reload_three_times)
    reloader.start()
    busy = bench.run(bench.benchmark(up.base_url, prompts, **common))
    reloader.join()
    return {"load_requests": busy["completed"] + busy["failed"], "load_failed": busy["failed"] + quiet["failed"],
            "quiet_median_ms": quiet["median_e2e_latency_ms"], "quiet_p99_ms": quiet["p99_e2e_latency_ms"],
            "reloading_median_ms": busy["median_e2e_latency_ms"], "reloading_p99_ms": busy["p99_e2e_latency_ms"],
            "reloads_done": len(outcome)}


def run_catalogues(setup: Setup, args: argparse.Namespace) -> list[dict]:
    rows = []
    prompts = bench.make_random_prompts(setup.tokenizer, args.warmup + args.repetitions, args.prompt_tokens, 4,
                                        seed=args.seed + 55)
    for spec in [None, *args.catalogues]:
        extra, name = [], "none"
        if spec is not None:
            items, codebooks, codes = spec
            base = bench.item_token_base(setup.tokenizer, codebooks * codes)
            path = os.path.join(RESULTS, f"catalogue-{items}x{codebooks}x{codes}-base{base}.tsv")
            write_catalogue(path, items, codebooks, codes, base, args.seed)
            extra, name = ["--item-table", path], f"{items}x{codebooks}x{codes}"
        command = servers.server_command(setup.model, [*setup.server_args, *extra])
        started = time.monotonic()
        with servers.running_server(command, servers.server_log("beams", f"catalogue-{name}"), name,
                                    own_group=True) as up, MemorySampler(up.pid, args.sample_ms / 1000) as sampler:
            startup = time.monotonic() - started
            time.sleep(1.0)  # let the start-up's freed pages go back
            ready = sampler.mark()
            rounds = 3 if spec is None else spec[1]
            body = {**beam_body("ours", args.catalogue_width), "max_tokens": rounds}
            latencies = []
            for index, prompt in enumerate(prompts):
                metrics = bench.run(bench.benchmark(up.base_url, [prompt], tokenizer=setup.tokenizer,
                                                    model=os.path.basename(setup.model), stream=False,
                                                    max_concurrency=1, extra_body=body))
                if metrics["failed"]:
                    raise servers.ServerError(f"catalogue {name}: {metrics['first_error']}")
                if index >= args.warmup:
                    latencies.append(metrics["median_e2e_latency_ms"])
            reload = reload_seconds(up) if spec is not None else float("nan")
            loaded = {} if spec is None or not args.catalogue_load_prompts else \
                reloads_under_load(up, setup, args, path, body)
        rows.append({"part": "catalogue", "table": name, "width": args.catalogue_width,
                     "prompt_tokens": args.prompt_tokens, "rounds": rounds, "failed": loaded.get("load_failed", 0),
                     "startup_s": startup, "ready_rss_mb": ready / MB,
                     "median_latency_ms": statistics.median(latencies), "reload_s": reload, **loaded})
        print(f"  catalogue {name:<16} start-up {startup:6.1f} s  resident {ready / MB:7.0f} MB  "
              f"beam {args.catalogue_width} {rows[-1]['median_latency_ms']:8.1f} ms  reload {reload:.2f} s", flush=True)
        if loaded:
            print(f"    8 clients, 3 reloads (one bad file): {loaded['load_requests']} requests, "
                  f"{loaded['load_failed']} failed; median / P99 {loaded['reloading_median_ms']:.0f} / "
                  f"{loaded['reloading_p99_ms']:.0f} ms against {loaded['quiet_median_ms']:.0f} / "
                  f"{loaded['quiet_p99_ms']:.0f} ms without reloads", flush=True)
    return rows


def format_catalogues(rows: list[dict]) -> str:
    none = rows[0]
    lines = ["| item table | start-up | resident at ready (over no table) | beam latency (x no table) | reload |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['table']} | {row['startup_s']:.1f} s | {row['ready_rss_mb']:,.0f} MB "
                     f"(+{row['ready_rss_mb'] - none['ready_rss_mb']:,.0f}) | {row['median_latency_ms']:.1f} ms "
                     f"({row['median_latency_ms'] / none['median_latency_ms']:.2f}x) | "
                     f"{'-' if row is none else format(row['reload_s'], '.2f') + ' s'} |")
    return "\n".join(lines)


def run_widest(setup: Setup, args: argparse.Namespace) -> dict:
    prompts = bench.make_random_prompts(setup.tokenizer, 1 + args.warmup, args.widest_prompt_tokens, args.rounds,
                                        seed=args.seed + 99)
    with start(setup, False, "widest") as up, MemorySampler(up.pid, args.sample_ms / 1000) as sampler:
        measured = measure_one_by_one(up.base_url, sampler, prompts, tokenizer=setup.tokenizer,
                                      model=os.path.basename(setup.model), style="ours", width=args.widest_width,
                                      warmup=args.warmup, items=None)
    return latency_row("widest", "none", args.widest_width, args.widest_prompt_tokens, measured)


# --- report ----------------------------------------------------------------------------------


def format_table(rows: list[dict]) -> str:
    """The issue's table as markdown: a line per (table, width), latency ratios against width 1."""
    lines = ["| item table | beam width | median latency | x width 1 | extra resident memory (median / max) "
             "| items returned | invalid | failed |", "|---|---|---|---|---|---|---|---|"]
    first = {}
    for row in rows:
        first.setdefault(row["table"], row["median_latency_ms"] if row["width"] == 1 else None)
        base = first[row["table"]]
        ratio = f"{row['median_latency_ms'] / base:.2f}x" if base else "-"
        items = (f"{row['items_returned']}/{row['items_asked']}" if row["items_asked"] else "-")
        lines.append(f"| {row['table']} | {row['width']} | {row['median_latency_ms'] / 1000:.3f} s | {ratio} "
                     f"| +{row['median_extra_mb']:,.0f} / +{row['max_extra_mb']:,.0f} MB | {items} "
                     f"| {row['invalid_items'] if row['items_asked'] else '-'} | {row['failed']} |")
    return "\n".join(lines)


def format_throughput(row: dict) -> str:
    return (f"throughput: c={row['concurrency']}, beam {row['width']}, item table, {row['prompt_tokens']}-token "
            f"prompts: {row['request_throughput']:.2f} req/s, {row['item_throughput']:.1f} items/s, median "
            f"{row['median_latency_ms']:.0f} ms, P99 {row['p99_latency_ms']:.0f} ms, items returned "
            f"{row['items_returned']}/{row['items_asked']}, invalid {row['invalid_items']}, failed {row['failed']}, "
            f"peak extra memory +{row['max_extra_mb']:,.0f} MB")


def format_widest(row: dict) -> str:
    verdict = "completed" if row["requests"] and not row["failed"] else f"FAILED: {row['first_error']}"
    return (f"widest: beam {row['width']} on a {row['prompt_tokens']}-token prompt {verdict}: "
            f"{row['median_latency_ms'] / 1000:.2f} s, extra memory +{row['max_extra_mb']:,.0f} MB")


def save(rows: list[dict], args: argparse.Namespace, setup: Setup) -> str:
    stem = os.path.join(RESULTS, datetime.now().strftime("%Y%m%d-%H%M%S"))
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    with open(stem + ".json", "w") as f:
        json.dump({"model": setup.model, "server_args": setup.server_args, "item_table": setup.table_path,
                   "args": vars(args), "cpu": cpu_model(), "rows": rows}, f, indent=1)
    return stem


# --- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the medium random Qwen3, built once)")
    parser.add_argument("--widths", type=positive_ints, default=[1, 16, 64, 128, 256], help="beam widths of the table")
    parser.add_argument("--tables", default="none,items", help="none (whole vocabulary), items (the table), or both")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3, help="tokens a beam search generates (the item length)")
    parser.add_argument("--repetitions", type=int, default=5, help="measured requests per width")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests before them")
    parser.add_argument("--sample-ms", type=float, default=5.0, help="resident memory sampled this often")
    parser.add_argument("--dtype", default="float32", help="the server's XLLM_DTYPE (the issue's figures: float32)")
    parser.add_argument("--ours-streams", type=int, default=2, help="fixed_steps slots (N)")
    parser.add_argument("--server-arg", action="append", default=[], help="one more flag for server.py (repeatable)")
    parser.add_argument("--items", type=int, default=5000, help="items of the table")
    parser.add_argument("--item-codebooks", type=int, default=3)
    parser.add_argument("--item-codes", type=int, default=256)
    parser.add_argument("--throughput", action="store_true", help="also the throughput part")
    parser.add_argument("--throughput-concurrency", type=int, default=8)
    parser.add_argument("--throughput-width", type=int, default=128)
    parser.add_argument("--throughput-prompts", type=int, default=64)
    parser.add_argument("--catalogues", type=catalogue_shapes, default=[],
                        help="item tables at scale, ITEMSxCODEBOOKSxCODES[,...] (e.g. 1520000x4x8192)")
    parser.add_argument("--catalogue-width", type=int, default=128)
    parser.add_argument("--catalogue-load-prompts", type=int, default=64,
                        help="requests of the reloads-under-load part (0: skip it)")
    parser.add_argument("--widest", action="store_true", help="also the widest beam")
    parser.add_argument("--widest-width", type=int, default=512)
    parser.add_argument("--widest-prompt-tokens", type=int, default=2000)
    parser.add_argument("--no-table", dest="table", action="store_false", help="skip the latency table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkout", help="run PATH/server.py, another checkout (a worktree of an older commit: "
                                           "today's figures of an issue's 'now' column)")
    return parser


def catalogue_shapes(text: str) -> list[tuple[int, int, int]]:
    try:
        shapes = [tuple(int(x) for x in part.split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected ITEMSxCODEBOOKSxCODES[,...], got {text!r}")
    return shapes


def check_args(args: argparse.Namespace) -> None:
    args.tables = [name.strip() for name in args.tables.split(",") if name.strip()]
    if not args.tables or set(args.tables) - {"none", "items"}:
        raise SystemExit("beams: --tables takes none, items or both")
    if min(args.repetitions, args.prompt_tokens, args.rounds, args.throughput_prompts) < 1 or args.warmup < 0:
        raise SystemExit("beams: --repetitions, --prompt-tokens, --rounds, --throughput-prompts must be at least 1")
    if ("items" in args.tables or args.throughput) and args.rounds != args.item_codebooks:
        raise SystemExit("beams: with the item table --rounds must equal --item-codebooks (one round per code)")


def make_setup(args: argparse.Namespace) -> Setup:
    model = servers.ensure_model(args.model) if args.model else servers.ensure_random_model("medium")
    os.makedirs(RESULTS, exist_ok=True)
    tokenizer = bench.load_tokenizer(model)
    table_path, items = write_table(args, tokenizer)
    widest = max([*args.widths, args.throughput_width, *([args.widest_width] if args.widest else [])])
    rounds = max([args.rounds, *(codebooks for _, codebooks, _ in args.catalogues)])
    longest = max(args.prompt_tokens, args.widest_prompt_tokens if args.widest else 0) + rounds
    server_args = [*([f"@{args.checkout}"] if args.checkout else []), "--dtype", args.dtype,
                   "--scheduler", "fixed_steps", "--concurrent-execute-stream-num", str(args.ours_streams),
                   "--max-beam-width", str(widest), "--max-num-return-sequences", str(widest),
                   "--max-model-len", str(longest), *args.server_arg]
    return Setup(model, tokenizer, table_path, items, server_args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    servers.interrupt_on_sigterm()
    setup = make_setup(args)
    print(f"model {setup.model}, item table {setup.table_path}, CPU {cpu_model()}", flush=True)
    rows: list[dict] = []
    try:
        if args.table:
            rows += run_table(setup, args)
        if args.throughput:
            rows.append(run_throughput(setup, args))
        if args.widest:
            rows.append(run_widest(setup, args))
        if args.catalogues:
            rows += run_catalogues(setup, args)
    except servers.ServerError as exc:
        print(f"beams: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("beams: interrupted", file=sys.stderr)
        return 130
    table_rows = [row for row in rows if row["part"] == "table"]
    print(f"\n{args.prompt_tokens}-token prompts, {args.rounds} rounds, every beam returned, one request at a time, "
          f"median of {args.repetitions}; dtype {args.dtype}; CPU {cpu_model()}")
    if table_rows:
        print(format_table(table_rows))
    for row in rows:
        if row["part"] == "throughput":
            print(format_throughput(row))
        elif row["part"] == "widest":
            print(format_widest(row))
    catalogue_rows = [row for row in rows if row["part"] == "catalogue"]
    if catalogue_rows:
        print(format_catalogues(catalogue_rows))
    print(f"rows written to {save(rows, args, setup)}.csv and .json")
    return 0 if all(not row["failed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
