"""Offline ceiling: the server's engine run in-process, with no HTTP and no event loop, at the
batch shapes the server forms. What it reports is the most this model can do on this machine;
the gap to perf/sweep.py's served numbers is what serving costs.

    python perf/offline.py --streams 1,2 --batch-sizes 1,2,4,8,16,32 --seconds 2 \\
        --output-file perf/results/offline.jsonl

The pieces are the server's own: one `ModelRunner` (weights loaded once, shared), N
`ExecutionSlot` threads each entering its `StreamBinding` (on CPU: cores // N torch threads
each; on accelerators: a stream each), and `GenerationBatch` prefill + decode rounds to
completion on a slot thread, exactly as `FixedStepsScheduler` runs a batch. Each step's
(request, delta) items are produced and handed to a `deliver` that only counts them, where
the server would wake the event loop.

Throughput: for every N in --streams and B in --batch-sizes, all N slots run batches of B
requests back to back, for --seconds (batches that start before the deadline finish) or for
--batches batches in all; requests/s and output tokens/s over the wall time.

Latency: for every N, one request at a time on one slot of N (the others idle, as at
concurrency 1 behind a server with N slots), --latency-runs times; the median is the floor
under the served median E2E latency at concurrency 1.

Prompts are bench_serving's random ordinary tokens with the same seed as perf/sweep.py,
every request asks exactly --output-len tokens (greedy, EOS ignored). Without --model, the perf
scripts' tiny random Qwen3 is used (perf/servers.py builds it once, nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

import bench_serving as bench
import numpy as np
import servers
import sweep
from cli import positive_ints

import xllm_async  # noqa: F401  (sets torch_npu autoloading and OpenMP spinning before torch loads)
from xllm_async.engine.params import SamplingParams
from xllm_async.engine.request import EngineRequest
from xllm_async.execution.batch import GenerationBatch
from xllm_async.execution.prepare import prepare
from xllm_async.runtime.device import resolve_device
from xllm_async.runtime.executor import ExecutionSlot, start_slots
from xllm_async.runtime.model_runner import ModelRunner, load_runner

# --- one measurement -------------------------------------------------------------------------


class BatchQuota:
    """Hands out the batches of one measurement to the slot threads: a fixed number of them, or
    as many as start before a deadline (the clock starts at the first claim)."""

    def __init__(self, batches: int | None = None, seconds: float | None = None) -> None:
        if (batches is None) == (seconds is None):
            raise ValueError("give either batches or seconds")
        self.batches = batches
        self.seconds = seconds
        self.claimed = 0
        self._deadline: float | None = None
        self._lock = threading.Lock()

    def claim(self) -> int | None:
        """The index of the next batch to run, or None when the measurement is over."""
        with self._lock:
            now = time.perf_counter()
            if self._deadline is None and self.seconds is not None:
                self._deadline = now + self.seconds
            # '>' and not '>=': even a zero-second quota runs one batch, so every point has a figure.
            over = self.claimed >= self.batches if self.batches is not None else now > self._deadline
            if over:
                return None
            self.claimed += 1
            return self.claimed - 1


@dataclass
class SlotTally:
    """What one slot thread ran; written only by that thread."""

    requests: int = 0
    prompt_tokens: int = 0
    deltas: int = 0  # one delta per generated token, as the server delivers them
    batch_seconds: list[float] = field(default_factory=list)
    finished_at: float = 0.0
    error: Exception | None = None

    def deliver(self, items: list) -> None:
        # Where the server calls loop.call_soon_threadsafe: the items exist; we only count them.
        self.deltas += len(items)


@dataclass
class Measurement:
    """The sums over the slots of one run, and its wall time."""

    streams: int
    busy_slots: int
    batch_size: int
    batches: int
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    batch_seconds: list[float]

    def record(self, mode: str, **extra) -> dict:
        """One JSON line: the counts, the rates, the batch-time figures."""
        ms = np.asarray(self.batch_seconds) * 1000.0  # numpy's percentiles, as bench_serving's
        return {"mode": mode, "streams": self.streams, "busy_slots": self.busy_slots, "batch_size": self.batch_size,
                "batches": self.batches, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "seconds": self.seconds,
                "request_throughput": self.requests / self.seconds,
                "output_throughput": self.output_tokens / self.seconds,
                "median_batch_ms": float(np.median(ms)), "p90_batch_ms": float(np.percentile(ms, 90)),
                "min_batch_ms": float(ms.min()), **extra}


def new_requests(prompts: list[list[int]], output_len: int) -> list[EngineRequest]:
    """Fresh requests (they carry generation state) asking exactly output_len greedy tokens."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return [EngineRequest(0, ids, params, None) for ids in prompts]


