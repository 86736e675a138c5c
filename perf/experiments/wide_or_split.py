"""One batch of k prompts on every core, or two of k / 2 on one core each: the choice the fixed-steps
batcher makes when requests queue up on an idle CPU server (engine/fixed_steps.py, SPLIT_AT).

Each case runs alone, then beside a thread that behaves like the event loop's: pure-Python bursts
(it holds the GIL and a core) of --burst-ms every --every-ms. Per case the median of --runs
prefills, the two ways alternating so that both meet the same neighbours; "split" is the time until
both halves are done.

    .venv/bin/python perf/experiments/wide_or_split.py --model perf/results/models/qwen3-small --batch-sizes 4,8,16
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import _perf_path  # noqa: F401  (perf/ on sys.path: its tools by name)
import torch
from cli import cpu_model, positive_floats, positive_ints
from servers import ensure_model

import xllm_async  # noqa: F401  (OpenMP settings before torch loads)
from xllm_async.runtime.model_runner import load_runner


class Bursts:
    """A thread that spins for burst_ms every every_ms while the block runs (none if burst_ms is 0)."""

    def __init__(self, burst_ms: float, every_ms: float) -> None:
        self.burst, self.every = burst_ms / 1e3, every_ms / 1e3
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True) if burst_ms else None

    def _run(self) -> None:
        while not self.stop.is_set():
            end = time.perf_counter() + self.burst
            while time.perf_counter() < end:
                pass
            time.sleep(max(0.0, self.every - self.burst))

    def __enter__(self):
        if self.thread:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the tiny random Qwen3)")
    p.add_argument("--batch-sizes", type=positive_ints, default=[4, 8, 16], help="k, even")
    p.add_argument("--input-len", type=int, default=320)
    p.add_argument("--bursts", type=positive_floats, default=[0.5, 1.0], help="burst ms of the loop-like thread")
    p.add_argument("--every-ms", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=25)
    args = p.parse_args(argv)
    runner = load_runner(ensure_model(args.model), torch.device("cpu"))
    runner.warm_up(64, {1, 2})
    rng = random.Random(0)

    def prompts(k: int) -> list[list[int]]:
        return [[rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(k)]

    def wide(k: int) -> float:
        torch.set_num_threads(2)
        started = time.perf_counter()
        runner.prefill(prompts(k))
        return time.perf_counter() - started

    def split(k: int) -> float:
        def half(batch):
            torch.set_num_threads(1)  # per thread: each half on a core of its own
            runner.prefill(batch)
        threads = [threading.Thread(target=half, args=(prompts(k // 2),)) for _ in range(2)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - started

    print(f"{cpu_model()}, {runner.dtype}, {args.input_len}-token prompts, medians of {args.runs} (ms)")
    print("| beside | " + " | ".join(f"k={k}: wide / split" for k in args.batch_sizes) + " |")
    print("|---|" + "---|" * len(args.batch_sizes))
    for burst in [0.0, *args.bursts]:
        cells = []
        with Bursts(burst, args.every_ms):
            for k in args.batch_sizes:
                pairs = [(wide(k), split(k)) for _ in range(args.runs)]
                cells.append(f"{statistics.median(w for w, _ in pairs) * 1e3:.1f} / "
                             f"{statistics.median(s for _, s in pairs) * 1e3:.1f}")
        label = f"a thread busy {burst:g} of every {args.every_ms:g} ms" if burst else "nothing"
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