def run_to_completion(runner: ModelRunner, requests: list[EngineRequest], deliver) -> None:
    """Prefill, then decode rounds until every sequence is done: FixedStepsScheduler's slot job."""
    for req in requests:  # (Engine.submit's part)
        prepare(runner, req)
    batch = GenerationBatch(runner, requests)
    deliver(batch.prefill())
    while batch:
        deliver(batch.decode())


def slot_job(runner: ModelRunner, pool: list[list[int]], batch_size: int, output_len: int, quota: BatchQuota,
             tally: SlotTally, done: threading.Event):
    """The job one slot thread runs: claim a batch, run it to completion, until the quota says stop."""
    def job() -> None:
        try:
            while (index := quota.claim()) is not None:
                start = index * batch_size  # consecutive batches take the pool's next prompts
                prompts = [pool[(start + i) % len(pool)] for i in range(batch_size)]
                began = time.perf_counter()
                run_to_completion(runner, new_requests(prompts, output_len), tally.deliver)
                tally.batch_seconds.append(time.perf_counter() - began)
                tally.requests += batch_size
                tally.prompt_tokens += sum(len(p) for p in prompts)
        except Exception as exc:  # noqa: BLE001  (handed to the waiting thread, which raises it)
            tally.error = exc
        finally:
            tally.finished_at = time.perf_counter()
            done.set()
    return job


def run_batches(runner: ModelRunner, slots: list[ExecutionSlot], busy_slots: int, pool: list[list[int]],
                batch_size: int, output_len: int, quota: BatchQuota) -> Measurement:
    """The first busy_slots of the slots run batches until the quota is spent; blocks until they finish."""
    tallies = [SlotTally() for _ in range(busy_slots)]
    done = [threading.Event() for _ in range(busy_slots)]
    started = time.perf_counter()
    for slot, tally, event in zip(slots, tallies, done):
        slot.submit(slot_job(runner, pool, batch_size, output_len, quota, tally, event))
    for event in done:
        event.wait()
    for tally in tallies:
        if tally.error is not None:
            raise tally.error
    return Measurement(
        streams=len(slots), busy_slots=busy_slots, batch_size=batch_size,
        batches=sum(len(t.batch_seconds) for t in tallies), requests=sum(t.requests for t in tallies),
        prompt_tokens=sum(t.prompt_tokens for t in tallies), output_tokens=sum(t.deltas for t in tallies),
        seconds=max(t.finished_at for t in tallies) - started,
        batch_seconds=[s for t in tallies for s in t.batch_seconds])


def measure_throughput(runner: ModelRunner, slots: list[ExecutionSlot], pool: list[list[int]], batch_size: int,
                       output_len: int, quota: BatchQuota) -> Measurement:
    """Every slot busy with batches of batch_size, after one unmeasured batch each (first-shape costs)."""
    run_batches(runner, slots, len(slots), pool, batch_size, output_len, BatchQuota(batches=len(slots)))
    return run_batches(runner, slots, len(slots), pool, batch_size, output_len, quota)


def measure_latency(runner: ModelRunner, slots: list[ExecutionSlot], pool: list[list[int]], output_len: int,
                    runs: int) -> Measurement:
    """One request at a time on the first slot, the others idle, after one unmeasured run."""
    run_batches(runner, slots, 1, pool, 1, output_len, BatchQuota(batches=1))
    return run_batches(runner, slots, 1, pool, 1, output_len, BatchQuota(batches=runs))


# --- the run ---------------------------------------------------------------------------------


def measure_streams(runner: ModelRunner, streams: int, args: argparse.Namespace, pool: list[list[int]]) -> list[dict]:
    """Latency, then throughput at every batch size, on N freshly started slots."""
    runner.set_kv_cache(None, streams)  # each slot's arena, as the server sizes it
    slots = start_slots(runner.device, streams)
    try:
        if args.graph_max_tokens and runner.device.type != "cpu":  # as the server does (Service._capture_graphs)
            for slot in slots:
                slot.call(lambda: runner.capture_graphs(args.graph_max_tokens))
        extra = {"input_len": args.input_len, "output_len": args.output_len, "slot": describe_slot(slots[0]),
                 "graph_max_tokens": args.graph_max_tokens}
        records = []
        if args.latency_runs:
            records.append(measure_latency(runner, slots, pool, args.output_len, args.latency_runs)
                           .record("latency", **extra))
        for batch_size in args.batch_sizes:
            quota = BatchQuota(batches=args.batches) if args.batches else BatchQuota(seconds=args.seconds)
            records.append(measure_throughput(runner, slots, pool, batch_size, args.output_len, quota)
                           .record("throughput", **extra))
            print_progress(records[-1])
        return records
    finally:
        for slot in slots:
            slot.stop()


def describe_slot(slot: ExecutionSlot) -> str:
    """What the slot's thread is bound to ('cpu with 1 torch thread(s)'), asked on that thread:
    the thread count is per-thread state."""
    answer: list[str] = []
    asked = threading.Event()
    slot.submit(lambda: (answer.append(slot.binding.describe()), asked.set()))
    asked.wait()
    return answer[0]


def print_progress(record: dict) -> None:
    print(f"  N={record['streams']} batch {record['batch_size']:>3}: {record['request_throughput']:9.1f} req/s, "
          f"{record['output_throughput']:9.1f} tok/s ({record['batches']} batches)", flush=True)


def format_table(records: list[dict]) -> str:
    """Throughput rows per (N, batch size), then the single-request latencies."""
    lines = [f"{'N':>3} {'batch':>6} {'batches':>8} {'req/s':>9} {'out tok/s':>10} {'batch ms p50':>13} {'p90':>8}"]
    for r in records:
        if r["mode"] == "throughput":
            lines.append(f"{r['streams']:>3} {r['batch_size']:>6} {r['batches']:>8} {r['request_throughput']:>9.1f} "
                         f"{r['output_throughput']:>10.1f} {r['median_batch_ms']:>13.1f} {r['p90_batch_ms']:>8.1f}")
    for r in records:
        if r["mode"] == "latency":
            lines.append(f"single request on 1 slot of N={r['streams']} ({r['slot']}): median "
                         f"{r['median_batch_ms']:.1f} ms, p90 {r['p90_batch_ms']:.1f} ms, min "
                         f"{r['min_batch_ms']:.1f} ms over {r['batches']} runs")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[dict]:
    """Load the model once, then every N in turn; returns every record."""
    runner = load_runner(args.model, resolve_device(args.devices), args.dtype, quantization=args.quantization)
    # The sweep's prompts: the same tokens, in the same order, as the served benchmark sends.
    pool_size = max(max(args.batch_sizes) * 4, 64)
    prompts = bench.make_random_prompts(runner.tokenizer, pool_size, args.input_len, args.output_len, seed=args.seed)
    pool = [p.prompt for p in prompts]
    header = {"model": args.model, "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
              "quantization": args.quantization, "cpu_count": os.cpu_count(), "seed": args.seed,
              "date": datetime.now().isoformat(timespec="seconds"),
              # Other processes on the cores distort every figure (torch's thread barriers spin): keep the evidence.
              "load_avg_1m": os.getloadavg()[0]}
    records = []
    for streams in args.streams:
        print(f"N={streams}: {streams} slot(s)", flush=True)
        records += [{**r, **header} for r in measure_streams(runner, streams, args, pool)]
    return records


# --- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=servers.DEFAULT_MODEL, help="model folder (default: the sweep's tiny Qwen3)")
    parser.add_argument("--devices", default="auto", help="as server.py: auto, cpu, cuda:N or npu:N")
    parser.add_argument("--dtype", default="auto", help="as server.py: auto, float32, bfloat16, float16")
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "gguf"),
                        help="as server.py: the linear layers' weights plain, int8 or the GGUF file's blocks")
    parser.add_argument("--input-len", type=int, default=sweep.DEFAULT_INPUT, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=sweep.DEFAULT_OUTPUT, help="output tokens per request")
    parser.add_argument("--streams", type=positive_ints, default=[1, 2], help="N slots, comma-separated")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 2, 4, 8, 16, 32],
                        help="requests per batch, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per (N, batch size) point")
    parser.add_argument("--batches", type=int, help="batches per point instead of --seconds")
    parser.add_argument("--latency-runs", type=int, default=30, help="single-request runs per N (0: none)")
    parser.add_argument("--graph-max-tokens", type=int, default=8192,
                        help="as server.py: on accelerators, graphs for forwards of up to this many rows; 0 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-file", help="append one JSON line per point")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.model = servers.ensure_model(args.model)
    except servers.ServerError as exc:
        print(f"offline: {exc}", file=sys.stderr)
        return 1
    records = run(args)
    print()
    print(format_table(records))
    print(f"load average at the start: {records[0]['load_avg_1m']:.2f} on {os.cpu_count()} cores")
    if args.output_file:
        for record in records:
            bench.append_json_line(args.output_file, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
